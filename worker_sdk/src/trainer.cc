#include "ddprun/worker/trainer.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "collective_fault.h"
#include "control_client.h"
#include "ddprun/worker/errors.h"
#include "ddprun/worker/sampler.h"
#include "ddprun/worker/signals.h"
#include "fault_hooks.h"
#include "peer_wait.h"
#include "posix_files.h"
#include "stop_agreement.h"

namespace ddprun::worker {

Trainer::Trainer(std::shared_ptr<ProcessGroup> group, std::shared_ptr<torch::nn::Module> model,
                 Forward forward, Loss loss, std::shared_ptr<torch::optim::Optimizer> optimizer,
                 torch::Tensor inputs, torch::Tensor targets, const TrainerOptions& options)
    : group_(std::move(group)),
      model_(std::move(model)),
      forward_(std::move(forward)),
      loss_(std::move(loss)),
      optimizer_(std::move(optimizer)),
      inputs_(std::move(inputs)),
      targets_(std::move(targets)),
      options_(options) {
  if (!group_ || !model_ || !forward_ || !loss_ || !optimizer_)
    throw ConfigError("Trainer: null argument");
  if (options_.total_epochs < 0) throw ConfigError("Trainer: total_epochs must be >= 0");
  if (options_.save_every < 0) throw ConfigError("Trainer: save_every must be >= 0");
  if (options_.batch_size < 1) throw ConfigError("Trainer: batch_size must be >= 1");
  if (options_.accumulate_steps < 1) throw ConfigError("Trainer: accumulate_steps must be >= 1");
  const at::DeviceType device = group_->comm().device().type();
  checkAmpSupported(device, options_.amp);
  if (options_.amp == Amp::kFp16) scaler_ = std::make_unique<LossScaler>(options_.loss_scaler);
  if (inputs_.size(0) != targets_.size(0)) {
    throw ConfigError("Trainer: inputs and targets differ in length (" +
                      std::to_string(inputs_.size(0)) + " vs " + std::to_string(targets_.size(0)) +
                      ")");
  }
  // Its heartbeat says whether its collectives wait for their peers: a rank that hangs is told
  // from the ranks that wait for it (peer_wait.h).
  if (!options_.heartbeat_file.empty()) marks_token_ = markWaitsIn(options_.heartbeat_file);
  if (group_->inPlace()) {
    if (!recoveryFaultRequested("caps", group_->rank())) {
      group_->control()->send(
          ddprun::makeControl(ddprun::ControlType::kCaps, {{"add", "inplace"}}));
    }
    first_step_pending_ = true;
  }
  if (!options_.snapshot_path.empty() && group_->rank() == 0 &&
      removeStaleTempFiles(options_.snapshot_path) > 0) {
    log() << "[RANK 0] removed temp files of an interrupted snapshot write next to "
          << options_.snapshot_path << std::endl;
  }
  // Every rank takes the same branch: the options and the channel are the same everywhere.
  if (!options_.snapshot_path.empty() || group_->inPlace()) syncState();
  if (resumed_ && progress_.step_in_epoch > 0 &&
      progress_.accumulate_steps != options_.accumulate_steps) {
    // Mid-epoch, a step is a run of micro-batches: another count would take other samples.
    throw ConfigError("Trainer: the snapshot at " + options_.snapshot_path +
                      " was taken in epoch " + std::to_string(progress_.epoch) + " after " +
                      std::to_string(progress_.step_in_epoch) + " steps of " +
                      std::to_string(progress_.accumulate_steps) +
                      " micro-batches; resume it with accumulate_steps " +
                      std::to_string(progress_.accumulate_steps) + ", not " +
                      std::to_string(options_.accumulate_steps));
  }
  if (resumed_ && scaler_ && progress_.loss_scale > 0) {
    scaler_->restore(LossScaler::State{progress_.loss_scale, progress_.loss_scale_growth_tracker});
  }
  if (resumed_)
    log() << "[RANK " << group_->rank() << "] Resuming training from snapshot at Epoch "
          << progress_.epoch
          << (progress_.step_in_epoch > 0 ? ", step " + std::to_string(progress_.step_in_epoch)
                                          : "")
          << std::endl;
  live_ = true;
  progress_.accumulate_steps = options_.accumulate_steps;
  ddp_ = std::make_unique<DistributedDataParallel>(model_, group_, ddpOptions());
  installCheckpointSignalHandlers();
}

torch::Tensor Trainer::step(const torch::Tensor& index, int64_t first, int64_t last) {
  const int64_t batch = options_.batch_size;
  const int64_t begin = first * batch;
  const int64_t samples = std::min<int64_t>(last * batch, index.size(0)) - begin;
  const at::DeviceType device = group_->comm().device().type();
  optimizer_->zero_grad();
  torch::Tensor step_loss;
  for (int64_t m = first; m < last; ++m) {
    const int64_t len = std::min<int64_t>(batch, index.size(0) - m * batch);
    auto micro = index.narrow(0, m * batch, len);
    auto x = inputs_.index_select(0, micro);
    auto y = targets_.index_select(0, micro);
    // All but the step's last backward accumulate locally; the last reduces the sum.
    std::optional<DistributedDataParallel::NoSyncGuard> no_sync;
    if (m + 1 < last) no_sync.emplace(*ddp_);
    torch::Tensor loss;
    {
      AutocastGuard autocast(device, options_.amp);
      loss = loss_(forward_(x), y);
    }
    if (last - first > 1) loss = loss * (static_cast<double>(len) / static_cast<double>(samples));
    (scaler_ ? loss * static_cast<double>(scaler_->scale()) : loss).backward();
    const torch::Tensor value = loss.detach().to(torch::kFloat);
    step_loss = step_loss.defined() ? step_loss + value : value;
  }
  bool apply = true;
  if (scaler_) {
    // DDP's reduced gradients are the same bits on every rank: so is the verdict.
    const bool found_inf = unscaleGradients(model_->parameters(), scaler_->inverseScale());
    apply = scaler_->update(found_inf);
    progress_.loss_scale = scaler_->state().scale;
    progress_.loss_scale_growth_tracker = scaler_->state().growth_tracker;
  }
  if (apply) optimizer_->step();
  return step_loss;
}

Trainer::~Trainer() {
  if (marks_token_ != 0) stopMarkingWaits(marks_token_);
}

int Trainer::syncState() {
  // Live state (survivors of an in-place recovery) comes first: it is newer than any snapshot.
  // Only ranks with a control channel can hold it (the same on every rank), and then nobody reads
  // a file it does not need.
  live_sync_ = false;
  if (group_->inPlace()) {
    auto live = group_->comm().allGather(torch::tensor(
        {int64_t{live_ ? 1 : 0}, live_ ? progress_.global_step : 0}, onDevice(torch::kLong)));
    int source = -1;
    int64_t step = -1;
    for (size_t r = 0; r < live.size(); ++r) {
      if (live[r][0].item<int64_t>() != 1 || live[r][1].item<int64_t>() <= step) continue;
      step = live[r][1].item<int64_t>();
      source = static_cast<int>(r);
    }
    live_sync_ = source >= 0;  // the same on every rank: one table
    if (live_sync_) return syncLiveState(live, source, step);
  }
  if (options_.snapshot_path.empty()) return -1;
  // Ranks may see different files (local disks, a node that replaced a lost one): they agree on
  // the newest snapshot any of them holds. A damaged file here is no reason to fail while another
  // rank holds a good one (it is sent here like a missing one); every rank fails only when none
  // does. Snapshot state: 0 none, 1 held, 2 damaged.
  // The file is read once: the progress agreed on, the bytes sent and the bytes loaded are one
  // version of it, even if the agent renames a newer copy into place meanwhile.
  const std::string& path = options_.snapshot_path;
  std::optional<TrainingProgress> mine;
  std::string bytes;
  std::string damaged;
  if (files::exists(path)) {
    try {
      bytes = readSnapshotFile(path);
      mine = snapshotProgress(bytes, path);
    } catch (const WorkerError& e) {
      damaged = e.what();
    }
  }
  const int64_t state = mine ? 1 : damaged.empty() ? 0 : 2;
  auto table = group_->comm().allGather(torch::tensor(
      {state, mine ? mine->global_step : 0, mine ? mine->epoch : 0, mine ? mine->step_in_epoch : 0},
      onDevice(torch::kLong)));
  resumed_ = syncSnapshot(table, std::move(bytes), damaged);
  return -1;
}

void Trainer::broadcastBytes(std::string& bytes, int source) {
  Communicator& comm = group_->comm();
  const bool sending = group_->rank() == source;
  auto length = torch::zeros({1}, onDevice(torch::kLong));
  if (sending) length[0] = static_cast<int64_t>(bytes.size());
  comm.broadcast(length, source);
  const int64_t n = length[0].item<int64_t>();
  auto host = torch::empty({n}, torch::kUInt8);
  if (sending) std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
  auto buffer = host.to(comm.device());  // the same tensor on the CPU
  comm.broadcast(buffer, source);
  if (buffer.data_ptr() != host.data_ptr()) host.copy_(buffer);
  if (!sending) bytes.assign(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(n));
}

int Trainer::syncLiveState(const std::vector<torch::Tensor>& table, int source, int64_t step) {
  // A rank that completed step k took part in an all-reduce that summed every rank's gradient,
  // so its state is the fault-free one at k; ranks differ by at most the step in flight.
  auto holds = [&](size_t r) {
    return table[r][0].item<int64_t>() == 1 && table[r][1].item<int64_t>() == step;
  };
  bool anyone_lacks = false;
  for (size_t r = 0; r < table.size(); ++r) anyone_lacks = anyone_lacks || !holds(r);
  if (!anyone_lacks) return -1;
  const int rank = group_->rank();
  // The optimizer and the progress as a small archive; the parameters and buffers as tensors, in
  // module order, in place (no archive to build and parse).
  std::string bytes;
  if (rank == source) bytes = encodeTrainingState(*optimizer_, progress_);
  broadcastBytes(bytes, source);
  {
    // Where broadcast is pipelined (one host's shared memory, NCCL) each tensor is broadcast.
    // Elsewhere (Gloo across hosts, where the source would send everything to each rank in turn)
    // it goes as an all-reduce to which every rank but the source adds -0.0 (0 for integers):
    // x + -0.0 is x bit for bit, -0.0 included, so this is a broadcast that takes the all-reduce's
    // rings. Other dtypes, and a route that pads with +0.0, broadcast. A tensor that appears twice
    // (tied weights, a shared buffer) goes once: a second all-reduce of it would add the first
    // one's result.
    torch::NoGradGuard no_grad;
    Communicator& comm = group_->comm();
    const bool as_all_reduce = comm.sumOfZerosIsExact() && !comm.broadcastIsPipelined();
    std::vector<std::shared_ptr<Work>> works;
    std::set<std::pair<const void*, int64_t>> seen;  // (storage, offset)
    // A rank at the source's step holds its state already (the fault-free state at that step,
    // its own buffers included): where the communicator can, it is left as it is.
    const bool lacking = !holds(static_cast<size_t>(rank));
    auto send = [&](torch::Tensor t) {
      if (!seen.emplace(t.storage().unsafeGetStorageImpl(), t.storage_offset()).second) return;
      const auto type = t.scalar_type();
      const bool summable = as_all_reduce && (type == torch::kFloat || type == torch::kDouble ||
                                              type == torch::kHalf || type == torch::kBFloat16 ||
                                              type == torch::kInt || type == torch::kLong);
      if (!summable) {
        works.push_back(comm.broadcastIfLackingAsync(t, source, lacking));
        return;
      }
      if (rank != source) t.fill_(t.is_floating_point() ? -0.0 : 0.0);
      works.push_back(comm.allReduceAsync(t, ReduceOp::kSum));
    };
    for (auto& p : model_->parameters(true)) send(p.data());
    for (auto& b : model_->buffers(true)) send(b);
    // While the tensors travel, a rank that lacks the state decodes the rest of it (the optimizer
    // keys its state by the parameters but reads none of their values). Whatever happens, no
    // tensor is left to a running collective.
    try {
      if (lacking) adoptTrainingState(bytes, source, step);
    } catch (...) {
      for (auto& w : works) {
        try {
          w->wait();
        } catch (const std::exception&) {  // the decoding's error is the one to report
        }
      }
      throw;
    }
    for (auto& w : works) w->wait();
  }
  return source;
}

void Trainer::adoptTrainingState(const std::string& bytes, int source, int64_t step) {
  const double own_loss = progress_.epoch_loss_sum;
  loadTrainingState(bytes, "rank " + std::to_string(source) + "'s live state", *optimizer_,
                    progress_);
  if (live_) progress_.epoch_loss_sum = own_loss;  // this rank's own share of the epoch's loss
  if (scaler_ && progress_.loss_scale > 0) {
    scaler_->restore(LossScaler::State{progress_.loss_scale, progress_.loss_scale_growth_tracker});
  }
  log() << "[RANK " << group_->rank() << "] took rank " << source << "'s live state after step "
        << step << ": epoch " << progress_.epoch << ", step " << progress_.step_in_epoch
        << std::endl;
}

bool Trainer::syncSnapshot(const std::vector<torch::Tensor>& all, std::string bytes,
                           const std::string& damaged) {
  const std::string& path = options_.snapshot_path;
  const int rank = group_->rank();
  auto key = [](int64_t global_step, int64_t epoch, int64_t step) {
    return std::make_tuple(global_step, epoch, step);
  };
  std::optional<std::tuple<int64_t, int64_t, int64_t>> mine;
  int source = -1;
  int damaged_rank = -1;
  std::tuple<int64_t, int64_t, int64_t> newest{};
  std::vector<std::tuple<int64_t, int64_t, int64_t>> held(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r][0].item<int64_t>() == 2 && damaged_rank < 0) damaged_rank = static_cast<int>(r);
    if (all[r][0].item<int64_t>() != 1) continue;
    held[r] = key(all[r][1].item<int64_t>(), all[r][2].item<int64_t>(), all[r][3].item<int64_t>());
    if (static_cast<int>(r) == rank) mine = held[r];
    if (source < 0 || held[r] > newest) {
      newest = held[r];
      source = static_cast<int>(r);
    }
  }
  if (source < 0 && damaged_rank >= 0) {  // not a fresh start: what was there is unreadable
    throw WorkerError(!damaged.empty() ? damaged
                                       : "rank " + std::to_string(damaged_rank) +
                                             "'s snapshot is damaged and no rank holds a good one");
  }
  if (source < 0) return false;  // nobody has one: a fresh start everywhere
  if (!damaged.empty()) {
    log() << "[RANK " << rank << "] " << damaged << "; resuming from rank " << source
          << "'s snapshot instead" << std::endl;
  }
  bool anyone_lacks = false;
  for (size_t r = 0; r < all.size(); ++r) {
    anyone_lacks = anyone_lacks || all[r][0].item<int64_t>() != 1 || held[r] != newest;
  }
  if (anyone_lacks) {
    broadcastBytes(bytes, source);
    if (!mine || *mine != newest) {
      log() << "[RANK " << rank << "] received the newest snapshot (" << bytes.size()
            << " bytes) from rank " << source;
      if (replicatedByAgent(path)) {
        // ddprun's agent keeps this directory in step with the other nodes: written here, the
        // copy would be a new version of older content, replicated to every node (and able to
        // replace a newer one). The agent brings the file; this rank loads what it was sent.
        log() << ", loaded from memory (ddprun replicates " << path << ")" << std::endl;
      } else {
        writeFileAtomically(path, bytes);
        log() << ", written to " << path << std::endl;
      }
    }
  }
  loadSnapshotBytes(bytes, path, *model_, *optimizer_, progress_);
  return true;
}

