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

// The report block; `failures` must not be empty.
std::string formatFailureReport(const std::string& entrypoint, const std::string& hostname,
                                const std::vector<WorkerFailure>& failures);

}  // namespace ddprun::agent
