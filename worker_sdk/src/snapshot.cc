#include "ddprun/worker/snapshot.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>

#include "ddprun/worker/errors.h"

namespace ddprun::worker {

namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw WorkerError(what + " '" + path + "': " + std::strerror(errno));
}

void fsyncDir(const std::filesystem::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("cannot open snapshot directory", dir.string());
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

void writeFileAtomically(const std::string& path, const std::string& bytes) {
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.parent_path();
  std::error_code ec;
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  std::random_device rd;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rd());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create snapshot file", tmp);
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail("cannot write snapshot file", tmp);
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    ::unlink(tmp.c_str());
    fail("cannot fsync snapshot file", tmp);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    fail("cannot rename snapshot into place at", path);
  }
  fsyncDir(dir);
}

void touchFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot touch heartbeat file", path);
  ::futimens(fd, nullptr);
  ::close(fd);
}

void writeSmallFile(const std::string& path, const std::string& content) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write", path);
  const ssize_t n = ::write(fd, content.data(), content.size());
  ::close(fd);
  if (n != static_cast<ssize_t>(content.size())) fail("cannot write", path);
}

void saveSnapshot(const std::string& path, const torch::nn::Module& model,
                  const torch::optim::Optimizer& optimizer, const TrainingProgress& progress) {
  torch::serialize::OutputArchive root;
  torch::serialize::OutputArchive model_ar;
  model.save(model_ar);
  root.write("model", model_ar);
  torch::serialize::OutputArchive opt_ar;
  optimizer.save(opt_ar);
  root.write("optimizer", opt_ar);
  root.write("epoch", torch::tensor(progress.epoch, torch::kLong));
  root.write("step_in_epoch", torch::tensor(progress.step_in_epoch, torch::kLong));
  root.write("global_step", torch::tensor(progress.global_step, torch::kLong));
  root.write("epoch_loss_sum", torch::tensor(progress.epoch_loss_sum, torch::kDouble));
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    root.write("rng_cpu", gen.get_state());
  }
  std::ostringstream out;
  root.save_to(out);
  writeFileAtomically(path, out.str());
}

bool loadSnapshot(const std::string& path, torch::nn::Module& model,
                  torch::optim::Optimizer& optimizer, TrainingProgress& progress) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return false;
  try {
    torch::serialize::InputArchive root;
    root.load_from(path);
    torch::serialize::InputArchive model_ar;
    root.read("model", model_ar);
    model.load(model_ar);
    torch::serialize::InputArchive opt_ar;
    root.read("optimizer", opt_ar);
    optimizer.load(opt_ar);
    auto readTensor = [&root](const char* key) {
      torch::Tensor t;  // undefined: read() assigns instead of set_() into existing storage
      root.read(key, t);
      return t;
    };
    progress.epoch = readTensor("epoch").item<int64_t>();
    progress.step_in_epoch = readTensor("step_in_epoch").item<int64_t>();
    progress.global_step = readTensor("global_step").item<int64_t>();
    progress.epoch_loss_sum = readTensor("epoch_loss_sum").item<double>();
    torch::Tensor t = readTensor("rng_cpu");
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(t);
  } catch (const c10::Error& e) {
    throw WorkerError("cannot load snapshot '" + path +
                      "' (delete it to start afresh): " + e.what_without_backtrace());
  }
  return true;
}

}  // namespace ddprun::worker
