// Internal to tapesac::planner's keep-set solvers (select_greedy.cpp, select_hull.cpp, select_exact.cpp): the
// incremental State of one choice of kept items, which every solver moves through, and the one search that one
// solver file calls in another. Not thread-safe (a State belongs to one solver run).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "compiled.h"

namespace tapesac::planner::detail {

/// Slack below which two saved weights count as equal (relative to the problem's total weight).
inline double tolerance(const Compiled& m) { return 1e-9 * m.total_weight + 1e-12; }

/// Incremental view of one choice of kept items: bytes beyond the base and saved weight. Borrows `m`.
class State {
 public:
  explicit State(const Compiled& m)
      : m_(m),
        kept_(static_cast<size_t>(m.n_items()), 0),
        miss_(static_cast<size_t>(m.n_elements())),
        group_max_(m.group_base) {
    for (int32_t e = 0; e < m.n_elements(); ++e) {
      miss_[static_cast<size_t>(e)] = static_cast<int32_t>(m.element_items[static_cast<size_t>(e)].size());
    }
  }

  bool kept(int32_t i) const { return kept_[static_cast<size_t>(i)] != 0; }
  int32_t miss(int32_t e) const { return miss_[static_cast<size_t>(e)]; }
  int64_t bytes() const { return bytes_; }
  double saved() const { return saved_; }

  void add(int32_t i) {
    kept_[static_cast<size_t>(i)] = 1;
    int64_t& g = group_max_[group(i)];
    const int64_t b = m_.item_bytes[static_cast<size_t>(i)];
    if (b > g) {
      bytes_ += b - g;
      g = b;
    }
    for (int32_t e : m_.item_elements[static_cast<size_t>(i)]) {
      if (--miss_[static_cast<size_t>(e)] == 0) saved_ += m_.element_weight[static_cast<size_t>(e)];
    }
  }

  void remove(int32_t i) {
    kept_[static_cast<size_t>(i)] = 0;
    const size_t g = group(i);
    const int64_t after = max_without(g, -1);
    bytes_ -= group_max_[g] - after;
    group_max_[g] = after;
    for (int32_t e : m_.item_elements[static_cast<size_t>(i)]) {
      if (miss_[static_cast<size_t>(e)]++ == 0) saved_ -= m_.element_weight[static_cast<size_t>(e)];
    }
  }

  /// Weight saved by adding item i alone / lost by removing it alone.
  double gain_add(int32_t i) const { return weight_at(i, 1); }
  double loss_remove(int32_t i) const { return weight_at(i, 0); }
  int64_t bytes_add(int32_t i) const {
    return std::max<int64_t>(0, m_.item_bytes[static_cast<size_t>(i)] - group_max_[group(i)]);
  }
  int64_t bytes_remove(int32_t i) const {
    const size_t g = group(i);
    return group_max_[g] - max_without(g, i);
  }

  const std::vector<uint8_t>& kept_items() const { return kept_; }
  int64_t group_max(int32_t g) const { return group_max_[static_cast<size_t>(g)]; }

  /// Adds and removes items until exactly `kept` are kept.
  void reset_to(const std::vector<uint8_t>& kept) {
    for (int32_t i = 0; i < m_.n_items(); ++i) {
      if (kept_[static_cast<size_t>(i)] && !kept[static_cast<size_t>(i)]) remove(i);
    }
    for (int32_t i = 0; i < m_.n_items(); ++i) {
      if (!kept_[static_cast<size_t>(i)] && kept[static_cast<size_t>(i)]) add(i);
    }
  }

  ItemSolution solution() const {
    ItemSolution s;
    s.kept = kept_;
    s.bytes = bytes_;
    // Recomputed in a fixed order so that equal choices report bit-identical values.
    for (int32_t e = 0; e < m_.n_elements(); ++e) {
      if (miss_[static_cast<size_t>(e)] == 0) s.saved += m_.element_weight[static_cast<size_t>(e)];
    }
    return s;
  }

 private:
  size_t group(int32_t i) const { return static_cast<size_t>(m_.item_group[static_cast<size_t>(i)]); }

  double weight_at(int32_t i, int32_t miss) const {
    double w = 0;
    for (int32_t e : m_.item_elements[static_cast<size_t>(i)]) {
      if (miss_[static_cast<size_t>(e)] == miss) w += m_.element_weight[static_cast<size_t>(e)];
    }
    return w;
  }

  // Largest bytes held in group g by the base and the kept items other than `skip`.
  int64_t max_without(size_t g, int32_t skip) const {
    int64_t best = m_.group_base[g];
    for (int32_t j : m_.group_items[g]) {
      if (j != skip && kept_[static_cast<size_t>(j)]) best = std::max(best, m_.item_bytes[static_cast<size_t>(j)]);
    }
    return best;
  }

  const Compiled& m_;
  std::vector<uint8_t> kept_;
  std::vector<int32_t> miss_;
  std::vector<int64_t> group_max_;
  int64_t bytes_ = 0;
  double saved_ = 0;
};

/// The State keeping exactly the items with kept[i] != 0.
inline State state_of(const Compiled& m, const std::vector<uint8_t>& kept) {
  State s(m);
  for (int32_t i = 0; i < m.n_items(); ++i) {
    if (kept[static_cast<size_t>(i)]) s.add(i);
  }
  return s;
}

/// `cur` improved by exact neighbourhoods of `size` items (Note [Exact neighbourhoods] in select_exact.cpp); `sweep`
/// slides the window of dropped items until every one was in a neighbourhood. select_exact.cpp.
ItemSolution neighbourhood_search(const Compiled& m, int64_t budget, ItemSolution cur, int32_t size, bool sweep);

}  // namespace tapesac::planner::detail
