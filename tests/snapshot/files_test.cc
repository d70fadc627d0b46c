// The snapshot shell's file helpers (snapshot/src/files.h): what the version table is read and
// written with, and paths a peer names acted on beneath the directory.
#include "files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <fstream>

#include "ddprun/snapshot/replicator.h"
#include "process_helpers.h"

using namespace ddprun;
using namespace ddprun::snapshot;
using ddprun::testing::TempDir;

TEST_CASE("readSmallFile reads a regular file and names what it refuses", "[files]") {
  TempDir dir;
  auto missing = readSmallFile(dir / "none", 10);
  REQUIRE(missing.isOk());
  CHECK_FALSE(*missing);
  std::ofstream(dir / "f") << "hello";
  auto f = readSmallFile(dir / "f", 5);
  REQUIRE(f.isOk());
  CHECK(**f == "hello");
  std::ofstream(dir / "empty") << "";
  CHECK(**readSmallFile(dir / "empty", 0) == "");
  auto big = readSmallFile(dir / "f", 4);
  REQUIRE_FALSE(big.isOk());
  CHECK(big.status().message() == dir / "f" + ": 5 bytes, more than the 4 expected");
  auto isdir = readSmallFile(dir.path(), 100);
  REQUIRE_FALSE(isdir.isOk());
  CHECK(isdir.status().message().find("not a regular file") != std::string::npos);
  REQUIRE(::symlink((dir / "f").c_str(), (dir / "link").c_str()) == 0);
  auto link = readSmallFile(dir / "link", 100);  // not followed
  REQUIRE_FALSE(link.isOk());
  CHECK(link.status().message().find("cannot open " + dir / "link") != std::string::npos);
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);
  auto fifo = readSmallFile(dir / "fifo", 100);  // does not block
  REQUIRE_FALSE(fifo.isOk());
  CHECK(fifo.status().message().find("not a regular file") != std::string::npos);
}

TEST_CASE("a replicated file's directories are made, and removed once empty", "[files]") {
  TempDir dir;
  REQUIRE(makeParentDirsUnder(dir.path(), "top.bin").isOk());  // nothing to make
  REQUIRE(makeParentDirsUnder(dir.path(), "a/b/c.bin").isOk());
  CHECK(ddprun::testing::isDirectory(dir / "a/b"));
  CHECK_FALSE(ddprun::testing::fileExists(dir / "a/b/c.bin"));
  REQUIRE(makeParentDirsUnder(dir.path(), "a/b/d.bin").isOk());  // there already
  // A file or a symlink in the way is named, and nothing is made through the symlink.
  std::ofstream(dir / "f") << "x";
  Status st = makeParentDirsUnder(dir.path(), "f/g.bin");
  REQUIRE_FALSE(st.isOk());
  CHECK(st.message() == "cannot create directory " + dir / "f" +
                            ": something other than a directory is in the way there");
  TempDir elsewhere;
  REQUIRE(::symlink(elsewhere.path().c_str(), (dir / "s").c_str()) == 0);
  CHECK_FALSE(makeParentDirsUnder(dir.path(), "s/t/u.bin").isOk());
  CHECK_FALSE(ddprun::testing::fileExists(elsewhere / "t"));

  std::ofstream(dir / "a/keep.bin") << "x";
  removeEmptyParentsUnder(dir.path(), "a/b/c.bin");  // a/b goes, a holds a file
  CHECK_FALSE(ddprun::testing::fileExists(dir / "a/b"));
  CHECK(ddprun::testing::fileExists(dir / "a/keep.bin"));
  REQUIRE(::unlink((dir / "a/keep.bin").c_str()) == 0);
  removeEmptyParentsUnder(dir.path(), "a/keep.bin");
  CHECK_FALSE(ddprun::testing::fileExists(dir / "a"));
  CHECK(ddprun::testing::isDirectory(dir.path()));
  removeEmptyParentsUnder(dir.path(), "top.bin");  // the root stays
  CHECK(ddprun::testing::isDirectory(dir.path()));
}

