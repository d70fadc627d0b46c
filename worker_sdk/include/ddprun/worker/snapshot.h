// Training snapshots: model parameters and buffers, optimizer state, progress counters and the
// CPU RNG state, in one torch::serialize archive. Writes are atomic (temp file in the same
// directory, fsync, rename, fsync of the directory): a crash mid-write leaves the previous
// snapshot intact. The archive is followed by a trailer with its length and CRC-32: a damaged
// or truncated file, or a snapshot of a model with other shapes, is refused with an error naming
// the file (snapshots written before the trailer existed still load). Call save on one rank
// only; every rank loads. Not thread-safe per path.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>

namespace ddprun::worker {

struct TrainingProgress {
  std::int64_t epoch = 0;          // epoch to run next (or in progress when step_in_epoch > 0)
  std::int64_t step_in_epoch = 0;  // optimizer steps of `epoch` already done
  std::int64_t global_step = 0;    // optimizer steps
  double epoch_loss_sum = 0;       // this rank's summed step losses so far in `epoch`
  // Micro-batches per optimizer step when the snapshot was taken (TrainerOptions).
  std::int64_t accumulate_steps = 1;
  // fp16 mixed precision's loss scale (LossScaler::State); 0 = none.
  float loss_scale = 0;
  std::int64_t loss_scale_growth_tracker = 0;
};

// Throws WorkerError naming the path when it cannot be written.
void saveSnapshot(const std::string& path, const torch::nn::Module& model,
                  const torch::optim::Optimizer& optimizer, const TrainingProgress& progress);

// The bytes saveSnapshot writes.
std::string encodeSnapshot(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                           const TrainingProgress& progress);
// The same without the model (in-place recovery sends the parameters as tensors): optimizer,
// progress, loss scale and RNG states; loaded by loadTrainingState (errors name `what`).
std::string encodeTrainingState(const torch::optim::Optimizer& optimizer,
                                const TrainingProgress& progress);
void loadTrainingState(const std::string& bytes, const std::string& what,
                       torch::optim::Optimizer& optimizer, TrainingProgress& progress);

// Returns false when no snapshot exists at `path`; throws WorkerError when it exists but cannot be
// read (naming the path). Restores the CPU RNG state too.
bool loadSnapshot(const std::string& path, torch::nn::Module& model,
                  torch::optim::Optimizer& optimizer, TrainingProgress& progress);

// The same from a snapshot file's bytes (readSnapshotFile), as they came from `path`: a rank
// that lacked the snapshot loads what another rank sent it. Throws WorkerError naming `path`.
void loadSnapshotBytes(const std::string& bytes, const std::string& path, torch::nn::Module& model,
                       torch::optim::Optimizer& optimizer, TrainingProgress& progress);

// Removes the temp files an interrupted writeFileAtomically(path, ...) left behind
// (`<path>.tmp.<pid>.<random>` whose writer is no longer alive on this host); returns how many.
int removeStaleTempFiles(const std::string& path);

// The progress recorded in the snapshot at `path` (nothing else is loaded); nullopt when there is
// none. Throws WorkerError naming the path when it exists but cannot be read.
std::optional<TrainingProgress> readSnapshotProgress(const std::string& path);
// The same from a snapshot file's bytes (readSnapshotFile) as they came from `path`, so that a
// caller that also loads or sends them reads the file once and cannot see two versions of it.
TrainingProgress snapshotProgress(const std::string& bytes, const std::string& path);
// The snapshot file's bytes as they are on disk (to hand to a rank that lacks it).
std::string readSnapshotFile(const std::string& path);

// Writes `bytes` to `path` atomically (exposed for tests).
void writeFileAtomically(const std::string& path, const std::string& bytes);

// Creates `path` if missing and sets its modification time to now (heartbeat).
void touchFile(const std::string& path);
// Replaces `path` with `content` (a small status file such as DDPRUN_STOP_FILE).
void writeSmallFile(const std::string& path, const std::string& content);

}  // namespace ddprun::worker
