#include "ddprun/slurm/hostlist.h"

#include <catch2/catch.hpp>

#include "ddprun/common/strings.h"
#include "process_helpers.h"

using namespace ddprun;
using namespace ddprun::slurm;
using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

struct Good {
  const char* expr;
  std::vector<std::string> hosts;
};

const Good kGood[] = {
    {"n1", {"n1"}},
    {"n[1-3,7]", {"n1", "n2", "n3", "n7"}},
    {"gpu[001-003]", {"gpu001", "gpu002", "gpu003"}},
    {"gpu[008-010]", {"gpu008", "gpu009", "gpu010"}},
    {"n[8-10]", {"n8", "n9", "n10"}},
    {"n[1-010]", {"n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10"}},
    {"n[098-101]", {"n098", "n099", "n100", "n101"}},
    {"r[1-2]n[01-02]", {"r1n01", "r1n02", "r2n01", "r2n02"}},
    {"n[1-2][3-4]", {"n13", "n14", "n23", "n24"}},
    {"n[01-3]x[1-2]", {"n01x1", "n01x2", "n02x1", "n02x2", "n03x1", "n03x2"}},
    {"gpu[01-04,07],cpu-a[1-2],login",
     {"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu-a1", "cpu-a2", "login"}},
    {"[1-3]", {"1", "2", "3"}},
    {"n[5]", {"n5"}},
    {"n[3,1,2]", {"n3", "n1", "n2"}},
    {"n1,n1", {"n1", "n1"}},
    {"n1 n2", {"n1", "n2"}},
    {"a,,b,", {"a", "b"}},
    {"node-1.example.org", {"node-1.example.org"}},
};

const Good kGoodOnlyHere[] = {
    // Slurm 22.05's scontrol rejects text after a dashed suffix; we accept it.
    {"n[1-2]-ib", {"n1-ib", "n2-ib"}},
};

struct Bad {
  const char* expr;
  const char* message_part;
};

const Bad kBad[] = {
    {"", "names no hosts at character 1"},
    {" , ", "names no hosts"},
    {"n[3-1]", "descending range 3-1 (write LO-HI with LO <= HI) at character 3"},
    {"n[]", "empty brackets '[]' at character 2"},
    {"n[1-3", "'[' is never closed at character 2"},
    {"n1-3]", "']' without a matching '[' at character 5"},
    {"n[[1]]", "nested '[' at character 3"},
    {"n[a-c]", "'a' in brackets (expected digits, ',' or '-') at character 3"},
    {"n[1-]", "missing range end at character 5"},
    {"n[-3]", "missing range start at character 3"},
    {"n[1,,2]", "empty range in brackets at character 5"},
    {"n[1-2-3]", "'-' in brackets"},
    {"n[1 2]", "' ' in brackets"},
    {"n[1-1000000]", "range 1-1000000 expands to more than 100000 hosts at character 3"},
    {"n[1-99999999999999999999]", "range end has too many digits"},
    {"a[1-1000]b[1-1000]", "expands to more than 100000 hosts at character 1"},
    {"ok,n[1-60000],m[1-60000]", "expands to more than 100000 hosts at character 15"},
};

}  // namespace

TEST_CASE("hostlist expressions expand to the hosts Slurm lists, in Slurm's order", "[slurm]") {
  for (const auto& g : kGood) {
    INFO("expression: '" << g.expr << "'");
    auto hosts = expandHostlist(g.expr);
    REQUIRE(hosts.isOk());
    CHECK(*hosts == g.hosts);
  }
  for (const auto& g : kGoodOnlyHere) {
    INFO("expression: '" << g.expr << "'");
    auto hosts = expandHostlist(g.expr);
    REQUIRE(hosts.isOk());
    CHECK(*hosts == g.hosts);
  }
}

TEST_CASE("a malformed hostlist is INVALID_ARGUMENT naming the problem and its position",
          "[slurm]") {
  for (const auto& b : kBad) {
    INFO("expression: '" << b.expr << "'");
    auto hosts = expandHostlist(b.expr);
    REQUIRE_FALSE(hosts.isOk());
    CHECK(hosts.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(hosts.status().message(), Catch::Contains(b.message_part));
    CHECK_THAT(hosts.status().message(), Catch::StartsWith("invalid hostlist '"));
  }
}

TEST_CASE("the expansion cap is an option and applies to the whole list", "[slurm]") {
  HostlistOptions small;
  small.max_hosts = 4;
  CHECK(expandHostlist("n[1-4]", small).isOk());
  CHECK_FALSE(expandHostlist("n[1-5]", small).isOk());
  CHECK_FALSE(expandHostlist("n[1-2],m[1-3]", small).isOk());
  CHECK_FALSE(expandHostlist("r[1-2]n[1-3]", small).isOk());
  // 100000 hosts is the default cap itself: accepted, and quickly.
  auto big = expandHostlist("n[000001-100000]");
  REQUIRE(big.isOk());
  CHECK(big->size() == 100000);
  CHECK(big->back() == "n100000");
}

TEST_CASE("firstHost is the first host of a valid list and an error for a malformed one",
          "[slurm]") {
  auto first = firstHost("gpu[07-09],cpu1");
  REQUIRE(first.isOk());
  CHECK(*first == "gpu07");
  CHECK_FALSE(firstHost("gpu[07-09,cpu1").isOk());
}

TEST_CASE("the expansion agrees with scontrol show hostnames", "[slurm]") {
  if (run({"sh", "-c", "command -v scontrol"}, {}, 30s).exit_code != 0) {
    WARN("skipped: scontrol is not installed (apt-get install slurm-client)");
    return;
  }
  // scontrol only needs a configuration file to expand hostlists; no daemon is contacted.
  TempDir dir;
  {
    std::ofstream conf(dir / "slurm.conf");
    conf << "ClusterName=hostlist\nSlurmctldHost=localhost\n";
  }
  for (const auto& g : kGood) {
    INFO("expression: '" << g.expr << "'");
    auto out =
        run({"scontrol", "show", "hostnames", g.expr}, {{"SLURM_CONF", dir / "slurm.conf"}}, 30s);
    REQUIRE(out.exit_code == 0);
    std::vector<std::string> theirs;
    for (const auto& line : split(out.out, '\n')) {
      if (!line.empty()) theirs.push_back(line);
    }
    CHECK(theirs == *expandHostlist(g.expr));
  }
  // Errors that scontrol also refuses.
  for (const char* expr : {"n[3-1]", "n[]", "n[1-1000000]", "n[a-c]"}) {
    INFO("expression: '" << expr << "'");
    auto out =
        run({"scontrol", "show", "hostnames", expr}, {{"SLURM_CONF", dir / "slurm.conf"}}, 30s);
    CHECK_THAT(out.out + out.err, Catch::Contains("Invalid hostlist"));
    CHECK_FALSE(expandHostlist(expr).isOk());
  }
}

TEST_CASE("a hostlist error quoting control bytes stays one line", "[slurm]") {
  // Found by fuzz_hostlist: the message quoted the expression raw, newline and escapes included.
  auto hosts = expandHostlist("n[00\x02\n-b");
  REQUIRE_FALSE(hosts.isOk());
  CHECK(hosts.status().message().find('\n') == std::string::npos);
  CHECK_THAT(hosts.status().message(), Catch::Contains("n[00\\x02\\n-b"));
}
