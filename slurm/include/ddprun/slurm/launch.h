// ddprun under Slurm (SPEC §7): what `ddprun slurm [flags] prog` runs, and the flags ddprun
// derives for itself when it runs as an srun task. Pure functions of the arguments, an
// environment passed in as a map, and an AddressLookup (a node name -> the address Slurm knows
// for it); the real lookup that runs scontrol is in scontrol.h. Safe from any thread.
//
// How the launcher uses it (launcher/src/main):
//   `ddprun slurm ARGS`:
//       auto plan = slurm::srunCommand(ARGS, env, "/path/of/ddprun",
//                                      slurm::scontrolAddressLookup());
//       error -> print plan.status().message(), exit 2; plan->show_help -> print
//       slurm::slurmHelpText(), exit 0;
//       validate plan->ddprun_args with launcher::parseCommandLine (so a usage error is printed
//       once here, not once per node), then execvp(plan->argv[0], plan->argv).
//   Plain `ddprun ARGS` (every run, before parsing):
//       auto step = slurm::stepArgs(ARGS, env, slurm::scontrolAddressLookup());
//       error -> print it, exit 2; otherwise parse step->args instead of ARGS and, when
//       step->added is not empty, log one notice line listing step->added.
//
// Environment knobs (all optional):
//   DDPRUN_SLURM_PORT=P    rendezvous port on the first node (default 29400, kDefaultRdzvPort).
//                          Two jobs sharing a node must use different ports.
//   DDPRUN_SLURM_AUTO=0    turn off the derivation inside srun steps (stepArgs returns ARGS).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ddprun/common/status.h"

