#include "ddprun/agent/failure_report.h"

#include <catch2/catch.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>

using namespace ddprun::agent;

TEST_CASE("torchrun's error file JSON is parsed, nested or flat", "[agent]") {
  auto nested = parseErrorFile(
      R"({"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback...", "timestamp": "1700000000"}}})");
  REQUIRE(nested);
  CHECK(nested->message == "ValueError: boom");
  CHECK(nested->traceback == "Traceback...");
  CHECK(nested->timestamp == 1700000000.0);
  auto flat = parseErrorFile(R"({"message": "plain"})");
  REQUIRE(flat);
  CHECK(flat->message == "plain");
  CHECK_FALSE(flat->timestamp);
  CHECK_FALSE(parseErrorFile("not json"));
  CHECK_FALSE(parseErrorFile("[1,2]"));
  CHECK_FALSE(parseErrorFile(R"({"other": 1})"));
  CHECK_FALSE(readErrorFile("/nonexistent/error.json"));
}

TEST_CASE("the root cause is the failure with the earliest timestamp", "[agent]") {
  char path[] = "/tmp/ddprun_errfile_XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  {
    std::ofstream out(path);
    out << R"({"message": {"message": "RuntimeError: first", "extraInfo": {"py_callstack": "Traceback: line 1\nRuntimeError: first", "timestamp": "1000"}}})";
  }
  WorkerFailure late{0, 0, 11, ExitStatus{true, SIGSEGV}, 2000.0, "", ""};
  WorkerFailure early{1, 1, 12, ExitStatus{false, 1}, 3000.0, path, ""};  // error file says 1000
  std::string report = formatFailureReport("train.py", "hostA", {late, early});
  std::remove(path);
  INFO(report);
  auto root = report.find("Root Cause");
  REQUIRE(root != std::string::npos);
  CHECK(report.find("train.py FAILED") != std::string::npos);
  // rank 1 (error file timestamp 1000) is the root cause; rank 0 is listed among the others.
  CHECK(report.find("rank      : 1 (local_rank: 1)", root) != std::string::npos);
  CHECK(report.find("rank      : 0 (local_rank: 0)") < root);
  CHECK(report.find("Signal 11 (SIGSEGV) received by PID 11") < root);
  CHECK(report.find("exitcode  : -11 (pid: 11)") != std::string::npos);
  CHECK(report.find("Traceback: line 1", root) != std::string::npos);
  CHECK(report.find(std::string("error_file: ") + path, root) != std::string::npos);
  CHECK(report.find("host      : hostA") != std::string::npos);
}

TEST_CASE("a single failure reports no other failures", "[agent]") {
  WorkerFailure only{0, 0, 5, ExitStatus{false, 3}, 10.0, "", ""};
  std::string report = formatFailureReport("prog", "h", {only});
  CHECK(report.find("<NO_OTHER_FAILURES>") != std::string::npos);
  CHECK(report.find("error_file: <N/A>") != std::string::npos);
  CHECK(signalName(SIGKILL) == "SIGKILL");
}

TEST_CASE("a hung worker's entry says it hung, whatever it wrote when it was stopped", "[agent]") {
  char path[] = "/tmp/ddprun_errfile_XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  {
    // What a PyTorch worker's @record writes when our SIGTERM reaches it, after the hang.
    std::ofstream out(path);
    out << R"({"message": {"message": "SignalException: Process 77 got signal: 15", "extraInfo": {"py_callstack": "SignalException: Process 77 got signal: 15", "timestamp": "500"}}})";
  }
  WorkerFailure hung{1,
                     3,
                     77,
                     ExitStatus{true, SIGTERM},
                     1000.0,
                     path,
                     "worker hung: no heartbeat for 12.0 s (timeout 10 s)"};
  WorkerFailure later{0, 2, 76, ExitStatus{false, 1}, 1001.0, "", ""};
  std::string report = formatFailureReport("train", "hostB", {later, hung});
  std::remove(path);
  INFO(report);
  auto root = report.find("Root Cause");
  REQUIRE(root != std::string::npos);
  // The hang (seen at 1000) is the root cause, not the error file's timestamp.
  CHECK(report.find("rank      : 3 (local_rank: 1)", root) != std::string::npos);
  CHECK(report.find("exitcode  : -15 (pid: 77)", root) != std::string::npos);
  CHECK(report.find("traceback : worker hung: no heartbeat for 12.0 s (timeout 10 s); the agent "
                    "stopped it\n  SignalException",
                    root) != std::string::npos);
  CHECK(report.find("worker hung") > root);  // only the hung rank says so
}

TEST_CASE(
    "a Python worker's failure names the interpreter, and says PYTHON_EXEC on a missing module",
    "[agent]") {
  char templ[] = "/tmp/ddprun_hint_XXXXXX";
  const std::string dir = mkdtemp(templ);
  WorkerFailure f{0, 0, 5, ExitStatus{false, 1}, 10.0, dir + "/error.json", ""};
  CHECK(pythonInterpreterHint("", "PATH", {f}).empty());  // not a Python program
  CHECK(pythonInterpreterHint("/usr/bin/python3", "PATH", {f}) ==
        "note: the workers ran under /usr/bin/python3 (python3 found on PATH); set PYTHON_EXEC "
        "to run another interpreter\n");
  // A redirected stderr.log beside the error file shows the import failure.
  std::ofstream(dir + "/stderr.log") << "Traceback (most recent call last):\n"
                                     << "  File \"train.py\", line 1, in <module>\n"
                                     << "ModuleNotFoundError: No module named 'torch'\n";
  CHECK(pythonInterpreterHint("/usr/bin/python3", "PATH", {f}) ==
        "hint: a worker failed with 'ModuleNotFoundError: No module named 'torch'': the workers "
        "ran under /usr/bin/python3 (python3 found on PATH), which lacks it; set PYTHON_EXEC to "
        "the interpreter that has it (e.g. PYTHON_EXEC=/path/to/venv/bin/python)\n");
  std::remove((dir + "/stderr.log").c_str());
  // So does an error file.
  std::ofstream(dir + "/error.json")
      << R"({"message":{"message":"ModuleNotFoundError: No module named 'apex'",)"
      << R"("extraInfo":{"py_callstack":"","timestamp":"1"}}})";
  CHECK(pythonInterpreterHint("/venv/bin/python", "PYTHON_EXEC", {f})
            .find("'ModuleNotFoundError: No module named 'apex'': the workers ran under "
                  "/venv/bin/python (PYTHON_EXEC)") != std::string::npos);
  std::system(("rm -rf " + dir).c_str());
}
