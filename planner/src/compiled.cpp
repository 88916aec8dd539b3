// Compilation of a BlockProblem into items and elements (compiled.h).
#include "compiled.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "tapesac/planner/evaluate.h"

namespace tapesac::planner::detail {

StorageGroups storage_groups(const BlockProblem& p) {
  StorageGroups g;
  g.of_value.resize(p.values.size());
  std::unordered_map<int32_t, int32_t> dense;
  for (size_t v = 0; v < p.values.size(); ++v) {
    const int32_t s = p.values[v].storage;
    int32_t id = g.count;
    if (s != kOwnStorage) {
      auto [it, inserted] = dense.emplace(s, g.count);
      id = it->second;
      if (!inserted) {
        g.of_value[v] = id;
        if (p.values[v].producer == kExternalProducer) g.external[static_cast<size_t>(id)] = 1;
        continue;
      }
    }
    g.of_value[v] = id;
    g.external.push_back(p.values[v].producer == kExternalProducer ? 1 : 0);
    ++g.count;
  }
  return g;
}

std::vector<std::vector<int32_t>> min_closures(const BlockProblem& p) {
  std::vector<uint8_t> is_candidate(p.values.size(), 0);
  for (int32_t v : p.candidates) is_candidate[static_cast<size_t>(v)] = 1;
  std::vector<std::vector<int32_t>> closures(p.candidates.size());
  // Stamps instead of clearing per candidate.
  std::vector<int32_t> seen_op(p.ops.size(), -1);
  std::vector<int32_t> stack;
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    const int32_t stamp = static_cast<int32_t>(c);
    stack.assign(1, p.candidates[c]);
    std::vector<int32_t>& ops = closures[c];
    while (!stack.empty()) {
      const int32_t v = stack.back();
      stack.pop_back();
      const int32_t producer = p.values[static_cast<size_t>(v)].producer;
      if (producer == kExternalProducer || seen_op[static_cast<size_t>(producer)] == stamp) continue;
      seen_op[static_cast<size_t>(producer)] = stamp;
      ops.push_back(producer);
      for (int32_t in : p.ops[static_cast<size_t>(producer)].inputs) {
        if (!is_candidate[static_cast<size_t>(in)]) stack.push_back(in);
      }
    }
    std::sort(ops.begin(), ops.end());
  }
  return closures;
}

KeepMask Compiled::mask(const std::vector<uint8_t>& kept_items) const {
  KeepMask keep = base_keep;
  for (size_t i = 0; i < kept_items.size(); ++i) {
    if (kept_items[i]) keep[static_cast<size_t>(item_candidate[i])] = 1;
  }
  return keep;
}

Compiled compile(const BlockProblem& p) {
  Compiled m;
  m.n_candidates = static_cast<int32_t>(p.candidates.size());
  const std::vector<std::vector<int32_t>> closures = min_closures(p);
  const StorageGroups groups = storage_groups(p);

  KeepMask forced(p.candidates.size(), 0);
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    forced[c] = p.must_keep[c] || std::any_of(closures[c].begin(), closures[c].end(), [&](int32_t i) {
                  return !p.ops[static_cast<size_t>(i)].replayable;
                });
  }
  // Bytes already held per storage group by the forced candidates.
  std::vector<int64_t> held(static_cast<size_t>(groups.count), 0);
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    const size_t v = static_cast<size_t>(p.candidates[c]);
    const size_t g = static_cast<size_t>(groups.of_value[v]);
    if (forced[c] && !groups.external[g]) held[g] = std::max(held[g], p.values[v].bytes);
  }
  auto extra_bytes = [&](size_t c) {
    const size_t v = static_cast<size_t>(p.candidates[c]);
    const size_t g = static_cast<size_t>(groups.of_value[v]);
    return groups.external[g] ? int64_t{0} : std::max<int64_t>(0, p.values[v].bytes - held[g]);
  };
  auto positive_cost = [&](size_t c) {
    return std::any_of(closures[c].begin(), closures[c].end(),
                       [&](int32_t i) { return p.ops[static_cast<size_t>(i)].cost_ns > 0; });
  };

  m.base_keep = forced;
  std::unordered_map<int32_t, int32_t> item_group_of;  // storage group -> dense item group
  for (size_t c = 0; c < p.candidates.size(); ++c) {
    if (forced[c]) continue;
    if (extra_bytes(c) == 0) {
      m.base_keep[c] = 1;
      continue;
    }
    if (!positive_cost(c)) continue;  // dropped in every solution
    const int32_t item = m.n_items();
    const size_t v = static_cast<size_t>(p.candidates[c]);
    const int32_t sg = groups.of_value[v];
    auto [it, inserted] = item_group_of.emplace(sg, static_cast<int32_t>(m.group_base.size()));
    if (inserted) {
      m.group_base.push_back(held[static_cast<size_t>(sg)]);
      m.group_items.emplace_back();
    }
    m.item_candidate.push_back(static_cast<int32_t>(c));
    m.item_bytes.push_back(p.values[v].bytes);
    m.item_group.push_back(it->second);
    m.group_items[static_cast<size_t>(it->second)].push_back(item);
  }
  m.base_bytes = kept_bytes(p, m.base_keep);

  // Per op, the items whose drop needs it; ops with the same item set form one element.
  std::vector<std::vector<int32_t>> op_items(p.ops.size());
  for (int32_t item = 0; item < m.n_items(); ++item) {
    for (int32_t op : closures[static_cast<size_t>(m.item_candidate[static_cast<size_t>(item)])]) {
      op_items[static_cast<size_t>(op)].push_back(item);
    }
  }
  std::map<std::vector<int32_t>, int32_t> element_of;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    if (op_items[i].empty() || p.ops[i].cost_ns <= 0) continue;
    auto [it, inserted] = element_of.emplace(op_items[i], m.n_elements());
    if (inserted) {
      m.element_weight.push_back(0);
      m.element_items.push_back(op_items[i]);
    }
    m.element_weight[static_cast<size_t>(it->second)] += p.ops[i].cost_ns;
  }
  m.item_elements.resize(static_cast<size_t>(m.n_items()));
  for (int32_t e = 0; e < m.n_elements(); ++e) {
    m.total_weight += m.element_weight[static_cast<size_t>(e)];
    for (int32_t item : m.element_items[static_cast<size_t>(e)]) {
      m.item_elements[static_cast<size_t>(item)].push_back(e);
    }
  }
  return m;
}

}  // namespace tapesac::planner::detail
