#include "ddprun/slurm/launch.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <optional>

#include "ddprun/common/launch_flags.h"
#include "ddprun/common/strings.h"
#include "ddprun/slurm/hostlist.h"

namespace ddprun::slurm {
namespace {

constexpr char kSrunArgsFlag[] = "srun_args";  // `ddprun slurm` only
constexpr char kSlurmSignals[] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1";

// `ddprun slurm` reads ddprun's flags plus its own --srun-args. Its metavar completes the
// tokenizer's "expected one argument (...)" message.
const std::vector<LaunchFlag>& wrapperFlags() {
  static const std::vector<LaunchFlag> kFlags = [] {
    std::vector<LaunchFlag> flags = launchFlags();
    flags.push_back({kSrunArgsFlag, 0, true,
                     "srun options in one string, e.g. --srun-args=\"--exclusive --time=10\"",
                     "Extra srun options (shell quoting)."});
    return flags;
  }();
  return kFlags;
}

struct GivenFlag {
  std::string value;
  size_t token = 0;  // index in Scan::tokens.tokens: where it is in the arguments
};

// The user's arguments as the shared tokenizer reads them: flags before the program (last one
// wins, as in the launcher), where the program starts, and the wrapper-only --srun-args (removed
// from `rest`). Malformed flags are not this code's business: they pass through to the ddprun on
// each node, whose parser reports them (main validates the result once before srun). A flag
// known but malformed still counts as given (a valueless one as "1").
struct Scan {
  TokenizedArgs tokens;
  std::map<std::string, GivenFlag> given;  // canonical name -> value
  std::vector<std::string> rest;           // args without --srun-args
  std::optional<std::string> srun_args;
  bool has_program = false;
  bool help = false;  // -h/--help before the program
};

StatusOr<Scan> scanArgs(const std::vector<std::string>& args, bool wrapper) {
  Scan scan;
  scan.tokens = tokenizeLaunchArgs(args, wrapper ? wrapperFlags() : launchFlags());
  for (size_t i = 0; i < scan.tokens.tokens.size(); ++i) {
    const ArgToken& t = scan.tokens.tokens[i];
    if (t.kind == ArgToken::Kind::kHelp) scan.help = true;
    if (t.flag != nullptr && t.flag->name == std::string(kSrunArgsFlag)) {
      if (!t.value) return invalidArgument("ddprun slurm: " + t.error);
      scan.srun_args = *t.value;
      continue;
    }
    if (t.flag != nullptr) scan.given[t.flag->name] = GivenFlag{t.value.value_or("1"), i};
    scan.rest.insert(scan.rest.end(), args.begin() + static_cast<long>(t.begin),
                     args.begin() + static_cast<long>(t.end));
  }
  scan.has_program = scan.tokens.program.has_value();
  scan.rest.insert(scan.rest.end(), args.begin() + static_cast<long>(scan.tokens.rest_begin),
                   args.end());
  return scan;
}

// The user's value of a flag: the command line, else PET_<NAME>.
std::optional<std::string> userValue(const Scan& scan, const Env& env, const std::string& canon) {
  if (auto it = scan.given.find(canon); it != scan.given.end()) return it->second.value;
  if (auto it = env.find(petName(canon)); it != env.end()) return it->second;
  return std::nullopt;
}

bool truthy(const std::optional<std::string>& v) {
  if (!v) return false;
  auto b = parseBool(*v);
  return b.value_or(false);
}

std::optional<std::string> get(const Env& env, const char* name) {
  auto it = env.find(name);
  if (it == env.end() || trim(it->second).empty()) return std::nullopt;
  return trim(it->second);
}

StatusOr<int> positiveInt(const Env& env, const char* name, long long max) {
  auto text = get(env, name);
  if (!text) return invalidArgument(std::string(name) + " is not set");
  auto v = parseInt(*text);
  if (!v || *v < 1 || *v > max) {
    return invalidArgument(std::string(name) + "='" + *text + "' is not a count between 1 and " +
                           std::to_string(max));
  }
  return static_cast<int>(*v);
}

StatusOr<std::vector<std::string>> nodeList(const Env& env, const char* name) {
  auto text = get(env, name);
  if (!text) return invalidArgument(std::string(name) + " is not set");
  auto hosts = expandHostlist(*text);
  if (!hosts.isOk()) {
    return invalidArgument(std::string(name) + " is malformed: " + hosts.status().message());
  }
  return hosts;
}

// Slurm's pseudo-steps (batch script, extern, interactive, pending) are 0xFFFFFFF0 and up; only
// numbered srun steps run ddprun as one task per node.
bool isSrunStepId(const std::string& id) {
  auto v = parseInt(id);
  return v && *v >= 0 && *v < 0xFFFFFFF0LL;
}

// MIN of "N" or "MIN:MAX"; nullopt when malformed (the launcher's parser reports that).
std::optional<long long> minNodes(const std::string& nnodes) {
  auto parts = split(nnodes, ':');
  if (parts.empty() || parts.size() > 2) return std::nullopt;
  return parseInt(trim(parts[0]));
}

// The host part of "host[:port]" / "[v6]:port".
std::string endpointHost(const std::string& endpoint) {
  if (startsWith(endpoint, "[")) {
    auto close = endpoint.find(']');
    return close == std::string::npos ? endpoint : endpoint.substr(1, close - 1);
  }
  auto colon = endpoint.find(':');
  if (colon != std::string::npos && endpoint.find(':', colon + 1) != std::string::npos) {
    return endpoint;  // a bare IPv6 address
  }
  return endpoint.substr(0, colon);
}

StatusOr<std::string> lookupAddress(const AddressLookup& lookup, const std::string& node) {
  auto addr = lookup(node);
  if (!addr.isOk()) return addr.status();
  if (trim(*addr).empty()) {
    return invalidArgument("Slurm gives node '" + node + "' an empty address");
  }
  return trim(*addr);
}

// What srun options in --srun-args say about the step's nodes.
struct SrunArgsFacts {
  std::vector<std::string> words;
  std::optional<int> nodes;    // -N/--nodes K
  bool selects_nodes = false;  // -w/-x/-r/-F: which nodes is up to srun
};

StatusOr<SrunArgsFacts> inspectSrunArgs(const std::string& text, int job_nodes) {
  SrunArgsFacts facts;
  DDPRUN_ASSIGN_OR_RETURN(facts.words, splitShellWords(text));
  const auto& w = facts.words;
  auto optionValue = [&](size_t& i, const std::string& shortName,
                         const std::string& longName) -> std::optional<std::string> {
    const std::string& a = w[i];
    if (a == shortName || a == longName) {
      if (i + 1 < w.size()) return w[++i];
      return std::string();
    }
    if (startsWith(a, longName + "=")) return a.substr(longName.size() + 1);
    if (a.size() > 2 && startsWith(a, shortName) && shortName.size() == 2) return a.substr(2);
    return std::nullopt;
  };
  for (size_t i = 0; i < w.size(); ++i) {
    const std::string& a = w[i];
    if (a == "-n" || startsWith(a, "--ntasks") || (startsWith(a, "-n") && a.size() > 2)) {
      return invalidArgument("ddprun slurm: --srun-args must not set " + a +
                             ": ddprun runs one task per node (--ntasks-per-node=1) and starts "
                             "the workers itself; use --nproc-per-node for workers per node");
    }
    if (auto k = optionValue(i, "-N", "--nodes")) {
      auto v = parseInt(*k);
      if (!v || *v < 1 || *v > job_nodes) {
        return invalidArgument(
            "ddprun slurm: --srun-args: -N/--nodes must be a node count from 1 "
            "to the allocation's " +
            std::to_string(job_nodes) + ", got '" + *k + "'");
      }
      facts.nodes = static_cast<int>(*v);
      continue;
    }
    if (optionValue(i, "-w", "--nodelist") || optionValue(i, "-x", "--exclude") ||
        optionValue(i, "-r", "--relative") || optionValue(i, "-F", "--nodefile")) {
      facts.selects_nodes = true;
    }
  }
  return facts;
}

}  // namespace

bool inAllocation(const Env& env) { return get(env, "SLURM_JOB_ID").has_value(); }

std::string joinHostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && !startsWith(host, "[")) {
    return "[" + host + "]:" + std::to_string(port);
  }
  return host + ":" + std::to_string(port);
}