bool Trainer::replicatedByAgent(const std::string& path) {
  const char* dir = std::getenv("DDPRUN_SNAPSHOT_DIR");
  if (dir == nullptr || *dir == '\0') return false;
  // Compared resolved: the flag's value may be relative, end in '/', or reach the directory
  // through a symlink, and so may the snapshot path.
  return files::isInside(path, dir);
}

at::TensorOptions Trainer::onDevice(at::ScalarType type) const {
  return at::TensorOptions().dtype(type).device(group_->comm().device());
}

std::ostream& Trainer::log() { return options_.log != nullptr ? *options_.log : std::cout; }

void Trainer::save(int64_t finished_epoch, const std::string& why) {
  if (group_->rank() == 0) {
    saveSnapshot(options_.snapshot_path, *model_, *optimizer_, progress_);
    saved_step_ = progress_.global_step;
    log() << "Epoch " << finished_epoch << " | Training snapshot saved at "
          << options_.snapshot_path << why << std::endl;
  }
}

Trainer::Outcome Trainer::train() {
  for (;;) {
    try {
      return trainFromProgress();
    } catch (const std::exception& e) {
      if (!recoverable(e)) throw;
      if (!recoverInPlace(e.what())) return Outcome::kLeft;
    }
  }
}

bool Trainer::recoverable(const std::exception& failure) {
  if (!group_->inPlace()) return false;
  if (dynamic_cast<const CommError*>(&failure) != nullptr) return true;
  // A collective's failure may reach here wrapped (autograd rethrows a hook's exception as its
  // own): the agent's abort tells it from a failure of the program's own.
  return group_->control()->waitAbort(group_->generation(), std::chrono::seconds(1));
}

