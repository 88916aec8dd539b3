// Keep-set selection, the exact side (select.h): branch and bound over at most 64 items (Note [Branch and bound]),
// and the large-neighbourhood search that re-solves a few items near the decision boundary with it (Note [Exact
// neighbourhoods]), which the heuristic and the frontier end with.
#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "compiled.h"
#include "select_state.h"
#include "tapesac/common/errors.h"

namespace tapesac::planner::detail {
namespace {

// Note [Branch and bound]. Items are decided in order of decreasing potential (each element's weight shared evenly
// among its items, per byte): good solutions come first, which tightens the bound early. A set of items is a bit
// mask over that order (bit k is item order[k]), hence at most 64 items. At each node the elements whose items are
// all kept count for certain; the bound adds a fractional knapsack over the undecided items, each carrying its
// shares of the open elements, with a shared storage's extra bytes split evenly among its undecided items (a lower
// bound on each). Depth <= 64 keeps the recursion shallow (an iterative search would be longer).
class BranchAndBound {
 public:
  BranchAndBound(const Compiled& m, int64_t budget, const ItemSolution& incumbent)
      : m_(m),
        budget_(budget),
        n_(m.n_items()),
        eps_(tolerance(m)),
        all_(n_ == 64 ? ~uint64_t{0} : ((uint64_t{1} << n_) - 1)),
        best_saved_(incumbent.saved),
        best_bytes_(incumbent.bytes),
        group_max_(m.group_base),
        density_(static_cast<size_t>(n_)),
        lb_(static_cast<size_t>(n_)) {
    order_items();
    index_in_order(incumbent);
    idx_.reserve(static_cast<size_t>(n_));
  }

  ItemSolution solve() {
    search(0, 0, 0, 0);
    State s(m_);
    for (int32_t k = 0; k < n_; ++k) {
      if (best_mask_ & (uint64_t{1} << k)) s.add(order_[static_cast<size_t>(k)]);
    }
    return s.solution();
  }

 private:
  // order_ by decreasing potential per byte; pos_ its inverse.
  void order_items() {
    std::vector<double> potential(static_cast<size_t>(n_), 0);
    for (int32_t e = 0; e < m_.n_elements(); ++e) {
      const auto& items = m_.element_items[static_cast<size_t>(e)];
      for (int32_t i : items) {
        potential[static_cast<size_t>(i)] +=
            m_.element_weight[static_cast<size_t>(e)] / static_cast<double>(items.size());
      }
    }
    order_.resize(static_cast<size_t>(n_));
    std::iota(order_.begin(), order_.end(), 0);
    std::sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
      return potential[static_cast<size_t>(a)] / static_cast<double>(m_.item_bytes[static_cast<size_t>(a)]) >
             potential[static_cast<size_t>(b)] / static_cast<double>(m_.item_bytes[static_cast<size_t>(b)]);
    });
    pos_.resize(static_cast<size_t>(n_));
    for (int32_t k = 0; k < n_; ++k) pos_[static_cast<size_t>(order_[static_cast<size_t>(k)])] = k;
  }

  // Elements, bytes, groups and the incumbent in position space.
  void index_in_order(const ItemSolution& incumbent) {
    emask_.assign(static_cast<size_t>(m_.n_elements()), 0);
    for (int32_t e = 0; e < m_.n_elements(); ++e) {
      for (int32_t i : m_.element_items[static_cast<size_t>(e)]) {
        emask_[static_cast<size_t>(e)] |= uint64_t{1} << pos_[static_cast<size_t>(i)];
      }
    }
    pbytes_.resize(static_cast<size_t>(n_));
    pgroup_.resize(static_cast<size_t>(n_));
    for (int32_t k = 0; k < n_; ++k) {
      pbytes_[static_cast<size_t>(k)] = m_.item_bytes[static_cast<size_t>(order_[static_cast<size_t>(k)])];
      pgroup_[static_cast<size_t>(k)] = m_.item_group[static_cast<size_t>(order_[static_cast<size_t>(k)])];
    }
    group_mask_.assign(m_.group_base.size(), 0);
    for (int32_t k = 0; k < n_; ++k) {
      group_mask_[static_cast<size_t>(pgroup_[static_cast<size_t>(k)])] |= uint64_t{1} << k;
    }
    for (int32_t i = 0; i < n_; ++i) {
      if (incumbent.kept[static_cast<size_t>(i)]) best_mask_ |= uint64_t{1} << pos_[static_cast<size_t>(i)];
    }
  }

