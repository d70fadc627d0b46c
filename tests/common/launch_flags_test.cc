#include "ddprun/common/launch_flags.h"

#include <catch2/catch.hpp>
#include <set>

#include "ddprun/common/strings.h"

using namespace ddprun;
using Args = std::vector<std::string>;
using Env = std::map<std::string, std::string>;
using Kind = ArgToken::Kind;

namespace {

TokenizedArgs tokenize(const Args& args) { return tokenizeLaunchArgs(args, launchFlags()); }

// The one-line error of the first malformed item, or "<ok>".
std::string errorOf(const Args& args, const Env& env = {}) {
  auto r = resolveFlagValues(tokenize(args), env, launchFlags());
  return r.isOk() ? "<ok>" : r.status().message();
}

std::map<std::string, FlagValue> valuesOf(const Args& args, const Env& env = {}) {
  auto r = resolveFlagValues(tokenize(args), env, launchFlags());
  REQUIRE(r.isOk());
  return r->values;
}

std::string underscored(const LaunchFlag& f) { return std::string("--") + f.name; }

}  // namespace

TEST_CASE("the flag table has unique names, short names and a metavar for every value flag",
          "[common]") {
  std::set<std::string> names;
  std::set<char> shorts;
  for (const auto& f : launchFlags()) {
    INFO(f.name);
    CHECK(names.insert(f.name).second);
    CHECK(std::string(f.name).find('-') == std::string::npos);
    if (f.short_name != 0) CHECK(shorts.insert(f.short_name).second);
    CHECK((f.metavar != nullptr) == f.takes_value);
    CHECK(f.help != nullptr);
  }
  CHECK(shorts == std::set<char>{'m', 'r', 't'});
  CHECK(dashedFlagName("nproc_per_node") == "--nproc-per-node");
  CHECK(petName("nproc_per_node") == "PET_NPROC_PER_NODE");
}

TEST_CASE("every flag is read with '_' and '-' spellings, '=' and separate values", "[common]") {
  for (const auto& f : launchFlags()) {
    const std::string dashed = dashedFlagName(f.name);
    for (const std::string& spelling : {underscored(f), dashed}) {
      INFO(spelling);
      if (!f.takes_value) {
        auto v = valuesOf({spelling, "prog"});
        REQUIRE(v.count(f.name) == 1);
        CHECK(v.at(f.name).value == "1");
        CHECK(v.at(f.name).source == dashed);
        CHECK(errorOf({spelling + "=1", "prog"}) == "argument " + dashed + ": takes no value");
        continue;
      }
      auto inline_form = valuesOf({spelling + "=a=b", "prog"});
      REQUIRE(inline_form.count(f.name) == 1);
      CHECK(inline_form.at(f.name).value == "a=b");
      CHECK(inline_form.at(f.name).source == dashed);
      // As argparse: a separate value that is an option is not taken as the value (torchrun:
      // "expected one argument"), one that is a number, a lone dash or has a space in it is; the
      // inline form takes anything.
      for (const std::string option : {"-x", "--nnodes=2", "--", "-t", "-1x", "-1.2.3", "-."}) {
        INFO(option);
        CHECK(errorOf({spelling, option, "prog"}) ==
              "argument " + dashed + ": expected one argument (" + f.metavar + ")");
      }
      for (const std::string value : {"-5", "-0", "-1.5", "-.5", "-", "-a b"}) {
        auto separate = valuesOf({spelling, value, "prog"});
        REQUIRE(separate.count(f.name) == 1);
        CHECK(separate.at(f.name).value == value);
      }
      CHECK(valuesOf({spelling + "=-x", "prog"}).at(f.name).value == "-x");
      CHECK(valuesOf({spelling + "=", "prog"}).at(f.name).value.empty());
      CHECK(errorOf({spelling}) ==
            "argument " + dashed + ": expected one argument (" + f.metavar + ")");
    }
  }
}