bool Trainer::recoverInPlace(const std::string& what) {
  using Ms = std::chrono::duration<double, std::milli>;
  ControlClient& control = *group_->control();
  const auto t0 = std::chrono::steady_clock::now();
  const int old_generation = group_->generation();
  const int rank = group_->rank();
  auto send = [&](ddprun::ControlType type, std::map<std::string, std::string> fields) {
    control.send(ddprun::makeControl(type, std::move(fields)));
  };
  // This rank saw the failure before its agent said so (a peer's socket closed, an op timed out):
  // the agent dates the recovery from the first such report (its phase timings only).
  if (control.abortedGeneration() < old_generation) {
    send(ddprun::ControlType::kFault,
         {{"gen", std::to_string(old_generation)}, {"what", collectiveFaultKind(what)}});
  }
  log() << "[RANK " << rank << "] generation " << old_generation
        << " failed; recovering in place: " << what.substr(0, 300) << std::endl;
  try {
    // Nothing may still write into the gradients or the buckets once they are dropped.
    group_->abort("recovering in place");
    injectRecoveryFault("abort", rank);
    if (!group_->comm().awaitIdle(std::chrono::seconds(2))) {
      send(ddprun::ControlType::kGoodbye, {{"reason", "giveup"}});
      std::cerr << "[RANK " << rank
                << "] in-place recovery: a collective did not end within 2 s of its abort; "
                   "exiting so the agent restarts the processes"
                << std::endl;
      std::_Exit(1);  // exit() would wait for the thread still blocked
    }
    // Shared-memory buckets outlive this DDP until the next one is built: where the new group
    // keeps this host's layout, its buckets take the same pages over instead of new ones.
    std::vector<torch::Tensor> old_buckets;
    if (ddp_ && group_->comm().buffersOutliveAbort()) old_buckets = ddp_->bucketBuffers();
    ddp_.reset();
    for (auto& p : model_->parameters()) p.mutable_grad() = torch::Tensor();
    RecoveryReport report;
    report.aborted_ms = Ms(std::chrono::steady_clock::now() - t0).count();
    send(ddprun::ControlType::kAborted, {{"gen", std::to_string(old_generation)}});
    injectRecoveryFault("wait", rank);
    GroupSpec spec;
    // A generation the agent aborts while it forms (a node lost meanwhile) is given up for the
    // next one; this rank's state is untouched until the sync.
    for (int after = old_generation;; after = spec.generation) {
      auto group = control.waitGroup(after, control.recoveryTimeout(),
                                     [] { return !checkpointRequested(); });
      if (!group && checkpointRequested()) {
        // The job is being stopped while it re-forms: this rank holds the last step it completed
        // (every rank passed through it), which rank 0 of the old group keeps.
        leave("on a signal during the in-place recovery, after step " +
                  std::to_string(progress_.global_step),
              live_ ? " (checkpoint signal during an in-place recovery)" : "");
        return false;
      }
      if (!group) {
        throw CommError("the agent named no new group within " +
                        std::to_string(control.recoveryTimeout().count()) + " ms");
      }
      spec.generation = static_cast<int>(group->num("gen"));
      spec.rank = static_cast<int>(group->num("rank"));
      spec.size = static_cast<int>(group->num("world"));
      spec.master_addr = group->str("addr");
      spec.master_port = static_cast<int>(group->num("port"));
      spec.key = group->str("prefix");
      injectRecoveryFault("form", rank);
      std::string failed;
      try {
        group_->reform(spec);
      } catch (const CommError& e) {
        // A peer lost while the group forms may fail it first (a store that went away): the
        // agent's abort follows once it sees the node gone. Without one it is a real failure.
        if (!control.waitAbort(spec.generation, control.recoveryTimeout())) throw;
        failed = e.what();
      }
      if (failed.empty() && control.abortedGeneration() < spec.generation) break;
      log() << "[RANK " << rank << "] generation " << spec.generation
            << " was aborted by the agent before its state sync"
            << (failed.empty() ? "" : " (" + failed.substr(0, 200) + ")")
            << "; waiting for the next group" << std::endl;
    }
    // Without shared memory in the new group (its hosts no longer hold the same number of
    // ranks) nothing takes the old buckets over: they go before the new ones are allocated.
    if (!group_->comm().buffersOutliveAbort()) old_buckets.clear();
    report.generation = spec.generation;
    report.world = spec.size;
    report.formed_ms = Ms(std::chrono::steady_clock::now() - t0).count();
    send(ddprun::ControlType::kFormed, {{"gen", std::to_string(spec.generation)},
                                        {"rank", std::to_string(spec.rank)},
                                        {"world", std::to_string(spec.size)}});
    const int64_t before = progress_.global_step;
    injectRecoveryFault("sync", spec.rank);
    report.source = syncState();
    report.step = progress_.global_step;
    report.synced_ms = Ms(std::chrono::steady_clock::now() - t0).count();
    send(ddprun::ControlType::kSynced,
         {{"gen", std::to_string(spec.generation)},
          {"step", std::to_string(progress_.global_step)},
          {"source", std::to_string(std::max(report.source, 0))},
          {"discarded", std::to_string(std::max<int64_t>(before - progress_.global_step, 0))}});
    ddp_ = std::make_unique<DistributedDataParallel>(model_, group_, ddpOptions());
    old_buckets.clear();
    first_step_pending_ = true;
    log() << "[RANK " << group_->rank() << "] in-place recovery: generation " << spec.generation
          << " formed (world " << spec.size << "), going on after step " << report.step
          << std::fixed << std::setprecision(1) << "; aborted " << report.aborted_ms
          << " ms, formed " << report.formed_ms << " ms, synced " << report.synced_ms << " ms"
          << std::endl;
    recoveries_.push_back(report);
    return true;
  } catch (const std::exception& e) {
    send(ddprun::ControlType::kGoodbye, {{"reason", "giveup"}});
    throw CommError(std::string("in-place recovery failed: ") + e.what());
  }
}