  // The weight of the elements with every item kept; density_ receives each undecided item's share of the open
  // elements per byte (0 for the others).
  double weigh(uint64_t drop, uint64_t undecided) {
    double certain = 0;
    std::fill(density_.begin(), density_.end(), 0.0);
    for (size_t e = 0; e < emask_.size(); ++e) {
      const uint64_t s = emask_[e];
      if (s & drop) continue;
      const uint64_t open = s & undecided;
      if (open == 0) {
        certain += m_.element_weight[e];
        continue;
      }
      double bsum = 0;
      for (uint64_t r = open; r; r &= r - 1) {
        bsum += static_cast<double>(pbytes_[static_cast<size_t>(__builtin_ctzll(r))]);
      }
      const double d = m_.element_weight[e] / bsum;
      for (uint64_t r = open; r; r &= r - 1) density_[static_cast<size_t>(__builtin_ctzll(r))] += d;
    }
    return certain;
  }

  // `certain` plus the fractional knapsack over the undecided items (Note [Branch and bound]), in the room left.
  double upper_bound(double certain, uint64_t undecided, int64_t bytes) {
    idx_.clear();
    double bound = certain;
    for (uint64_t r = undecided; r; r &= r - 1) {
      const int32_t j = __builtin_ctzll(r);
      if (density_[static_cast<size_t>(j)] <= 0) continue;
      const size_t g = static_cast<size_t>(pgroup_[static_cast<size_t>(j)]);
      const int64_t extra = std::max<int64_t>(0, pbytes_[static_cast<size_t>(j)] - group_max_[g]);
      const int32_t open_in_group = __builtin_popcountll(group_mask_[g] & undecided);
      lb_[static_cast<size_t>(j)] = static_cast<double>(extra) / open_in_group;
      if (lb_[static_cast<size_t>(j)] <= 0) {
        bound += density_[static_cast<size_t>(j)] * static_cast<double>(pbytes_[static_cast<size_t>(j)]);
      } else {
        idx_.push_back(j);
      }
    }
    auto per_byte = [&](int32_t j) {
      const size_t u = static_cast<size_t>(j);
      return density_[u] * static_cast<double>(pbytes_[u]) / lb_[u];
    };
    std::sort(idx_.begin(), idx_.end(), [&](int32_t a, int32_t b) { return per_byte(a) > per_byte(b); });
    double room = static_cast<double>(budget_ - bytes);
    for (int32_t j : idx_) {
      const double profit = density_[static_cast<size_t>(j)] * static_cast<double>(pbytes_[static_cast<size_t>(j)]);
      if (lb_[static_cast<size_t>(j)] <= room) {
        room -= lb_[static_cast<size_t>(j)];
        bound += profit;
      } else {
        bound += profit * room / lb_[static_cast<size_t>(j)];
        break;
      }
    }
    return bound;
  }

