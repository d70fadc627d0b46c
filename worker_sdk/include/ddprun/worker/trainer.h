// Trainer: the PyTorch DDP tutorial's training loop, so a user program is only a model, a dataset
// and an optimizer. It loads the snapshot if present, runs the remaining epochs (set_epoch on the
// sampler, batches of this rank's shard, DDP backward, optimizer step), saves every `save_every`
// epochs on rank 0, honours SIGTERM/SIGUSR1 (save at the next step boundary, then return
// kStoppedBySignal so the program exits 0), touches the heartbeat file every step and prints
// one line per epoch with the loss averaged across ranks. The large-model loop is two options:
// gradient accumulation (accumulate_steps micro-batches per optimizer step, all but the last
// under DDP's no_sync) and mixed precision (autocast bf16, or fp16 with a loss scaler); steps,
// snapshots and stops count optimizer steps.
// In-place recovery (ddprun --restart-mode=in-place, ProcessGroup::inPlace()): when a peer fails,
// train() aborts the step in flight, re-forms the group the agent names, takes the state of the
// lowest rank that completed the most steps (a replacement rank receives it over the group, not
// from disk) and goes on from that step; the process, its memory and its data stay. SIGTERM to part
// of the world (a spot notice to one node) makes those ranks leave after the agreed step (kLeft;
// a leaving rank 0 saves it) while the others re-form in place without them. Test hook:
// DDPRUN_INPLACE_FAULT=abort:<rank>|sync:<rank> makes that rank exit 1 in that phase (step:<rank>:
// after the first step of its first recovery, before its agent hears of that step); caps:<rank>
// (caps:* every rank) keeps that rank from announcing in-place support, as a program that does
// not speak the control channel.
// Single-threaded: construct and call train() from the rank's main thread.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "ddprun/worker/ddp.h"
#include "ddprun/worker/mixed_precision.h"
#include "ddprun/worker/process_group.h"
#include "ddprun/worker/snapshot.h"

namespace ddprun::worker {

enum class StopAgreement;  // stop_agreement.h (internal)

struct TrainerOptions {
  std::int64_t total_epochs = 1;
  std::int64_t save_every = 1;   // epochs between snapshots; 0 = only on signal
  std::string snapshot_path;     // empty = no snapshots
  std::int64_t batch_size = 32;  // per rank and micro-batch
  // Gradient accumulation (PyTorch: N-1 backward passes under ddp.no_sync()): each optimizer step
  // takes accumulate_steps micro-batches of batch_size, reduced once, at the last backward. Each
  // micro-batch's loss counts by its share of the step's samples (1/N for a full step, as users
  // write loss / N), so a step equals one batch of N * batch_size.
  std::int64_t accumulate_steps = 1;
  // Mixed precision (PyTorch: torch.autocast around forward and loss, torch.amp.GradScaler for
  // fp16): kBf16 autocasts; kFp16 also scales the loss, unscales the reduced gradients, skips the
  // step (and backs the scale off) on inf/NaN. The scale is in the snapshot. Independent of
  // ddp.compression.
  Amp amp = Amp::kNone;
  LossScalerOptions loss_scaler;
  bool shuffle = true;
  std::uint64_t seed = 0;
  std::string heartbeat_file;  // empty = none
  // DDPRUN_STOP_FILE: written when training stops on a checkpoint request instead of finishing,
  // so the agent does not take the exit 0 that follows for the job's success. Empty = none.
  std::string stop_file;
  DdpOptions ddp;
  std::ostream* log = nullptr;  // per-epoch lines; nullptr = std::cout
  // Called after every optimizer step (metrics, fault injection in tests).
  std::function<void(const TrainingProgress&)> on_step;
};

// One in-place recovery, as Trainer::recoveries() lists it.
struct RecoveryReport {
  int generation = 0;  // the group formed
  int world = 0;
  std::int64_t step = 0;  // completed optimizer steps everyone went on from
  int source = -1;        // the rank whose state was taken (-1: every rank already held it)
  double aborted_ms = 0;  // from the failure seen here until the old group was gone
  double formed_ms = 0;   // ... until the new group formed
  double synced_ms = 0;   // ... until the state was in step
};

class Trainer {
 public:
  using Forward = std::function<torch::Tensor(const torch::Tensor&)>;
  using Loss =
      std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;
  // kLeft: under in-place recovery this rank stopped while the others go on (SIGTERM to part of
  // the world: it left and they re-form without it), or while the group was re-forming (a signal
  // during a recovery). Rank 0, if alive, saved the last step it completed; this rank's group is
  // aborted: do no further collectives on it, and exit 0.
  enum class Outcome { kCompleted, kStoppedBySignal, kLeft };