namespace ddprun::slurm {

using Env = std::map<std::string, std::string>;

// Returns the address of Slurm node `node_name` (its NodeAddr, which may differ from the name),
// or an error saying why it could not be found.
using AddressLookup = std::function<StatusOr<std::string>(const std::string& node_name)>;

inline constexpr int kDefaultRdzvPort = 29400;

// What the environment says about the allocation and, inside an srun task, the step.
struct SlurmContext {
  std::string job_id;                   // SLURM_JOB_ID
  std::vector<std::string> job_nodes;   // SLURM_JOB_NODELIST (or SLURM_NODELIST), expanded
  bool in_step = false;                 // an srun task: SLURM_STEP_ID set, not batch/extern
  std::string step_id;                  // SLURM_STEP_ID
  std::vector<std::string> step_nodes;  // SLURM_STEP_NODELIST, expanded
  int step_num_tasks = 0;               // SLURM_STEP_NUM_TASKS
  int node_id = -1;                     // SLURM_NODEID: this node's index in step_nodes
  std::string node_name;                // SLURMD_NODENAME
  int port = kDefaultRdzvPort;          // DDPRUN_SLURM_PORT or the default
};

// True when SLURM_JOB_ID is set (inside sbatch, salloc or srun).
bool inAllocation(const Env& env);

// Reads and checks the Slurm variables. FAILED_PRECONDITION outside an allocation; a missing or
// malformed variable is INVALID_ARGUMENT naming the variable.
StatusOr<SlurmContext> readContext(const Env& env, int default_port = kDefaultRdzvPort);

struct SrunOptions {
  std::string srun = "srun";
  int default_port = kDefaultRdzvPort;
  // Adds --whole so the one task per node gets every CPU of the allocation on its node rather
  // than one (Slurm >= 20.11 gives a step only what it asks for; task/affinity or cgroups would
  // then pin the agent and all its workers to one core).
  bool whole_node = true;
};

struct SrunPlan {
  bool show_help = false;                // -h/--help before the program: print slurmHelpText()
  std::vector<std::string> argv;         // "srun", srun options, ddprun_path, ddprun_args...
  std::vector<std::string> ddprun_args;  // what the ddprun on each node gets
};

// `ddprun slurm [--srun-args="SRUN OPTIONS"] [ddprun flags] prog [args]`, `args` being what
// follows "slurm". Inside an allocation builds
//   srun --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=0 [--whole] [SRUN OPTIONS]
//        DDPRUN_PATH --nnodes=N --rdzv-backend=c10d --rdzv-id=$SLURM_JOB_ID
//        --rdzv-endpoint=<address of the first node of SLURM_JOB_NODELIST>:<port> [flags] prog args
// where N is SLURM_JOB_NUM_NODES. Flags the user gave win: --nnodes MIN:MAX (checked against N),
// --rdzv-id, --rdzv-endpoint. --kill-on-bad-exit=0 because one node's failure is for the
// elastic agents to handle, not a reason for srun to kill the others.
// SRUN OPTIONS are split like a shell (quotes, backslashes) and go after ours, so they win.
// -N/--nodes K there runs on K of the allocation's nodes (nnodes K; the endpoint is then left to
// each task's stepArgs, which knows the step's first node); so do -w/--nodelist, -x/--exclude,
// -r/--relative, -F/--nodefile. -n/--ntasks/--ntasks-per-node are refused: ddprun runs one task
// per node and starts the workers itself.
// Errors (INVALID_ARGUMENT unless said): outside an allocation (FAILED_PRECONDITION, "ddprun
// slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); use sbatch/salloc"), a
// malformed Slurm variable (named), no program, --standalone or --rdzv-backend other than c10d,
// --nnodes whose MIN exceeds the nodes, a failed address lookup (its status, with context).
StatusOr<SrunPlan> srunCommand(const std::vector<std::string>& args, const Env& env,
                               const std::string& ddprun_path, const AddressLookup& lookup,
                               const SrunOptions& options = {});

struct StepArgs {
  bool in_step = false;            // false: not an srun task (or DDPRUN_SLURM_AUTO=0)
  std::vector<std::string> args;   // the arguments to parse: derived flags, then the user's
  std::vector<std::string> added;  // the derived flags, for a one-line notice
};

// When ddprun runs as an srun task (SLURM_JOB_ID and SLURM_STEP_ID set), derives what the user
// did not give (on the command line or as PET_<NAME>):
//   --nnodes=<SLURM_STEP_NUM_NODES>   --rdzv-backend=c10d   --rdzv-id=<SLURM_JOB_ID>
//   --rdzv-endpoint=<address of the step's first node>:<port>
//   --local-addr=<address of this node (SLURMD_NODENAME)>
//   --rdzv-conf=is_host=true on the step's first node whose address or name is the endpoint's
//     host, is_host=false on the others (merged into a --rdzv-conf the user gave without
//     is_host): several slurmd on one host, or one NodeAddr shared by nodes, must still give
//     exactly one rendezvous host. Every task computes the same answer.
//   --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1: Slurm's preemption notice
//     (--signal=USR1@T, scancel --signal=USR1) reaches the workers as the checkpoint signal.
// Nothing is derived (in_step false, args unchanged) outside a step, in the batch/extern/
// interactive pseudo-steps, with DDPRUN_SLURM_AUTO=0, or when the user chose --standalone or a
// --rdzv-backend other than c10d. A step with more tasks than nodes is an error (ddprun is one
// task per node: srun --ntasks-per-node=1), as is a malformed Slurm variable.
StatusOr<StepArgs> stepArgs(const std::vector<std::string>& args, const Env& env,
                            const AddressLookup& lookup, int default_port = kDefaultRdzvPort);

// "host:port", with IPv6 addresses bracketed.
std::string joinHostPort(const std::string& host, int port);

// Splits `text` into words as a POSIX shell would without expansions: blanks separate words,
// '...' is literal, "..." keeps blanks and honours \" \\ \$ \`, a backslash escapes the next
// character. An unterminated quote is INVALID_ARGUMENT.
StatusOr<std::vector<std::string>> splitShellWords(const std::string& text);

// The calling process's environment as an Env.
Env processEnvironment();

// Help for `ddprun slurm --help`.
std::string slurmHelpText();

}  // namespace ddprun::slurm
