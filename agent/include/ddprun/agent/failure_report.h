// The failure report printed when workers fail past the restart budget (SPEC §4): the same block
// torchrun prints, with the root cause chosen as the failure with the earliest timestamp. Worker
// error files use torchrun's JSON. Pure apart from reading the error files.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "ddprun/agent/supervisor.h"

namespace ddprun::agent {

struct ErrorFileContents {
  std::string message;
  std::string traceback;            // py_callstack when present
  std::optional<double> timestamp;  // unix seconds
};

// Parses torchrun's error-file JSON:
//   {"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "..."}}}
// or the older {"message": "..."}. nullopt when the text is not such a document.
std::optional<ErrorFileContents> parseErrorFile(const std::string& json_text);

// Reads and parses `path`; nullopt when it is absent or unreadable (a worker need not write one).
std::optional<ErrorFileContents> readErrorFile(const std::string& path);

// "SIGKILL" for 9; "signal 99" for unknown numbers.
std::string signalName(int sig);

// What follows the report when the workers ran under the Python `interpreter` (found through
// `source`: "PATH" or "PYTHON_EXEC"; empty interpreter: not Python, and the result is empty). A
// venv's launcher called without activating the venv runs the wrong interpreter, whose failure
// is a ModuleNotFoundError: when a failed worker's error file or redirected stderr.log (beside the
// error file) shows one, the line quotes it and says to set PYTHON_EXEC; otherwise it names the
// interpreter used and how to choose another.
std::string pythonInterpreterHint(const std::string& interpreter, const std::string& source,
                                  const std::vector<WorkerFailure>& failures);

// The report block; `failures` must not be empty.
std::string formatFailureReport(const std::string& entrypoint, const std::string& hostname,
                                const std::vector<WorkerFailure>& failures);

}  // namespace ddprun::agent