  // `inputs` and `targets` share dimension 0 (the dataset). Constructs the DDP wrapper (a
  // collective) after loading the snapshot, so all ranks start from identical state.
  Trainer(std::shared_ptr<ProcessGroup> group, std::shared_ptr<torch::nn::Module> model,
          Forward forward, Loss loss, std::shared_ptr<torch::optim::Optimizer> optimizer,
          torch::Tensor inputs, torch::Tensor targets, const TrainerOptions& options);
  ~Trainer();

  Outcome train();
  const TrainingProgress& progress() const { return progress_; }
  bool resumed() const { return resumed_; }
  const std::vector<RecoveryReport>& recoveries() const { return recoveries_; }
  DistributedDataParallel& ddp() { return *ddp_; }

 private:
  void save(std::int64_t finished_epoch, const std::string& why);
  void removeTempFilesAtEnd();
  std::ostream& log();
  // `type` on the communicator's device (NCCL: CUDA tensors only), for the small tensors the
  // trainer exchanges itself (resume, stop flag, epoch loss): the SDK's tensor-device rule.
  at::TensorOptions onDevice(at::ScalarType type) const;
  // Whether `path` lies in the directory ddprun's agent replicates (DDPRUN_SNAPSHOT_DIR).
  static bool replicatedByAgent(const std::string& path);

  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<torch::nn::Module> model_;
  Forward forward_;
  Loss loss_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  torch::Tensor inputs_;
  torch::Tensor targets_;
  TrainerOptions options_;
  TrainingProgress progress_;
  bool resumed_ = false;

  // Run after every formation of the group (the start, and each in-place generation), the same
  // collectives on every rank: with ranks that hold live state (survivors of a failure), the
  // lowest at the highest step sends it to every rank behind it or new; else the newest snapshot
  // any rank holds (the lowest holder sends it to those that lack it). Returns the source rank
  // (-1 when every rank already held the state or none had any).
  int syncState();
  int syncLiveState(const std::vector<torch::Tensor>& table, int source, std::int64_t step);
  // A rank that lacked the live state: the optimizer, progress and loss scale from `source`'s.
  void adoptTrainingState(const std::string& bytes, int source, std::int64_t step);
  bool syncSnapshot(const std::vector<torch::Tensor>& table, std::string bytes,
                    const std::string& damaged);
  // `bytes` of rank `source`, on every rank.
  void broadcastBytes(std::string& bytes, int source);
  Outcome trainFromProgress();
  // The agreed stop (stop_agreement.h) at a step boundary: every rank saves and stops, this rank
  // leaves (kLeft), or (others leave) a CommError starts this rank's in-place recovery.
  Outcome stopAsAgreed(StopAgreement agreed, int requests);
  // Rank 0 saves the progress unless it saved this step already.
  void saveOnce(const std::string& why);
  // Stop file, `goodbye reason=stop`, saveOnce(save_why) unless it is empty, the line, the group
  // aborted.
  void leave(const std::string& when, const std::string& save_why = "");
  // After a failure in train(): whether to recover in place (a control channel, and a collective
  // that failed or an abort from the agent).
  bool recoverable(const std::exception& failure);
  // False when a checkpoint signal stopped it while waiting for the new group (kLeft).
  bool recoverInPlace(const std::string& what);
  void reportFirstStep();
  DdpOptions ddpOptions() const;
  std::int64_t saved_step_ = -1;  // the global step of the last snapshot this rank wrote
  bool live_ = false;             // the model holds a state some step completed (not fresh)
  bool live_sync_ = false;        // the last syncState took live state (DDP need not broadcast it)
  bool first_step_pending_ = false;  // the agent waits for the generation's first step
  int marks_token_ = 0;  // peer_wait.h: this Trainer marks its waits in its heartbeat file
  // One optimizer step over micro-batches [first, last) of `index` (this epoch's samples); returns
  // the step's loss (a tensor: no host sync per micro-batch).
  torch::Tensor step(const torch::Tensor& index, std::int64_t first, std::int64_t last);
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<LossScaler> scaler_;  // fp16 only
  std::vector<RecoveryReport> recoveries_;
};

}  // namespace ddprun::worker
