#include "state_value.h"

#include <algorithm>
#include <charconv>
#include <map>

#include "ddprun/common/deflate.h"

namespace ddprun::etcd {

namespace {

using rendezvous::Participant;
using rendezvous::RoundChange;
using rendezvous::RoundInfo;

// "v3;": the snapshot section is "p" + the snapshot, or "z" + its size + ":" + the snapshot
// deflated (zlib). "v2;": the snapshot as it is. No tag: no answers either (the first format).
constexpr std::string_view kTag = "v3;";
constexpr std::string_view kTagPlain = "v2;";

// Snapshots smaller than this are stored as they are: deflating them saves little.
constexpr size_t kDeflateFrom = 1024;

void appendSnapshot(std::string& out, const std::string& snapshot) {
  auto packed = snapshot.size() < kDeflateFrom ? std::nullopt : deflateFast(snapshot);
  if (!packed) {
    out += 'p';
    out += snapshot;
    return;
  }
  out += 'z';
  out += std::to_string(snapshot.size());
  out += ':';
  out += *packed;
}

// Numbers are decimal followed by a separator; strings "<length>:<bytes>" (as in snapshots).
class Writer {
 public:
  void num(uint64_t v) {
    out_ += std::to_string(v);
    out_ += ' ';
  }
  void str(std::string_view s) {
    out_ += std::to_string(s.size());
    out_ += ':';
    out_ += s;
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

class Cursor {
 public:
  explicit Cursor(std::string_view s) : s_(s) {}
  bool ok() const { return ok_; }
  bool atEnd() const { return pos_ == s_.size(); }

  uint64_t num(char sep = ' ') {
    if (!ok_) return 0;
    const size_t end = s_.find(sep, pos_);
    uint64_t v = 0;
    if (end == std::string_view::npos || end == pos_) return fail();
    auto r = std::from_chars(s_.data() + pos_, s_.data() + end, v);
    if (r.ec != std::errc() || r.ptr != s_.data() + end) return fail();
    pos_ = end + 1;
    return v;
  }
  std::string_view bytes(uint64_t n) {
    if (!ok_ || n > s_.size() - pos_) {
      fail();
      return {};
    }
    std::string_view v = s_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return v;
  }
  std::string_view str() { return bytes(num(':')); }

 private:
  uint64_t fail() {
    ok_ = false;
    return 0;
  }
  std::string_view s_;
  size_t pos_ = 0;
  bool ok_ = true;
};

void writeChange(Writer& w, const RoundChange& r) {
  w.num(static_cast<uint64_t>(r.kind));
  w.num(static_cast<uint64_t>(r.reason));
  w.num(r.round);
  w.num(r.status.completed_round);
  w.num(r.status.pending_round);
  w.num(r.status.closed ? 1 : 0);
  w.num(r.status.participants);
  w.num(r.status.waiting);
  w.num(r.status.spares);
  w.str(r.node_id);
}

RoundChange readChange(Cursor& c) {
  RoundChange r;
  r.kind = static_cast<rendezvous::ChangeKind>(c.num());
  r.reason = static_cast<rendezvous::ChangeReason>(c.num());
  r.round = c.num();
  r.status.completed_round = c.num();
  r.status.pending_round = c.num();
  r.status.closed = c.num() != 0;
  r.status.participants = static_cast<uint32_t>(c.num());
  r.status.waiting = static_cast<uint32_t>(c.num());
  r.status.spares = static_cast<uint32_t>(c.num());
  r.node_id = std::string(c.str());
  return r;
}

// answers := str(entries) <lists>
// entries := (num(call) str(body))*
// body    := "0 " num(list + 1, 0: none) num(round) num(group_rank) num(group_world_size)
//            num(base_rank) num(world_size) num(master_port) str(node_id) str(master_addr)
//          | num(status code) str(message)
// lists   := num(count) (num(size) (str(node_id) str(address) num(local_world_size))*size)*
// The entries come first so a joiner looking for its call skips the participant lists, which it
// reads (one of them) only when its entry refers to one.
std::string encodeAnswers(const std::vector<rendezvous::RendezvousState::JoinDone>& answers) {
  if (answers.empty()) return {};
  std::map<const std::vector<Participant>*, uint64_t> list_index;
  std::vector<const std::vector<Participant>*> lists;
  Writer entries;
  for (const auto& a : answers) {
    Writer body;
    if (a.result.isOk()) {
      const RoundInfo& info = a.result.value();
      uint64_t list = 0;
      if (info.participants) {
        auto [it, fresh] = list_index.emplace(info.participants.get(), lists.size() + 1);
        if (fresh) lists.push_back(info.participants.get());
        list = it->second;
      }
      body.num(0);
      body.num(list);
      body.num(info.round);
      body.num(info.group_rank);
      body.num(info.group_world_size);
      body.num(info.base_rank);
      body.num(info.world_size);
      body.num(info.master_port);
      body.str(info.node_id);
      body.str(info.master_addr);
    } else {
      body.num(static_cast<uint64_t>(a.result.status().code()));
      body.str(a.result.status().message());
    }
    entries.num(a.id);
    entries.str(body.out());
  }
  Writer w;
  w.str(entries.out());
  w.num(lists.size());
  for (const auto* list : lists) {
    w.num(list->size());
    for (const Participant& p : *list) {
      w.str(p.node_id);
      w.str(p.address);
      w.num(p.local_world_size);
    }
  }
  return std::move(w.out());
}

}  // namespace

std::string encodeStateValue(const std::vector<rendezvous::RendezvousState::Change>& changes,
                             const std::vector<rendezvous::RendezvousState::JoinDone>& answers,
                             const std::string& snapshot, std::optional<TimePoint> next_deadline) {
  Writer c;
  for (const auto& ch : changes) writeChange(c, ch.change);
  const std::string a = encodeAnswers(answers);
  std::string out(kTag);
  out += next_deadline ? std::to_string(next_deadline->time_since_epoch().count()) : "-";
  out += ';';
  out += std::to_string(c.out().size());
  out += ':';
  out += c.out();
  out += std::to_string(a.size());
  out += ':';
  out += a;
  appendSnapshot(out, snapshot);
  return out;
}

StateValue::StateValue() : stored_(std::make_shared<const std::string>()) {}

StatusOr<StateValue> StateValue::parse(std::shared_ptr<const std::string> stored) {
  StateValue v;
  if (!stored || stored->empty()) return v;
  v.stored_ = std::move(stored);
  auto bad = [] { return invalidArgument("the stored rendezvous state is unreadable"); };
  std::string_view s = *v.stored_;
  const bool packed = s.substr(0, kTag.size()) == kTag;
  const bool tagged = packed || s.substr(0, kTagPlain.size()) == kTagPlain;
  size_t pos = tagged ? kTag.size() : 0;
  const size_t semi = s.find(';', pos);
  if (semi == std::string_view::npos) return bad();
  const std::string_view deadline = s.substr(pos, semi - pos);
  if (deadline != "-") {
    int64_t ns = 0;
    auto r = std::from_chars(deadline.data(), deadline.data() + deadline.size(), ns);
    if (r.ec != std::errc() || r.ptr != deadline.data() + deadline.size() || deadline.empty()) {
      return bad();
    }
    v.next_deadline_ = TimePoint(Duration(static_cast<Duration::rep>(ns)));
  }
  Cursor header(s.substr(semi + 1));
  const std::string_view changes = header.str();
  std::string_view answers;
  if (tagged) answers = header.str();
  if (!header.ok()) return bad();
  Cursor c(changes);
  while (c.ok() && !c.atEnd()) v.changes_.push_back(readChange(c));
  if (!c.ok()) return bad();
  v.answers_begin_ = static_cast<size_t>(answers.data() - s.data());
  v.answers_end_ = v.answers_begin_ + answers.size();
  v.snapshot_begin_ =
      tagged ? v.answers_end_ : static_cast<size_t>(changes.data() - s.data()) + changes.size();
  if (!tagged) v.answers_begin_ = v.answers_end_ = v.snapshot_begin_;
  if (packed) {
    if (v.snapshot_begin_ >= s.size()) return bad();
    const char how = s[v.snapshot_begin_++];
    if (how == 'z') {
      Cursor size(s.substr(v.snapshot_begin_));
      v.inflated_size_ = size.num(':');
      if (!size.ok() || v.inflated_size_ == 0) return bad();
      if (v.inflated_size_ > kMaxStateSnapshotBytes) {
        // Checked before anything is allocated: every agent parses every value pushed to it.
        return invalidArgument("the stored rendezvous state says its snapshot inflates to " +
                               std::to_string(v.inflated_size_) + " bytes, more than the " +
                               std::to_string(kMaxStateSnapshotBytes) +
                               " any run writes (a damaged or foreign value)");
      }
      v.snapshot_begin_ = s.find(':', v.snapshot_begin_) + 1;
    } else if (how != 'p') {
      return bad();
    }
  }
  return v;
}

StatusOr<std::string> StateValue::snapshot() const {
  const std::string_view stored = std::string_view(*stored_).substr(snapshot_begin_);
  if (inflated_size_ == 0) return std::string(stored);
  return inflateBounded(stored, inflated_size_);
}

StatusOr<std::string> inflateBounded(std::string_view deflated, uint64_t size) {
  auto bad = [](const std::string& why) {
    return invalidArgument("the stored rendezvous state is unreadable (its snapshot " + why + ")");
  };
  if (size > kMaxStateSnapshotBytes) return bad("states more bytes than any run writes");
  auto out = inflateExactly(deflated, size);
  if (!out.isOk()) return bad(out.status().message());
  return out;
}

std::optional<StatusOr<RoundInfo>> StateValue::joinAnswer(uint64_t call) const {
  if (answers_begin_ == answers_end_) return std::nullopt;
  Cursor answers(std::string_view(*stored_).substr(answers_begin_, answers_end_ - answers_begin_));
  Cursor entries(answers.str());
  std::string_view found;
  bool have = false;
  while (entries.ok() && !entries.atEnd()) {
    const uint64_t id = entries.num();
    const std::string_view body = entries.str();
    if (entries.ok() && id == call) {
      found = body;
      have = true;
      break;
    }
  }
  if (!have) return std::nullopt;
  Cursor b(found);
  const uint64_t code = b.num();
  if (code > static_cast<uint64_t>(StatusCode::kUnauthenticated)) return std::nullopt;
  if (code != 0) {
    const std::string_view message = b.str();
    if (!b.ok() || !b.atEnd()) return std::nullopt;
    return StatusOr<RoundInfo>(Status(static_cast<StatusCode>(code), std::string(message)));
  }
  RoundInfo info;
  const uint64_t list = b.num();
  info.round = b.num();
  info.group_rank = static_cast<uint32_t>(b.num());
  info.group_world_size = static_cast<uint32_t>(b.num());
  info.base_rank = static_cast<uint32_t>(b.num());
  info.world_size = static_cast<uint32_t>(b.num());
  info.master_port = static_cast<uint32_t>(b.num());
  info.node_id = std::string(b.str());
  info.master_addr = std::string(b.str());
  if (!b.ok() || !b.atEnd()) return std::nullopt;
  if (list > 0) {
    const uint64_t lists = answers.num();
    if (!answers.ok() || list > lists) return std::nullopt;
    for (uint64_t i = 1; i <= list && answers.ok(); ++i) {
      const uint64_t size = answers.num();
      // A count bounded by what is left, so a damaged one cannot allocate much.
      if (i == list) {
        auto participants = std::make_shared<std::vector<Participant>>();
        participants->reserve(std::min<uint64_t>(size, answers_end_ - answers_begin_));
        for (uint64_t r = 0; r < size && answers.ok(); ++r) {
          Participant p;
          p.node_id = std::string(answers.str());
          p.address = std::string(answers.str());
          p.local_world_size = static_cast<uint32_t>(answers.num());
          p.group_rank = static_cast<uint32_t>(r);
          participants->push_back(std::move(p));
        }
        if (!answers.ok()) return std::nullopt;
        info.participants = std::move(participants);
      } else {
        for (uint64_t r = 0; r < size && answers.ok(); ++r) {
          answers.str();
          answers.str();
          answers.num();
        }
      }
    }
  }
  return StatusOr<RoundInfo>(std::move(info));
}

}  // namespace ddprun::etcd