DdpOptions Trainer::ddpOptions() const {
  DdpOptions o = options_.ddp;
  if (live_sync_) o.broadcast_parameters = false;  // the state sync sent them
  return o;
}

void Trainer::reportFirstStep() {
  if (!first_step_pending_) return;
  first_step_pending_ = false;
  if (recoveries_.size() == 1) injectRecoveryFault("step", group_->rank());
  group_->control()->send(ddprun::makeControl(
      ddprun::ControlType::kStep, {{"gen", std::to_string(std::max(group_->generation(), 1))},
                                   {"n", std::to_string(progress_.global_step)}}));
}

Trainer::Outcome Trainer::trainFromProgress() {
  Communicator& comm = group_->comm();
  const int rank = group_->rank();
  DistributedSampler sampler(SamplerOptions{inputs_.size(0), group_->size(), rank, options_.shuffle,
                                            options_.seed, false});
  const int64_t micro_per_epoch =
      (sampler.numSamples() + options_.batch_size - 1) / options_.batch_size;
  const int64_t steps_per_epoch =
      (micro_per_epoch + options_.accumulate_steps - 1) / options_.accumulate_steps;

  // Stop requests are agreed on one step late: the counts all-reduced after step k are read after
  // step k+1, so their latency hides behind a step and every rank decides at the same boundary.
  // Two counts: ranks asked to stop, and those of them sent SIGTERM (stop_agreement.h).
  torch::Tensor stop_counts = torch::zeros({2}, onDevice(torch::kInt));
  std::shared_ptr<Work> stop_work;
  bool asked = false;  // whether this rank counted itself in the counts in flight
  // What the counts in flight say (none in flight: go on).
  auto agreedStop = [&]() {
    if (!stop_work) return std::make_pair(StopAgreement::kGoOn, 0);
    stop_work->wait();
    stop_work.reset();
    const torch::Tensor counts = stop_counts.to(torch::kCPU);
    const int requests = counts[0].item<int>();
    return std::make_pair(
        agreeOnStop(requests, counts[1].item<int>(), group_->size(), asked, group_->inPlace()),
        requests);
  };
  auto launchStopCounts = [&]() {
    const bool terminating = terminationRequested();
    asked = terminating || checkpointRequested();
    stop_counts.copy_(torch::tensor({asked ? 1 : 0, terminating ? 1 : 0}, torch::kInt));
    stop_work = comm.allReduceAsync(stop_counts, ReduceOp::kSum);
  };

  for (; progress_.epoch < options_.total_epochs; ++progress_.epoch) {
    sampler.setEpoch(progress_.epoch);
    const std::vector<int64_t> idx = sampler.indices();
    auto index = torch::tensor(idx, torch::TensorOptions(torch::kLong).device(inputs_.device()));
    for (int64_t s = progress_.step_in_epoch; s < steps_per_epoch; ++s) {
      const int64_t first = s * options_.accumulate_steps;
      const int64_t last = std::min(first + options_.accumulate_steps, micro_per_epoch);
      progress_.epoch_loss_sum += step(index, first, last).item<double>();
      progress_.step_in_epoch = s + 1;
      ++progress_.global_step;
      if (const int err = touchHeartbeat(); err != 0) {
        throw WorkerError("cannot touch heartbeat file '" + options_.heartbeat_file +
                          "': " + std::strerror(err));
      }
      if (options_.on_step) options_.on_step(progress_);
      reportFirstStep();
      const auto [agreed, requests] = agreedStop();
      if (agreed != StopAgreement::kGoOn) return stopAsAgreed(agreed, requests);
      launchStopCounts();
    }
    auto mean = torch::tensor(
        {progress_.epoch_loss_sum / static_cast<double>(std::max<int64_t>(steps_per_epoch, 1))},
        onDevice(torch::kDouble));
    if (stop_work) stop_work->wait();
    comm.allReduce(mean, ReduceOp::kAvg);
    {
      std::ostringstream line;
      line << "[RANK " << rank << "] Epoch " << progress_.epoch
           << " | Batchsize: " << options_.batch_size << " | Steps: " << steps_per_epoch
           << " | loss " << std::fixed << std::setprecision(6) << mean.item<double>();
      log() << line.str() << std::endl;
    }
    const int64_t finished = progress_.epoch;
    progress_.step_in_epoch = 0;
    progress_.epoch_loss_sum = 0;
    if (!options_.snapshot_path.empty() && options_.save_every > 0 &&
        (finished + 1) % options_.save_every == 0) {
      ++progress_.epoch;  // the snapshot names the next epoch to run
      save(finished, "");
      --progress_.epoch;
    }
    const auto [agreed, requests] = agreedStop();
    if (agreed != StopAgreement::kGoOn) {
      ++progress_.epoch;
      return stopAsAgreed(agreed, requests);
    }
  }
  if (stop_work) stop_work->wait();
  removeTempFilesAtEnd();
  return Outcome::kCompleted;
}

