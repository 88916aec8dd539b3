// Cost and memory of a keep mask by walking the tape (evaluate.h).
#include "tapesac/planner/evaluate.h"

#include <algorithm>

#include "compiled.h"
#include "tapesac/common/errors.h"

namespace tapesac::planner {
namespace {

// Per op: 1 when replay runs it for `keep`. One reverse pass: an op is needed when one of its outputs is wanted;
// a needed op wants its inputs unless they are external or kept candidates.
std::vector<uint8_t> needed_ops(const BlockProblem& p, const KeepMask& keep) {
  validate_mask(p, keep);
  std::vector<uint8_t> wanted(p.values.size(), 0);
  std::vector<uint8_t> kept_value(p.values.size(), 0);
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    (keep[c] ? kept_value : wanted)[static_cast<size_t>(p.candidates[c])] = 1;
  }
  std::vector<uint8_t> needed(p.ops.size(), 0);
  for (size_t i = p.ops.size(); i-- > 0;) {
    const PlanOp& op = p.ops[i];
    const bool need = std::any_of(op.outputs.begin(), op.outputs.end(),
                                  [&](int32_t v) { return wanted[static_cast<size_t>(v)] != 0; });
    if (!need) continue;
    TAPESAC_CHECK(op.replayable, kConfig, "keep mask for '", p.signature,
                  "' drops a candidate whose rebuild needs op #", i, (op.name.empty() ? "" : " (" + op.name + ")"),
                  ", which is not replayable; keep every candidate forced_keep() reports");
    needed[i] = 1;
    for (int32_t v : op.inputs) {
      const PlanValue& in = p.values[static_cast<size_t>(v)];
      if (in.producer != kExternalProducer && !kept_value[static_cast<size_t>(v)]) wanted[static_cast<size_t>(v)] = 1;
    }
  }
  return needed;
}

}  // namespace

std::vector<int32_t> replay_ops(const BlockProblem& p, const KeepMask& keep) {
  const std::vector<uint8_t> needed = needed_ops(p, keep);
  std::vector<int32_t> ops;
  for (size_t i = 0; i < needed.size(); ++i) {
    if (needed[i]) ops.push_back(static_cast<int32_t>(i));
  }
  return ops;
}

double replay_cost_ns(const BlockProblem& p, const KeepMask& keep) {
  const std::vector<uint8_t> needed = needed_ops(p, keep);
  double cost = 0;
  for (size_t i = 0; i < needed.size(); ++i) {
    if (needed[i]) cost += p.ops[i].cost_ns;
  }
  return cost;
}

int64_t replay_working_set_bytes(const BlockProblem& p, const KeepMask& keep) {
  const std::vector<uint8_t> needed = needed_ops(p, keep);
  const detail::StorageGroups groups = detail::storage_groups(p);
  // Reads of kept values are served by the resident copy, so a replayed copy of a kept value dies at once; dropped
  // candidates live to the end (autograd unpacks them).
  std::vector<uint8_t> kept(p.values.size(), 0), dropped(p.values.size(), 0);
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    (keep[c] ? kept : dropped)[static_cast<size_t>(p.candidates[c])] = 1;
  }
  return detail::replay_walk_peak(p, groups, detail::group_creators(groups), needed, kept, dropped);
}

int64_t kept_bytes(const BlockProblem& p, const KeepMask& keep) {
  validate_mask(p, keep);
  const detail::StorageGroups groups = detail::storage_groups(p);
  std::vector<int64_t> group_max(static_cast<size_t>(groups.count), 0);
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    if (!keep[c]) continue;
    const size_t v = static_cast<size_t>(p.candidates[c]);
    const size_t g = static_cast<size_t>(groups.of_value[v]);
    if (!groups.external[g]) group_max[g] = std::max(group_max[g], p.values[v].bytes);
  }
  int64_t total = 0;
  for (int64_t b : group_max) total += b;
  return total;
}

KeepMask forced_keep(const BlockProblem& p) {
  KeepMask forced(p.candidates.size(), 0);
  const std::vector<std::vector<int32_t>> closures = detail::min_closures(p);
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    forced[c] = p.must_keep[c] || std::any_of(closures[c].begin(), closures[c].end(), [&](int32_t i) {
                  return !p.ops[static_cast<size_t>(i)].replayable;
                });
  }
  return forced;
}

KeepMask keep_all(const BlockProblem& p) { return KeepMask(p.candidates.size(), 1); }

namespace detail {

std::vector<int32_t> group_creators(const StorageGroups& groups) {
  std::vector<int32_t> creator(static_cast<size_t>(groups.count), -1);
  for (size_t v = 0; v < groups.of_value.size(); ++v) {
    int32_t& c = creator[static_cast<size_t>(groups.of_value[v])];
    if (c < 0) c = static_cast<int32_t>(v);
  }
  return creator;
}

int64_t replay_walk_peak(const BlockProblem& p, const StorageGroups& groups, const std::vector<int32_t>& creators,
                         const std::vector<uint8_t>& needed, const std::vector<uint8_t>& resident,
                         const std::vector<uint8_t>& pinned) {
  const int32_t forever = static_cast<int32_t>(p.ops.size());
  std::vector<int32_t> last_use(p.values.size(), -1);
  for (size_t i = 0; i < needed.size(); ++i) {
    if (!needed[i]) continue;
    for (int32_t v : p.ops[i].inputs) {
      if (!resident[static_cast<size_t>(v)]) last_use[static_cast<size_t>(v)] = static_cast<int32_t>(i);
    }
  }
  for (size_t v = 0; v < pinned.size(); ++v) {
    if (pinned[v]) last_use[v] = forever;
  }
  std::vector<int64_t> group_alloc(static_cast<size_t>(groups.count), 0);
  std::vector<int32_t> group_live(static_cast<size_t>(groups.count), 0);
  std::vector<uint8_t> counted(p.values.size(), 0);
  int64_t current = 0;
  int64_t peak = 0;
  auto release = [&](int32_t v) {
    if (!counted[static_cast<size_t>(v)]) return;
    counted[static_cast<size_t>(v)] = 0;
    const size_t g = static_cast<size_t>(groups.of_value[static_cast<size_t>(v)]);
    if (--group_live[g] == 0) {
      current -= group_alloc[g];
      group_alloc[g] = 0;
    }
  };
  for (size_t i = 0; i < needed.size(); ++i) {
    if (!needed[i]) continue;
    const PlanOp& op = p.ops[i];
    for (int32_t v : op.outputs) {
      const size_t g = static_cast<size_t>(groups.of_value[static_cast<size_t>(v)]);
      // An alias of a storage replay does not hold aliases a resident one (a kept or external value): free.
      // Note: replay writes into a resident storage through a private copy, which this does not count.
      if (creators[g] != v && group_live[g] == 0) continue;
      const int64_t bytes = p.values[static_cast<size_t>(v)].bytes;
      if (bytes > group_alloc[g]) {
        current += bytes - group_alloc[g];
        group_alloc[g] = bytes;
      }
      ++group_live[g];
      counted[static_cast<size_t>(v)] = 1;
    }
    peak = std::max(peak, current);
    for (int32_t v : op.outputs) {
      if (last_use[static_cast<size_t>(v)] <= static_cast<int32_t>(i)) release(v);
    }
    for (int32_t v : op.inputs) {
      if (last_use[static_cast<size_t>(v)] == static_cast<int32_t>(i)) release(v);
    }
  }
  return peak;
}

}  // namespace detail

}  // namespace tapesac::planner