  // Items before position k are decided (`keep`, `drop`; `bytes` the kept ones' bytes beyond the base).
  void search(int32_t k, uint64_t keep, uint64_t drop, int64_t bytes) {
    const uint64_t undecided = ~(keep | drop) & all_;
    const double certain = weigh(drop, undecided);
    if (certain > best_saved_ + eps_ || (certain >= best_saved_ - eps_ && bytes < best_bytes_)) {
      best_saved_ = certain;
      best_bytes_ = bytes;
      best_mask_ = keep;
    }
    if (k == n_ || upper_bound(certain, undecided, bytes) <= best_saved_ + eps_) return;
    const uint64_t bit = uint64_t{1} << k;
    const bool useful = density_[static_cast<size_t>(k)] > 0;
    const size_t g = static_cast<size_t>(pgroup_[static_cast<size_t>(k)]);
    const int64_t extra = std::max<int64_t>(0, pbytes_[static_cast<size_t>(k)] - group_max_[g]);
    if (useful && bytes + extra <= budget_) {
      const int64_t saved_max = group_max_[g];
      group_max_[g] = std::max(group_max_[g], pbytes_[static_cast<size_t>(k)]);
      search(k + 1, keep | bit, drop, bytes + extra);
      group_max_[g] = saved_max;
    }
    search(k + 1, keep, drop | bit, bytes);
  }

  const Compiled& m_;
  const int64_t budget_;
  const int32_t n_;
  const double eps_;
  const uint64_t all_;  // the n_ bits of the items
  std::vector<int32_t> order_, pos_;
  std::vector<uint64_t> emask_;       // by element: its items
  std::vector<int64_t> pbytes_;       // by position
  std::vector<int32_t> pgroup_;       // by position
  std::vector<uint64_t> group_mask_;  // by storage group: its items
  uint64_t best_mask_ = 0;
  double best_saved_;
  int64_t best_bytes_;
  std::vector<int64_t> group_max_;  // bytes each storage group holds on the current path
  // Scratch of one node, by position.
  std::vector<double> density_;
  std::vector<double> lb_;
  std::vector<int32_t> idx_;
};

// The items of `r` as a problem of their own, every other item fixed as in `fixed` (where the items of r are not
// kept): elements with a dropped fixed item are lost, the others need only their items in r.
Compiled restrict_to(const Compiled& m, const State& fixed, const std::vector<int32_t>& r) {
  Compiled sub;
  std::vector<int32_t> sub_item(static_cast<size_t>(m.n_items()), -1);
  std::vector<int32_t> sub_group(m.group_base.size(), -1);
  for (int32_t i : r) {
    const int32_t g = m.item_group[static_cast<size_t>(i)];
    if (sub_group[static_cast<size_t>(g)] < 0) {
      sub_group[static_cast<size_t>(g)] = static_cast<int32_t>(sub.group_base.size());
      sub.group_base.push_back(fixed.group_max(g));
      sub.group_items.emplace_back();
    }
    sub_item[static_cast<size_t>(i)] = sub.n_items();
    sub.group_items[static_cast<size_t>(sub_group[static_cast<size_t>(g)])].push_back(sub.n_items());
    sub.item_candidate.push_back(i);  // the original item, not a candidate
    sub.item_bytes.push_back(m.item_bytes[static_cast<size_t>(i)]);
    sub.item_group.push_back(sub_group[static_cast<size_t>(g)]);
  }
  for (int32_t e = 0; e < m.n_elements(); ++e) {
    std::vector<int32_t> items;
    bool lost = false;
    for (int32_t i : m.element_items[static_cast<size_t>(e)]) {
      if (sub_item[static_cast<size_t>(i)] >= 0) {
        items.push_back(sub_item[static_cast<size_t>(i)]);
      } else if (!fixed.kept(i)) {
        lost = true;
        break;
      }
    }
    if (lost || items.empty()) continue;
    sub.element_weight.push_back(m.element_weight[static_cast<size_t>(e)]);
    sub.element_items.push_back(std::move(items));
    sub.total_weight += sub.element_weight.back();
  }
  sub.item_elements.resize(static_cast<size_t>(sub.n_items()));
  for (int32_t e = 0; e < sub.n_elements(); ++e) {
    for (int32_t i : sub.element_items[static_cast<size_t>(e)]) sub.item_elements[static_cast<size_t>(i)].push_back(e);
  }
  return sub;
}

}  // namespace