StatusOr<SlurmContext> readContext(const Env& env, int default_port) {
  SlurmContext ctx;
  auto job_id = get(env, "SLURM_JOB_ID");
  if (!job_id) {
    return failedPrecondition("not inside a Slurm allocation (SLURM_JOB_ID is not set)");
  }
  ctx.job_id = *job_id;

  ctx.port = default_port;
  if (auto port = get(env, "DDPRUN_SLURM_PORT")) {
    auto v = parseInt(*port);
    if (!v || *v < 1 || *v > 65535) {
      return invalidArgument("DDPRUN_SLURM_PORT='" + *port + "' is not a port (1-65535)");
    }
    ctx.port = static_cast<int>(*v);
  }

  const char* list_var = get(env, "SLURM_JOB_NODELIST") || !get(env, "SLURM_NODELIST")
                             ? "SLURM_JOB_NODELIST"
                             : "SLURM_NODELIST";
  DDPRUN_ASSIGN_OR_RETURN(ctx.job_nodes, nodeList(env, list_var));
  const char* count_var = get(env, "SLURM_JOB_NUM_NODES") ? "SLURM_JOB_NUM_NODES"
                          : get(env, "SLURM_NNODES")      ? "SLURM_NNODES"
                                                          : nullptr;
  if (count_var != nullptr) {
    DDPRUN_ASSIGN_OR_RETURN(int count, positiveInt(env, count_var, 1000000));
    if (static_cast<size_t>(count) != ctx.job_nodes.size()) {
      return invalidArgument(std::string(count_var) + "=" + std::to_string(count) + " but " +
                             list_var + " names " + std::to_string(ctx.job_nodes.size()) +
                             " nodes");
    }
  }

  auto step = get(env, "SLURM_STEP_ID");
  if (!step) step = get(env, "SLURM_STEPID");
  ctx.in_step = step && isSrunStepId(*step);
  if (!ctx.in_step) return ctx;
  ctx.step_id = *step;

  const char* step_list = get(env, "SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : list_var;
  DDPRUN_ASSIGN_OR_RETURN(ctx.step_nodes, nodeList(env, step_list));
  if (get(env, "SLURM_STEP_NUM_NODES")) {
    DDPRUN_ASSIGN_OR_RETURN(int n, positiveInt(env, "SLURM_STEP_NUM_NODES", 1000000));
    if (static_cast<size_t>(n) != ctx.step_nodes.size()) {
      return invalidArgument("SLURM_STEP_NUM_NODES=" + std::to_string(n) + " but " + step_list +
                             " names " + std::to_string(ctx.step_nodes.size()) + " nodes");
    }
  }
  const char* tasks_var =
      get(env, "SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  DDPRUN_ASSIGN_OR_RETURN(ctx.step_num_tasks, positiveInt(env, tasks_var, 100000000));
  auto node_id_text = get(env, "SLURM_NODEID");
  auto node_id = node_id_text ? parseInt(*node_id_text) : std::nullopt;
  if (!node_id || *node_id < 0 || static_cast<size_t>(*node_id) >= ctx.step_nodes.size()) {
    return invalidArgument("SLURM_NODEID='" + node_id_text.value_or("") +
                           "' is not an index into " + step_list + " (" +
                           std::to_string(ctx.step_nodes.size()) + " nodes)");
  }
  ctx.node_id = static_cast<int>(*node_id);
  ctx.node_name = get(env, "SLURMD_NODENAME").value_or(ctx.step_nodes[ctx.node_id]);
  return ctx;
}

StatusOr<SrunPlan> srunCommand(const std::vector<std::string>& args, const Env& env,
                               const std::string& ddprun_path, const AddressLookup& lookup,
                               const SrunOptions& options) {
  if (std::find(args.begin(), args.end(), "--help") != args.end() ||
      std::find(args.begin(), args.end(), "-h") != args.end()) {
    DDPRUN_ASSIGN_OR_RETURN(Scan scan, scanArgs(args, /*wrapper=*/true));
    if (scan.help) {
      SrunPlan help;
      help.show_help = true;
      return help;
    }
  }
  if (!inAllocation(env)) {
    return failedPrecondition(
        "ddprun slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); use "
        "sbatch/salloc");
  }
  auto ctx_or = readContext(env, options.default_port);
  if (!ctx_or.isOk()) return ctx_or.status().withContext("ddprun slurm");
  const SlurmContext& ctx = *ctx_or;
  const int job_nodes = static_cast<int>(ctx.job_nodes.size());

  DDPRUN_ASSIGN_OR_RETURN(Scan scan, scanArgs(args, /*wrapper=*/true));
  if (!scan.has_program) {
    return invalidArgument(
        "ddprun slurm: missing the training program (usage: ddprun slurm "
        "[--srun-args=\"SRUN OPTIONS\"] [ddprun flags] prog [args])");
  }
  if (truthy(userValue(scan, env, "standalone"))) {
    return invalidArgument(
        "ddprun slurm: --standalone is single-node; ddprun slurm uses the c10d rendezvous on the "
        "allocation's first node (drop --standalone)");
  }
  if (auto backend = userValue(scan, env, "rdzv_backend");
      backend && *backend != "c10d" && *backend != "grpc") {
    return invalidArgument("ddprun slurm: argument --rdzv-backend: ddprun slurm uses c10d, got '" +
                           *backend + "'");
  }

  SrunArgsFacts srun_facts;
  if (scan.srun_args) {
    DDPRUN_ASSIGN_OR_RETURN(srun_facts, inspectSrunArgs(*scan.srun_args, job_nodes));
  }
  const int step_nodes = srun_facts.nodes.value_or(job_nodes);
  // Is the step's first node the allocation's first node? Only when it spans the allocation.
  const bool whole_allocation = !srun_facts.selects_nodes && step_nodes == job_nodes;

  std::vector<std::string> derived;
  if (auto nnodes = userValue(scan, env, "nnodes")) {
    auto min = minNodes(*nnodes);
    if (min && *min > step_nodes) {
      return invalidArgument("ddprun slurm: argument --nnodes: at least " + std::to_string(*min) +
                             " nodes asked for, but the step runs on " +
                             std::to_string(step_nodes) +
                             " (SLURM_JOB_NUM_NODES=" + std::to_string(job_nodes) + ")");
    }
  } else if (!srun_facts.selects_nodes) {
    derived.push_back("--nnodes=" + std::to_string(step_nodes));
  }
  if (!userValue(scan, env, "rdzv_backend")) derived.push_back("--rdzv-backend=c10d");
  if (!userValue(scan, env, "rdzv_id")) derived.push_back("--rdzv-id=" + ctx.job_id);
  if (!userValue(scan, env, "rdzv_endpoint") && whole_allocation) {
    auto addr = lookupAddress(lookup, ctx.job_nodes.front());
    if (!addr.isOk()) return addr.status().withContext("ddprun slurm");
    derived.push_back("--rdzv-endpoint=" + joinHostPort(*addr, ctx.port));
  }

  SrunPlan plan;
  plan.ddprun_args = derived;
  plan.ddprun_args.insert(plan.ddprun_args.end(), scan.rest.begin(), scan.rest.end());

  plan.argv = {options.srun};
  if (!srun_facts.selects_nodes) {
    plan.argv.push_back("--nodes=" + std::to_string(step_nodes));
    plan.argv.push_back("--ntasks=" + std::to_string(step_nodes));
  }
  plan.argv.push_back("--ntasks-per-node=1");
  plan.argv.push_back("--kill-on-bad-exit=0");
  if (options.whole_node) plan.argv.push_back("--whole");
  plan.argv.insert(plan.argv.end(), srun_facts.words.begin(), srun_facts.words.end());
  plan.argv.push_back(ddprun_path);
  plan.argv.insert(plan.argv.end(), plan.ddprun_args.begin(), plan.ddprun_args.end());
  return plan;
}

StatusOr<StepArgs> stepArgs(const std::vector<std::string>& args, const Env& env,
                            const AddressLookup& lookup, int default_port) {
  StepArgs result;
  result.args = args;
  if (!inAllocation(env)) return result;
  if (auto autodetect = get(env, "DDPRUN_SLURM_AUTO")) {
    auto on = parseBool(*autodetect);
    if (!on) return invalidArgument("DDPRUN_SLURM_AUTO='" + *autodetect + "': expected 0 or 1");
    if (!*on) return result;
  }
  auto step = get(env, "SLURM_STEP_ID");
  if (!step) step = get(env, "SLURM_STEPID");
  if (!step || !isSrunStepId(*step)) return result;

  DDPRUN_ASSIGN_OR_RETURN(Scan scan, scanArgs(args, /*wrapper=*/false));
  if (truthy(userValue(scan, env, "standalone"))) return result;
  if (auto backend = userValue(scan, env, "rdzv_backend");
      backend && *backend != "c10d" && *backend != "grpc") {
    return result;
  }

  auto ctx_or = readContext(env, default_port);
  if (!ctx_or.isOk()) return ctx_or.status().withContext("ddprun inside srun");
  const SlurmContext& ctx = *ctx_or;
  result.in_step = true;
  const int nodes = static_cast<int>(ctx.step_nodes.size());
  if (ctx.step_num_tasks != nodes) {
    return invalidArgument(
        "ddprun inside srun: the step runs " + std::to_string(ctx.step_num_tasks) + " tasks on " +
        std::to_string(nodes) +
        " nodes, but ddprun is one task per node (srun --ntasks-per-node=1; ddprun starts the "
        "workers itself), or set DDPRUN_SLURM_AUTO=0 and give the rendezvous flags yourself");
  }
  auto lookupHere = [&](const std::string& node) -> StatusOr<std::string> {
    auto addr = lookupAddress(lookup, node);
    if (!addr.isOk()) return addr.status().withContext("ddprun inside srun");
    return addr;
  };

  std::vector<std::string> prepend;  // the derived flags, before the user's arguments
  if (!userValue(scan, env, "nnodes")) prepend.push_back("--nnodes=" + std::to_string(nodes));
  if (!userValue(scan, env, "rdzv_backend")) prepend.push_back("--rdzv-backend=c10d");
  if (!userValue(scan, env, "rdzv_id")) prepend.push_back("--rdzv-id=" + ctx.job_id);

  // The endpoint, and whether this task hosts the rendezvous server behind it: the step's first
  // node does when the endpoint is its name or address, and then no other node does (several
  // slurmd on one host, or nodes sharing a NodeAddr, would otherwise all claim it). Every task
  // reaches the same answer. An endpoint elsewhere (a standalone server) leaves is_host alone.
  bool first_node_hosts = false;
  if (auto endpoint = userValue(scan, env, "rdzv_endpoint"); endpoint && !trim(*endpoint).empty()) {
    const std::string host = endpointHost(trim(*endpoint));
    const std::string& first = ctx.step_nodes.front();
    first_node_hosts = host == first;
    if (!first_node_hosts) {
      DDPRUN_ASSIGN_OR_RETURN(std::string addr, lookupHere(first));
      first_node_hosts = host == addr;
    }
  } else {
    DDPRUN_ASSIGN_OR_RETURN(std::string addr, lookupHere(ctx.step_nodes.front()));
    prepend.push_back("--rdzv-endpoint=" + joinHostPort(addr, ctx.port));
    first_node_hosts = true;
  }
  const auto conf = userValue(scan, env, "rdzv_conf");
  std::optional<std::string> merged_note;
  if (first_node_hosts && !(conf && conf->find("is_host") != std::string::npos)) {
    const std::string item = std::string("is_host=") + (ctx.node_id == 0 ? "true" : "false");
    auto given = scan.given.find("rdzv_conf");
    const ArgToken* user_conf =
        given == scan.given.end() ? nullptr : &scan.tokens.tokens[given->second.token];
    if (user_conf != nullptr && !user_conf->value) {
      // A trailing --rdzv-conf without its value: left alone for the launcher to report.
    } else if (user_conf != nullptr) {
      // Merged into the user's own --rdzv-conf: a second flag would replace theirs.
      const std::string value =
          trim(given->second.value).empty() ? item : given->second.value + "," + item;
      // Without --srun-args (not read here) `rest` starts as `args`: token indexes hold.
      const ArgToken& at = *user_conf;
      if (at.inline_value) {
        scan.rest[at.begin] =
            scan.rest[at.begin].substr(0, scan.rest[at.begin].find('=') + 1) + value;
      } else {
        scan.rest[at.begin + 1] = value;
      }
      merged_note = item + " (into your --rdzv-conf)";
    } else if (conf && !trim(*conf).empty()) {
      prepend.push_back("--rdzv-conf=" + *conf + "," + item);  // PET_RDZV_CONF and ours
    } else {
      prepend.push_back("--rdzv-conf=" + item);
    }
  }

  if (!userValue(scan, env, "local_addr")) {
    DDPRUN_ASSIGN_OR_RETURN(std::string addr, lookupHere(ctx.node_name));
    prepend.push_back("--local-addr=" + addr);
  }
  if (!userValue(scan, env, "signals_to_handle")) {
    prepend.push_back(std::string("--signals-to-handle=") + kSlurmSignals);
  }

  result.added = prepend;
  if (merged_note) result.added.push_back(*merged_note);
  result.args = std::move(prepend);
  result.args.insert(result.args.end(), scan.rest.begin(), scan.rest.end());
  return result;
}

StatusOr<std::vector<std::string>> splitShellWords(const std::string& text) {
  std::vector<std::string> words;
  std::string word;
  bool in_word = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == ' ' || c == '\t' || c == '\n') {
      if (in_word) words.push_back(word);
      word.clear();
      in_word = false;
      continue;
    }
    in_word = true;
    if (c == '\\') {
      if (i + 1 < text.size()) {
        if (text[i + 1] != '\n') word += text[i + 1];  // backslash-newline joins lines
        ++i;
      }
      continue;
    }
    if (c == '\'') {
      const size_t close = text.find('\'', i + 1);
      if (close == std::string::npos) {
        return invalidArgument("unterminated ' (single quote) at character " +
                               std::to_string(i + 1) + " in '" + text + "'");
      }
      word += text.substr(i + 1, close - i - 1);
      i = close;
      continue;
    }
    if (c == '"') {
      size_t j = i + 1;
      for (; j < text.size() && text[j] != '"'; ++j) {
        if (text[j] == '\\' && j + 1 < text.size() &&
            std::string("\"\\$`\n").find(text[j + 1]) != std::string::npos) {
          ++j;
        }
        word += text[j];
      }
      if (j >= text.size()) {
        return invalidArgument("unterminated \" (double quote) at character " +
                               std::to_string(i + 1) + " in '" + text + "'");
      }
      i = j;
      continue;
    }
    word += c;
  }
  if (in_word) words.push_back(word);
  return words;
}

Env processEnvironment() { return environmentMap(); }

std::string slurmHelpText() {
  return R"(usage: ddprun slurm [--srun-args="SRUN OPTIONS"] [ddprun flags] prog [args]

Inside a Slurm allocation (sbatch or salloc), starts one ddprun agent per node with
  srun --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=0 --whole [SRUN OPTIONS] \
       ddprun --nnodes=N --rdzv-backend=c10d --rdzv-id=$SLURM_JOB_ID \
              --rdzv-endpoint=<first node's address>:<port> [ddprun flags] prog [args]
N is SLURM_JOB_NUM_NODES; a --nnodes MIN:MAX, --rdzv-id or --rdzv-endpoint you give wins.
Each agent adds --local-addr (its node's NodeAddr from scontrol) and forwards SIGUSR1 (Slurm's
preemption notice) to the workers as well.

  --srun-args="..."   extra srun options (shell quoting); -N/--nodes K uses K of the nodes;
                      -n/--ntasks are not allowed (ddprun starts the workers itself)
  DDPRUN_SLURM_PORT   rendezvous port on the first node (default 29400)
  DDPRUN_SLURM_AUTO=0 inside srun, do not derive the rendezvous flags from the environment
)";
}

}  // namespace ddprun::slurm
