#include "ddprun/worker/snapshot.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/cuda.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string_view>
#include <vector>

#include "ddprun/common/crc32.h"
#include "ddprun/worker/errors.h"
#include "posix_files.h"

namespace ddprun::worker {

namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw WorkerError(what + " '" + path + "': " + std::strerror(errno));
}

// Every snapshot ends in a trailer: magic, the archive's length and its CRC-32, so a file damaged
// at rest or in transit is refused instead of loading garbage (torch's archive checks neither).
constexpr char kTrailerMagic[8] = {'D', 'D', 'P', 'S', 'N', 'A', 'P', '1'};
constexpr size_t kTrailerSize = 8 + 8 + 4;

uint32_t crc32Of(const char* data, size_t n) { return crc32Update(0, data, n); }

void appendTrailer(std::string& bytes) {
  const uint64_t length = bytes.size();
  const uint32_t crc = crc32Of(bytes.data(), bytes.size());
  bytes.append(kTrailerMagic, sizeof(kTrailerMagic));
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));
}

// The archive inside `bytes`: checked against its trailer, or the whole content for a snapshot
// written before trailers existed. Throws WorkerError naming `path` when the check fails.
std::string_view checkedArchive(const std::string& bytes, const std::string& path) {
  if (bytes.size() < kTrailerSize || std::memcmp(bytes.data() + bytes.size() - kTrailerSize,
                                                 kTrailerMagic, sizeof(kTrailerMagic)) != 0) {
    return bytes;
  }
  const auto* t =
      reinterpret_cast<const unsigned char*>(bytes.data() + bytes.size() - kTrailerSize + 8);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(t[i]) << (8 * i);
  uint32_t crc = 0;
  for (int i = 0; i < 4; ++i) crc |= static_cast<uint32_t>(t[8 + i]) << (8 * i);
  if (length != bytes.size() - kTrailerSize || crc32Of(bytes.data(), length) != crc) {
    throw WorkerError("cannot load snapshot '" + path +
                      "': the file is unreadable (its checksum does not match: damaged or "
                      "truncated; delete it to start afresh)");
  }
  return std::string_view(bytes.data(), length);
}

// Shapes of every parameter and buffer, by name: a snapshot of another model must not load.
std::map<std::string, std::vector<int64_t>> shapesOf(const torch::nn::Module& model) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& p : model.named_parameters()) out[p.key()] = p.value().sizes().vec();
  for (const auto& b : model.named_buffers()) out[b.key()] = b.value().sizes().vec();
  return out;
}