// Note [Exact neighbourhoods]. Large-neighbourhood search: free the `size` items nearest the decision boundary
// (the kept ones that lose least per freed byte, the dropped ones that promise most per byte), keep every other
// item as it is, and solve the freed items exactly (branch and bound). Repeats while it improves; when it does
// not, slides the window of dropped items to the next-ranked ones (once, or with `sweep` until every dropped
// item was in a neighbourhood). This repairs the exchanges of several items for several others that
// single swaps miss (knapsack effects between hull points).
ItemSolution neighbourhood_search(const Compiled& m, int64_t budget, ItemSolution cur, int32_t size, bool sweep) {
  if (size <= 0 || m.n_items() == 0) return cur;
  const double eps = tolerance(m);
  int32_t offset = 0;
  for (int32_t round = 0; round < 2 * m.n_items() && offset < m.n_items(); ++round) {
    State s = state_of(m, cur.kept);
    std::vector<std::pair<double, int32_t>> in, out;
    for (int32_t i = 0; i < m.n_items(); ++i) {
      if (s.kept(i)) {
        // Standalone bytes, not bytes_remove: an item sharing its storage with another kept one frees nothing
        // alone but may well be part of an exchange.
        const int64_t bytes = std::max<int64_t>(1, m.item_bytes[static_cast<size_t>(i)]);
        in.emplace_back(s.loss_remove(i) / static_cast<double>(bytes), i);
      } else {
        double promise = 0;
        for (int32_t e : m.item_elements[static_cast<size_t>(i)]) {
          promise += m.element_weight[static_cast<size_t>(e)] / s.miss(e);
        }
        out.emplace_back(-promise / static_cast<double>(std::max<int64_t>(1, m.item_bytes[static_cast<size_t>(i)])), i);
      }
    }
    std::sort(in.begin(), in.end());
    std::sort(out.begin(), out.end());
    std::vector<int32_t> r;
    const size_t half = static_cast<size_t>(size) / 2;
    const size_t skip = static_cast<size_t>(offset);
    // The cheapest kept items always (an exchange frees bytes there), a sliding window of the dropped ones.
    for (size_t k = 0; k < in.size() && r.size() < half; ++k) r.push_back(in[k].second);
    for (size_t k = skip; k < out.size() && r.size() < static_cast<size_t>(size); ++k) r.push_back(out[k].second);
    for (size_t k = half; k < in.size() && r.size() < static_cast<size_t>(size); ++k) r.push_back(in[k].second);
    if (skip > 0 && skip >= out.size()) break;
    for (int32_t i : r) {
      if (s.kept(i)) s.remove(i);
    }
    const Compiled sub = restrict_to(m, s, r);
    State start(sub);
    for (int32_t k = 0; k < sub.n_items(); ++k) {
      if (cur.kept[static_cast<size_t>(sub.item_candidate[static_cast<size_t>(k)])]) start.add(k);
    }
    const ItemSolution best_sub = exact_solve(sub, budget - s.bytes(), start.solution());
    for (int32_t k = 0; k < sub.n_items(); ++k) {
      if (best_sub.kept[static_cast<size_t>(k)]) s.add(sub.item_candidate[static_cast<size_t>(k)]);
    }
    ItemSolution next = s.solution();
    if (next.bytes <= budget && next.saved > cur.saved + eps) {
      cur = std::move(next);
      offset = 0;
    } else if (static_cast<int32_t>(r.size()) == m.n_items()) {
      break;  // the neighbourhood was everything: cur is optimal
    } else {
      offset += static_cast<int32_t>(half);
      if (!sweep && offset > static_cast<int32_t>(half)) break;
    }
  }
  return cur;
}

ItemSolution improve_neighbourhood(const Compiled& m, int64_t budget, const ItemSolution& start, int32_t size) {
  return neighbourhood_search(m, budget, start, size, /*sweep=*/false);
}

ItemSolution exact_solve(const Compiled& m, int64_t budget, const ItemSolution& incumbent) {
  TAPESAC_INTERNAL_ASSERT(m.n_items() <= 64, "exact_solve supports at most 64 items, got ", m.n_items());
  return BranchAndBound(m, budget, incumbent).solve();
}

}  // namespace tapesac::planner::detail