TEST_CASE("replaceFile puts the new contents in place whole and leaves no temp file", "[files]") {
  TempDir dir;
  REQUIRE(replaceFile(dir / "t", "one").isOk());
  REQUIRE(replaceFile(dir / "t", std::string(100000, 'x')).isOk());
  CHECK(ddprun::testing::readFile(dir / "t") == std::string(100000, 'x'));
  CHECK_FALSE(ddprun::testing::fileExists(dir / "t.tmp"));
  // A directory in the way: the error names the file, and the temp file is gone.
  REQUIRE(::mkdir((dir / "d").c_str(), 0755) == 0);
  Status st = replaceFile(dir / "d", "x");
  REQUIRE_FALSE(st.isOk());
  CHECK(st.message().find("cannot write " + dir / "d") != std::string::npos);
  CHECK_FALSE(ddprun::testing::fileExists(dir / "d.tmp"));
  // A directory that is not there.
  st = replaceFile(dir / "no/t", "x");
  REQUIRE_FALSE(st.isOk());
  CHECK(st.message().find("cannot create " + dir / "no/t.tmp") != std::string::npos);
  // A symlink left at the temp path is not written through.
  std::ofstream(dir / "victim") << "keep";
  REQUIRE(::symlink((dir / "victim").c_str(), (dir / "s.tmp").c_str()) == 0);
  REQUIRE(replaceFile(dir / "s", "x").isOk());
  CHECK(ddprun::testing::readFile(dir / "s") == "x");
  CHECK(ddprun::testing::readFile(dir / "victim") == "keep");
}