TEST_CASE("tokens say where each flag, its value and the program are in the arguments",
          "[common]") {
  const Args args = {"--nnodes", "2", "--rdzv-conf=a=1", "-m", "-r3", "-t", "1", "pkg", "--x"};
  auto t = tokenize(args);
  REQUIRE(t.tokens.size() == 5);
  CHECK(t.tokens[0].flag->name == std::string("nnodes"));
  CHECK((t.tokens[0].begin == 0 && t.tokens[0].end == 2 && !t.tokens[0].inline_value));
  CHECK((t.tokens[1].begin == 2 && t.tokens[1].end == 3 && t.tokens[1].inline_value));
  CHECK(*t.tokens[1].value == "a=1");
  CHECK(t.tokens[2].flag->name == std::string("module"));
  CHECK(t.tokens[2].source == "-m");
  CHECK(t.tokens[3].flag->name == std::string("redirects"));
  CHECK(*t.tokens[3].value == "3");
  CHECK(t.tokens[3].inline_value);
  CHECK(t.tokens[4].source == "-t");
  CHECK((t.tokens[4].begin == 5 && t.tokens[4].end == 7));
  CHECK(t.program == 7u);
  CHECK(t.rest_begin == 7u);

  auto dashdash = tokenize({"--nnodes=1", "--", "--prog", "a"});
  CHECK(dashdash.program == 2u);
  CHECK(dashdash.rest_begin == 1u);  // the "--" belongs to the program part
  auto none = tokenize({"--nnodes=1"});
  CHECK_FALSE(none.program.has_value());
  CHECK(none.rest_begin == 1u);
  CHECK_FALSE(tokenize({"--"}).program.has_value());
  CHECK(tokenize({"-", "x"}).program == 0u);  // a lone dash is a program name
}

TEST_CASE("an unambiguous prefix names its flag, an ambiguous one is an error", "[common]") {
  auto v = valuesOf({"--nproc=2", "--max_rest", "3", "--stand", "prog"});
  CHECK(v.at("nproc_per_node").value == "2");
  CHECK(v.at("nproc_per_node").source == "--nproc-per-node");
  CHECK(v.at("max_restarts").value == "3");
  CHECK(v.count("standalone") == 1);
  CHECK(
      errorOf({"--n", "prog"}) ==
      "ambiguous option: --n could match --nnodes, --nproc-per-node, --numa-binding, --no-python, "
      "--node-rank");
  CHECK(errorOf({"--rdzv", "x", "prog"}) ==
        "ambiguous option: --rdzv could match --rdzv-backend, --rdzv-endpoint, --rdzv-id, "
        "--rdzv-conf");
  // An exact name wins over being a prefix of another.
  CHECK(valuesOf({"--tee=1", "prog"}).at("tee").value == "1");
}

TEST_CASE("short flags: -m alone, -r and -t with an attached or separate value", "[common]") {
  auto v = valuesOf({"-m", "-r", "3", "-t0:1,1:2", "pkg.mod"});
  CHECK(v.at("module").source == "-m");
  CHECK(v.at("redirects").value == "3");
  CHECK(v.at("redirects").source == "-r");
  CHECK(v.at("tee").value == "0:1,1:2");
  CHECK(v.at("tee").source == "-t");
  CHECK(errorOf({"-r"}) == "argument -r: expected one argument (STD)");
  CHECK(errorOf({"-t"}) == "argument -t: expected one argument (STD)");
  CHECK(errorOf({"-mx", "p"}) == "unrecognized argument: -mx (see ddprun --help)");
  CHECK(errorOf({"-x", "p"}) == "unrecognized argument: -x (see ddprun --help)");
  CHECK(errorOf({"--bogus", "p"}) == "unrecognized argument: --bogus (see ddprun --help)");
  CHECK(errorOf({"--bogus=1", "p"}) == "unrecognized argument: --bogus (see ddprun --help)");
  CHECK(errorOf({"--help=1", "p"}) == "argument -h/--help: ignored explicit argument '1'");
}

