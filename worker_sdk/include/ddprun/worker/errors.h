// Exceptions thrown by the worker SDK. The SDK follows LibTorch: misuse and failures surface as
// std::runtime_error subclasses, each message naming what went wrong and how to fix it.
#pragma once

#include <stdexcept>
#include <string>

namespace ddprun::worker {

// Base of every SDK exception.
class WorkerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A missing or malformed environment variable or option.
class ConfigError : public WorkerError {
 public:
  using WorkerError::WorkerError;
};

// A collective or store operation failed (peer gone, timeout, mismatched sizes).
class CommError : public WorkerError {
 public:
  using WorkerError::WorkerError;
};

}  // namespace ddprun::worker