TEST_CASE("filesOpenForWriting names the files another process holds open to write", "[files]") {
  TempDir dir;
  for (const char* name : {"w", "r", "rw", "mine"}) std::ofstream(dir / name) << name;
  auto id = [&](const std::string& name) {
    struct stat st {};
    REQUIRE(::stat((dir / name).c_str(), &st) == 0);
    return std::make_pair(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
  };
  struct stat top {};
  REQUIRE(::stat(dir.path().c_str(), &top) == 0);
  const uint64_t dev = top.st_dev;
  CHECK(filesOpenForWriting(dev).count(id("w")) == 0);

  // This process's own descriptors are not counted: the agent writes only what it fetches.
  const int mine = ::open((dir / "mine").c_str(), O_WRONLY | O_CLOEXEC);
  REQUIRE(mine >= 0);
  int ready[2], done[2];
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(done) == 0);
  const std::string w = dir / "w", r = dir / "r", rw = dir / "rw";
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(mine);
    ::close(done[1]);
    const bool opened = ::open(w.c_str(), O_WRONLY | O_APPEND) >= 0 &&
                        ::open(r.c_str(), O_RDONLY) >= 0 && ::open(rw.c_str(), O_RDWR) >= 0;
    char c = opened ? '1' : '0';
    if (::write(ready[1], &c, 1) != 1) ::_exit(1);
    (void)!::read(done[0], &c, 1);  // until the parent is done looking
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(done[0]);
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  CHECK(c == '1');
  const auto open = filesOpenForWriting(dev);
  CHECK(open.count(id("w")) == 1);
  CHECK(open.count(id("rw")) == 1);
  CHECK(open.count(id("r")) == 0);
  CHECK(open.count(id("mine")) == 0);
  CHECK(filesOpenForWriting(dev + 1).count(id("w")) == 0);  // another device: not looked at
  ::close(done[1]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(filesOpenForWriting(dev).count(id("w")) == 0);  // closed with its process
  ::close(ready[0]);
  ::close(mine);
}

TEST_CASE("a peer's path never leads through a symlink out of the snapshot directory", "[files]") {
  TempDir dir, outside;
  std::ofstream(outside / "victim") << "keep";
  REQUIRE(::symlink(outside.path().c_str(), (dir / "ld").c_str()) == 0);
  REQUIRE(::mkdir((dir / "real").c_str(), 0755) == 0);
  std::ofstream(dir / "real/file") << "mine";

  // Deletions, renames, links and looks through the symlinked directory are refused, naming it.
  Status st = removeBeneath(dir.path(), "ld/victim");
  REQUIRE_FALSE(st.isOk());
  CHECK(st.message() == dir / "ld" + " is a symbolic link (not followed)");
  CHECK(ddprun::testing::readFile(outside / "victim") == "keep");
  CHECK_FALSE(renameBeneath(dir.path(), "ld/victim", "real/taken").isOk());
  CHECK_FALSE(renameBeneath(dir.path(), "real/file", "ld/planted").isOk());
  CHECK_FALSE(linkBeneath(dir.path(), "ld/victim", "real/linked").isOk());
  CHECK_FALSE(linkBeneath(dir.path(), "real/file", "ld/linked").isOk());
  CHECK_FALSE(statBeneath(dir.path(), "ld/victim").isOk());
  CHECK_FALSE(openDirBeneath(dir.path(), "ld").isOk());
  CHECK(ddprun::testing::readFile(outside / "victim") == "keep");
  CHECK_FALSE(ddprun::testing::fileExists(outside / "planted"));
  CHECK_FALSE(ddprun::testing::fileExists(outside / "linked"));
  CHECK_FALSE(ddprun::testing::fileExists(dir / "real/taken"));
  // Empty directories are removed up to the symlink, never through it.
  REQUIRE(::mkdir((outside / "sub").c_str(), 0755) == 0);
  removeEmptyParentsUnder(dir.path(), "ld/sub/x.bin");
  CHECK(ddprun::testing::isDirectory(outside / "sub"));
  // Names that are not plain are refused.
  CHECK_FALSE(removeBeneath(dir.path(), "../x").isOk());
  CHECK_FALSE(removeBeneath(dir.path(), "real/../../x").isOk());
  CHECK_FALSE(removeBeneath(dir.path(), "real//file").isOk());

  // The last part itself is acted on, not what it points to: a symlink is removed as a name.
  REQUIRE(::symlink((outside / "victim").c_str(), (dir / "real/lnk").c_str()) == 0);
  REQUIRE(removeBeneath(dir.path(), "real/lnk").isOk());
  CHECK_FALSE(ddprun::testing::fileExists(dir / "real/lnk"));
  CHECK(ddprun::testing::readFile(outside / "victim") == "keep");
  // And what is inside works as before.
  REQUIRE(linkBeneath(dir.path(), "real/file", "real/second").isOk());
  REQUIRE(renameBeneath(dir.path(), "real/second", "third").isOk());
  CHECK(ddprun::testing::readFile(dir / "third") == "mine");
  auto st3 = statBeneath(dir.path(), "third");
  REQUIRE(st3.isOk());
  CHECK(S_ISREG(st3->st_mode));
  REQUIRE(removeBeneath(dir.path(), "third").isOk());
  REQUIRE(removeBeneath(dir.path(), "third").isOk());  // gone already: fine
  REQUIRE(removeBeneath(dir.path(), "nodir/x").isOk());
}

TEST_CASE("the temp files of writers that were killed are removed, a live writer's are kept",
          "[files]") {
  TempDir dir;
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) ::_exit(0);
  REQUIRE(::waitpid(child, nullptr, 0) == child);  // a pid that is gone
  const std::string dead = std::to_string(child), live = std::to_string(::getpid());
  REQUIRE(::mkdir((dir / "step_1").c_str(), 0755) == 0);
  for (const std::string& name :
       {"snapshot.pt.tmp." + dead + ".123", "step_1/model.pt.tmp." + dead + ".9",
        "snapshot.pt.tmp." + live + ".5", std::string("snapshot.pt"), std::string("notes.tmp.x.1"),
        "a.tmp." + dead}) {
    std::ofstream(dir / name) << "x";
  }
  TempDir outside;
  std::ofstream(outside / ("o.tmp." + dead + ".1")) << "x";
  REQUIRE(::symlink(outside.path().c_str(), (dir / "link").c_str()) == 0);
  auto removed = removeDeadWritersTempFiles(dir.path());
  std::sort(removed.begin(), removed.end());
  CHECK(removed == std::vector<std::string>{"snapshot.pt.tmp." + dead + ".123",
                                            "step_1/model.pt.tmp." + dead + ".9"});
  CHECK(ddprun::testing::fileExists(dir / ("snapshot.pt.tmp." + live + ".5")));
  CHECK(ddprun::testing::fileExists(dir / "snapshot.pt"));
  CHECK(ddprun::testing::fileExists(dir / "notes.tmp.x.1"));
  CHECK(ddprun::testing::fileExists(outside / ("o.tmp." + dead + ".1")));  // not followed
}