void fsyncDir(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("cannot open snapshot directory", dir);
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

namespace {
// While alive, a write past RLIMIT_FSIZE fails with EFBIG instead of killing the process with
// SIGXFSZ, which would leave the temp file behind.
class IgnoreFileSizeSignal {
 public:
  IgnoreFileSizeSignal() {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigemptyset(&ignore.sa_mask);
    saved_ = ::sigaction(SIGXFSZ, &ignore, &previous_) == 0;
  }
  ~IgnoreFileSizeSignal() {
    if (saved_) ::sigaction(SIGXFSZ, &previous_, nullptr);
  }
  IgnoreFileSizeSignal(const IgnoreFileSizeSignal&) = delete;
  IgnoreFileSizeSignal& operator=(const IgnoreFileSizeSignal&) = delete;

 private:
  struct sigaction previous_ {};
  bool saved_ = false;
};
}  // namespace

void writeFileAtomically(const std::string& path, const std::string& bytes) {
  if (files::isDirectory(path)) {
    throw WorkerError("cannot write snapshot '" + path +
                      "': it is a directory; give a file's path (e.g. " + path + "/snapshot.pt)");
  }
  const std::string dir = files::parentOf(path);
  files::makeDirs(dir);  // a failure shows as the open's below
  std::random_device rd;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rd());
  IgnoreFileSizeSignal no_sigxfsz;
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create snapshot file", tmp);
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      errno = error;
      fail(error == EFBIG
               ? "cannot write snapshot file (larger than the process's file size limit, "
                 "ulimit -f)"
               : "cannot write snapshot file",
           tmp);
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

int removeStaleTempFiles(const std::string& path) {
  const std::string parent = files::parentOf(path);
  const std::string dir = parent.empty() ? "." : parent;
  const std::string prefix = files::nameOf(path) + ".tmp.";
  const auto names = files::listDir(dir);
  if (!names) return 0;
  int removed = 0;
  for (const std::string& name : *names) {
    if (name.rfind(prefix, 0) != 0) continue;
    // <path>.tmp.<pid>.<random>, as writeFileAtomically names them: a writer that is still alive
    // on this host keeps its file.
    const std::string rest = name.substr(prefix.size());
    const size_t dot = rest.find('.');
    if (dot == std::string::npos || dot == 0) continue;
    if (rest.find_first_not_of("0123456789") != dot) continue;
    const long pid = std::strtol(rest.substr(0, dot).c_str(), nullptr, 10);
    if (pid > 0 && pid <= INT32_MAX && ::kill(static_cast<pid_t>(pid), 0) == 0) continue;
    if (::unlink((dir + "/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

void writeSmallFile(const std::string& path, const std::string& content) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write", path);
  const ssize_t n = ::write(fd, content.data(), content.size());
  ::close(fd);
  if (n != static_cast<ssize_t>(content.size())) fail("cannot write", path);
}

namespace {
// CUDA devices whose generators a snapshot carries: none with a CPU-only LibTorch.
int cudaDevices() { return torch::cuda::is_available() ? torch::cuda::device_count() : 0; }
}  // namespace

void saveSnapshot(const std::string& path, const torch::nn::Module& model,
                  const torch::optim::Optimizer& optimizer, const TrainingProgress& progress) {
  writeFileAtomically(path, encodeSnapshot(model, optimizer, progress));
}

namespace {

std::string encodeArchive(const torch::nn::Module* model, const torch::optim::Optimizer& optimizer,
                          const TrainingProgress& progress) {
  torch::serialize::OutputArchive root;
  if (model != nullptr) {
    torch::serialize::OutputArchive model_ar;
    model->save(model_ar);
    root.write("model", model_ar);
  }
  torch::serialize::OutputArchive opt_ar;
  optimizer.save(opt_ar);
  root.write("optimizer", opt_ar);
  root.write("epoch", torch::tensor(progress.epoch, torch::kLong));
  root.write("step_in_epoch", torch::tensor(progress.step_in_epoch, torch::kLong));
  root.write("global_step", torch::tensor(progress.global_step, torch::kLong));
  root.write("epoch_loss_sum", torch::tensor(progress.epoch_loss_sum, torch::kDouble));
  root.write("accumulate_steps", torch::tensor(progress.accumulate_steps, torch::kLong));
  if (progress.loss_scale > 0) {
    root.write("loss_scale", torch::tensor(progress.loss_scale, torch::kFloat));
    root.write("loss_scale_growth_tracker",
               torch::tensor(progress.loss_scale_growth_tracker, torch::kLong));
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    root.write("rng_cpu", gen.get_state());
  }
  // Each CUDA device's generator (dropout on the GPU), where LibTorch has CUDA.
  for (int d = 0; d < cudaDevices(); ++d) {
    auto gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, d));
    std::lock_guard<std::mutex> lock(gen.mutex());
    root.write("rng_cuda" + std::to_string(d), gen.get_state());
  }
  std::ostringstream out;
  root.save_to(out);
  std::string bytes = std::move(out).str();
  appendTrailer(bytes);
  return bytes;
}

}  // namespace

std::string encodeSnapshot(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                           const TrainingProgress& progress) {
  return encodeArchive(&model, optimizer, progress);
}

std::string encodeTrainingState(const torch::optim::Optimizer& optimizer,
                                const TrainingProgress& progress) {
  return encodeArchive(nullptr, optimizer, progress);
}

std::string readSnapshotFile(const std::string& path) {
  if (files::isDirectory(path)) {
    throw WorkerError("cannot read snapshot '" + path +
                      "': it is a directory, not a snapshot file; give the file's path (e.g. " +
                      path + "/snapshot.pt) or remove the directory");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open snapshot", path);
  std::string bytes(std::istreambuf_iterator<char>(in), {});
  if (in.bad()) fail("cannot read snapshot", path);
  return bytes;
}

namespace {
TrainingProgress readProgress(torch::serialize::InputArchive& root) {
  auto readTensor = [&root](const char* key) {
    torch::Tensor t;  // undefined: read() assigns instead of set_() into existing storage
    root.read(key, t);
    return t;
  };
  TrainingProgress progress;
  progress.epoch = readTensor("epoch").item<int64_t>();
  progress.step_in_epoch = readTensor("step_in_epoch").item<int64_t>();
  progress.global_step = readTensor("global_step").item<int64_t>();
  progress.epoch_loss_sum = readTensor("epoch_loss_sum").item<double>();
  // Keys that snapshots written before accumulation and mixed precision lack (each read into a
  // fresh tensor, as readTensor does).
  torch::Tensor steps, scale, tracker;
  if (root.try_read("accumulate_steps", steps)) progress.accumulate_steps = steps.item<int64_t>();
  if (root.try_read("loss_scale", scale)) {
    progress.loss_scale = scale.item<float>();
    root.read("loss_scale_growth_tracker", tracker);
    progress.loss_scale_growth_tracker = tracker.item<int64_t>();
  }
  return progress;
}

[[noreturn]] void unreadable(const std::string& path, const char* detail) {
  throw WorkerError("cannot load snapshot '" + path +
                    "': the file is unreadable or not a snapshot of this model (delete it to "
                    "start afresh): " +
                    detail);
}
}  // namespace

std::optional<TrainingProgress> readSnapshotProgress(const std::string& path) {
  if (!files::exists(path)) return std::nullopt;
  return snapshotProgress(readSnapshotFile(path), path);
}

TrainingProgress snapshotProgress(const std::string& bytes, const std::string& path) {
  const std::string_view archive = checkedArchive(bytes, path);
  try {
    torch::serialize::InputArchive root;
    root.load_from(archive.data(), archive.size());
    return readProgress(root);
  } catch (const c10::Error& e) {
    unreadable(path, e.what_without_backtrace());
  } catch (const std::exception& e) {
    unreadable(path, e.what());
  }
}

bool loadSnapshot(const std::string& path, torch::nn::Module& model,
                  torch::optim::Optimizer& optimizer, TrainingProgress& progress) {
  if (!files::exists(path)) return false;
  loadSnapshotBytes(readSnapshotFile(path), path, model, optimizer, progress);
  return true;
}

namespace {

void loadArchive(const std::string& bytes, const std::string& path, torch::nn::Module* model,
                 torch::optim::Optimizer& optimizer, TrainingProgress& progress) {
  const std::string_view archive = checkedArchive(bytes, path);
  try {
    torch::serialize::InputArchive root;
    root.load_from(archive.data(), archive.size());
    if (model != nullptr) {
      const auto shapes = shapesOf(*model);
      torch::serialize::InputArchive model_ar;
      root.read("model", model_ar);
      model->load(model_ar);
      if (shapesOf(*model) != shapes) {
        throw WorkerError("cannot load snapshot '" + path +
                          "': the file is unreadable as a snapshot of this model (its parameters "
                          "have other shapes; delete it to start afresh)");
      }
    }
    torch::serialize::InputArchive opt_ar;
    root.read("optimizer", opt_ar);
    optimizer.load(opt_ar);
    progress = readProgress(root);
    torch::Tensor t;
    root.read("rng_cpu", t);
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(t);
    }
    // A snapshot from a machine with other (or no) GPUs restores what both have.
    for (int d = 0; d < cudaDevices(); ++d) {
      torch::Tensor state;
      if (!root.try_read("rng_cuda" + std::to_string(d), state)) break;
      auto gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, d));
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  } catch (const c10::Error& e) {
    unreadable(path, e.what_without_backtrace());
  } catch (const WorkerError&) {
    throw;
  } catch (const std::exception& e) {
    // A damaged archive can fail deep inside the reader with a message that names nothing.
    unreadable(path, e.what());
  }
}

}  // namespace

void loadSnapshotBytes(const std::string& bytes, const std::string& path, torch::nn::Module& model,
                       torch::optim::Optimizer& optimizer, TrainingProgress& progress) {
  loadArchive(bytes, path, &model, optimizer, progress);
}

void loadTrainingState(const std::string& bytes, const std::string& what,
                       torch::optim::Optimizer& optimizer, TrainingProgress& progress) {
  loadArchive(bytes, what, nullptr, optimizer, progress);
}

}  // namespace ddprun::worker