Trainer::Outcome Trainer::stopAsAgreed(StopAgreement agreed, int requests) {
  if (agreed == StopAgreement::kAllStop) {
    if (!options_.stop_file.empty()) {
      // The exit 0 that follows is a stop, not the end of training: an agent that did not ask
      // for it (a peer rank's node did) re-forms the job instead of finishing.
      writeSmallFile(options_.stop_file, checkpointRequested()
                                             ? "checkpoint requested by a signal to this rank\n"
                                             : "checkpoint requested by a peer rank\n");
    }
    if (!options_.snapshot_path.empty()) save(progress_.epoch, " (checkpoint signal)");
    group_->comm().barrier();  // nobody exits before the snapshot is on disk
    removeTempFilesAtEnd();
    return Outcome::kStoppedBySignal;
  }
  // Part of the world was sent SIGTERM: it leaves, the others re-form in place without it. A
  // leaving rank 0 saves the step every rank completed; a staying one saves it only if a signal
  // stops it too while it re-forms (a stop of the whole job whose signals reached the ranks a step
  // apart): either way such a stop ends with that step's snapshot, and a leave costs the others
  // no save.
  const std::string after = "after step " + std::to_string(progress_.global_step);
  if (agreed == StopAgreement::kOthersLeave) {
    throw CommError(std::to_string(requests) + " of " + std::to_string(group_->size()) +
                    " ranks were sent SIGTERM and left the job " + after);
  }
  leave("on SIGTERM " + after + "; the other ranks go on in place", " (checkpoint signal)");
  return Outcome::kLeft;
}

