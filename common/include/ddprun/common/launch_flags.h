// The launcher's command-line grammar (SPEC §2): the one table of its flags and the one tokenizer
// of a ddprun command line, shared by the launcher's parser (launcher/cli.h), which turns the
// values into an AgentConfig, and by the Slurm wrapper (slurm/launch.h), which must find the
// flags the user gave, their PET_<NAME> defaults and where the program starts.
// Pure functions over constant data; thread-safe.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/common/status.h"

namespace ddprun {

struct LaunchFlag {
  const char* name;  // canonical, underscores: "nproc_per_node"; also spelled --nproc-per-node
  char short_name;   // 'm' for -m, or 0
  bool takes_value;
  const char* metavar;  // in --help and in "expected one argument (METAVAR)"
  const char* help;
  // The values a shell completion offers ("a,b,c"), where they are few and fixed; the parser
  // checks them (tests/launcher: each one is accepted).
  const char* choices = nullptr;
  bool from_env = true;  // PET_<NAME> supplies it when not given
};

// In --help order (which is also the order the launcher applies them in).
const std::vector<LaunchFlag>& launchFlags();

// "nproc_per_node" -> "--nproc-per-node", the spelling messages and --help use.
std::string dashedFlagName(std::string_view canonical);
// "nproc_per_node" -> "PET_NPROC_PER_NODE", the environment default of a flag.
std::string petName(std::string_view canonical);

// A flag's value and where it came from, for messages: "--nnodes", "-r" or "PET_NNODES".
struct FlagValue {
  std::string value;
  std::string source;
};

// One item of a command line before the program.
struct ArgToken {
  enum class Kind {
    kFlag,   // a flag of the table, well formed
    kHelp,   // -h or --help
    kError,  // unknown, ambiguous or malformed; `error` says so in one line
  };
  Kind kind = Kind::kFlag;
  const LaunchFlag* flag = nullptr;  // the flag meant; also set for a kError of a known flag
  std::optional<std::string> value;  // the value given (none for a valueless flag)
  std::string source;                // the flag as messages name it: "--nnodes", "-r"
  size_t begin = 0;                  // the token is args[begin, end)
  size_t end = 0;
  bool inline_value = false;  // --flag=value or -r3: the value is inside args[begin]
  std::string error;          // kError: e.g. "unrecognized argument: --bogus (see ddprun --help)"
};

struct TokenizedArgs {
  std::vector<ArgToken> tokens;   // everything before the program, in order
  std::optional<size_t> program;  // index of the program in args; none when it is missing
  size_t rest_begin = 0;          // where the program part starts ("--" included); args.size()
};

// Splits `args` (argv without argv[0]) as argparse would with `table`: --name and --name=value in
// '_' or '-' spelling, an unambiguous prefix of a long name, short -m and -r VALUE / -rVALUE, -h
// and --help; "--" or the first word that is not a flag starts the program, and everything from
// there on is the program's. Malformed items are kError tokens and tokenizing goes on, so that a
// caller that only passes arguments through (the Slurm wrapper) can ignore them.
TokenizedArgs tokenizeLaunchArgs(const std::vector<std::string>& args,
                                 const std::vector<LaunchFlag>& table);

// What a command line asks for, strictly: the first kError is returned as INVALID_ARGUMENT,
// -h/--help before any error sets `help` (and nothing else is read). Otherwise every flag given
// (the last one wins; valueless flags get "1"), then PET_<NAME> from `env` for each flag of `table`
// not given (a valueless flag's variable must be 0 or 1, and 0 leaves it unset).
struct FlagValues {
  bool help = false;
  std::map<std::string, FlagValue> values;  // canonical name -> value
};
StatusOr<FlagValues> resolveFlagValues(const TokenizedArgs& tokens,
                                       const std::map<std::string, std::string>& env,
                                       const std::vector<LaunchFlag>& table);

}  // namespace ddprun