TEST_CASE("the last value wins, and PET_<NAME> fills in what the command line did not give",
          "[common]") {
  Env env = {{"PET_NNODES", "1:4"},
             {"PET_MAX_RESTARTS", "5"},
             {"PET_STANDALONE", "1"},
             {"PET_NO_PYTHON", "0"}};
  auto v = valuesOf({"--max-restarts=1", "--max_restarts", "2", "prog"}, env);
  CHECK(v.at("max_restarts").value == "2");
  CHECK(v.at("max_restarts").source == "--max-restarts");
  CHECK(v.at("nnodes").value == "1:4");
  CHECK(v.at("nnodes").source == "PET_NNODES");
  CHECK(v.at("standalone").value == "1");
  CHECK(v.at("standalone").source == "PET_STANDALONE");
  CHECK(v.count("no_python") == 0);  // 0 leaves a valueless flag off
  for (const auto& f : launchFlags()) {
    INFO(f.name);
    auto from_env = valuesOf({"prog"}, {{petName(f.name), f.takes_value ? "v" : "yes"}});
    if (!f.from_env) {  // --print-completion: a run never turns into printing a script
      CHECK(from_env.count(f.name) == 0);
      continue;
    }
    REQUIRE(from_env.count(f.name) == 1);
    CHECK(from_env.at(f.name).source == petName(f.name));
  }
  int not_from_env = 0;
  for (const auto& f : launchFlags()) not_from_env += f.from_env ? 0 : 1;
  CHECK(not_from_env == 1);
  // The Kubeflow training operator's spelling of PET_NPROC_PER_NODE; ours wins over it.
  auto kubeflow = valuesOf({"prog"}, {{"PET_N_PROC_PER_NODE", "4"}});
  CHECK(kubeflow.at("nproc_per_node").value == "4");
  CHECK(kubeflow.at("nproc_per_node").source == "PET_N_PROC_PER_NODE");
  auto both = valuesOf({"prog"}, {{"PET_N_PROC_PER_NODE", "4"}, {"PET_NPROC_PER_NODE", "2"}});
  CHECK(both.at("nproc_per_node").value == "2");
  CHECK(errorOf({"prog"}, {{"PET_STANDALONE", "maybe"}}) ==
        "environment PET_STANDALONE: expected 1 or 0 (or true/false, yes/no, on/off), got 'maybe'");
}

TEST_CASE(
    "help before any error wins, an error before help is reported, after the program "
    "neither counts",
    "[common]") {
  auto help = resolveFlagValues(tokenize({"--nnodes=2", "--help", "--bogus"}), {}, launchFlags());
  REQUIRE(help.isOk());
  CHECK(help->help);
  CHECK(errorOf({"--bogus", "-h"}) == "unrecognized argument: --bogus (see ddprun --help)");
  auto program = resolveFlagValues(tokenize({"prog", "--help", "--bogus"}), {}, launchFlags());
  REQUIRE(program.isOk());
  CHECK_FALSE(program->help);
}

TEST_CASE("malformed items are tokens, so a pass-through reader can go on", "[common]") {
  auto t = tokenize({"--bogus", "--standalone=1", "--n", "-x", "prog", "a"});
  REQUIRE(t.tokens.size() == 4);
  for (const auto& tok : t.tokens) CHECK(tok.kind == Kind::kError);
  CHECK(t.tokens[0].flag == nullptr);
  CHECK(t.tokens[1].flag->name == std::string("standalone"));  // known flag, bad form
  CHECK(*t.tokens[1].value == "1");
  CHECK(t.tokens[2].flag == nullptr);
  CHECK(t.program == 4u);
  auto missing = tokenize({"--nnodes"});
  REQUIRE(missing.tokens.size() == 1);
  CHECK(missing.tokens[0].kind == Kind::kError);
  CHECK(missing.tokens[0].flag->name == std::string("nnodes"));
  CHECK_FALSE(missing.tokens[0].value.has_value());
}

TEST_CASE("a caller's own table adds flags to the grammar", "[common]") {
  std::vector<LaunchFlag> table = launchFlags();
  table.push_back({"srun_args", 0, true, "OPTS", "extra"});
  auto t = tokenizeLaunchArgs({"--srun-args", "-N 2", "--srun", "x", "prog"}, table);
  REQUIRE(t.tokens.size() == 2);
  CHECK(*t.tokens[0].value == "-N 2");
  CHECK(t.tokens[1].flag->name == std::string("srun_args"));
  CHECK(tokenize({"--srun-args=x"}).tokens[0].kind == Kind::kError);  // not ddprun's own
}