void Trainer::saveOnce(const std::string& why) {
  if (!options_.snapshot_path.empty() && saved_step_ != progress_.global_step) {
    save(progress_.epoch, why);
  }
}

void Trainer::leave(const std::string& when, const std::string& save_why) {
  if (!options_.stop_file.empty())
    writeSmallFile(options_.stop_file, "left the job " + when + "\n");
  group_->control()->send(ddprun::makeControl(ddprun::ControlType::kGoodbye, {{"reason", "stop"}}));
  // After the goodbye: the agent may let the other nodes re-form while rank 0 saves.
  if (!save_why.empty()) saveOnce(save_why);
  log() << "[RANK " << group_->rank() << "] left the job " << when << std::endl;
  group_->abort("this rank left the job");  // (the job goes on: its temp files are not ours)
}

void Trainer::removeTempFilesAtEnd() {
  // A snapshot write that a previous attempt did not finish (killed mid-write) leaves a temp file
  // that the next start would remove: the job is ending, so remove it now.
  if (options_.snapshot_path.empty() || group_->rank() != 0) return;
  if (removeStaleTempFiles(options_.snapshot_path) > 0) {
    log() << "[RANK 0] removed temp files of an interrupted snapshot write next to "
          << options_.snapshot_path << std::endl;
  }
}

}  // namespace ddprun::worker
