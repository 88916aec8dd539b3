// Keep-set selection for one block (select.h): greedy constructions + local search, and branch and bound.
//
// Note [Set form]. After compile(), keeping a set K of items saves the weight of the elements whose items are all
// in K. A single item often saves nothing alone (an expensive op feeding two saved values is needed as long as
// either is dropped), so the greedy and the local search also move whole "completion sets": the items of one
// element that are not kept yet. Dropping, priced by the weight it alone brings back, is the dual view; the drop
// chain (drop the cheapest per freed byte until nothing is kept) gives a second start and the frontier's seeds.
#include "tapesac/planner/select.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "compiled.h"
#include "tapesac/capture/errors.h"
#include "tapesac/planner/evaluate.h"

namespace tapesac::planner {
namespace detail {
namespace {

double tolerance(const Compiled& m) { return 1e-9 * m.total_weight + 1e-12; }

// Incremental view of one choice of kept items: bytes beyond the base and saved weight.
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

// A move keeps a set of items that are not kept: one item, or the completion set of an element.
struct Move {
  std::vector<int32_t> items;
  double gain = 0;
  int64_t bytes = 0;
};

// Gain and bytes of keeping `items` on top of `s` (s is restored).
void price(State& s, Move& move) {
  const double saved0 = s.saved();
  const int64_t bytes0 = s.bytes();
  for (int32_t i : move.items) s.add(i);
  move.gain = s.saved() - saved0;
  move.bytes = s.bytes() - bytes0;
  for (auto it = move.items.rbegin(); it != move.items.rend(); ++it) s.remove(*it);
}

// All moves with positive gain from state s; `banned` items are never added.
std::vector<Move> moves(const Compiled& m, State& s, const std::vector<uint8_t>& banned, double eps) {
  std::vector<Move> out;
  for (int32_t i = 0; i < m.n_items(); ++i) {
    if (s.kept(i) || banned[static_cast<size_t>(i)]) continue;
    const double gain = s.gain_add(i);
    if (gain <= eps) continue;
    out.push_back(Move{{i}, gain, s.bytes_add(i)});
  }
  for (int32_t e = 0; e < m.n_elements(); ++e) {
    if (s.miss(e) < 2) continue;
    Move mv;
    bool ok = true;
    for (int32_t i : m.element_items[static_cast<size_t>(e)]) {
      if (s.kept(i)) continue;
      if (banned[static_cast<size_t>(i)]) {
        ok = false;
        break;
      }
      mv.items.push_back(i);
    }
    if (!ok) continue;
    price(s, mv);
    if (mv.gain > eps) out.push_back(std::move(mv));
  }
  return out;
}

// True when move a is the better greedy step: gain / bytes^alpha, then gain. alpha = 1 is the classic ratio
// greedy; smaller alphas favour large valuable moves, the knapsack case the ratio greedy gets wrong.
bool better_ratio(const Move& a, const Move& b, double alpha) {
  if (a.bytes == 0 || b.bytes == 0) {
    if ((a.bytes == 0) != (b.bytes == 0)) return a.bytes == 0;
    return a.gain > b.gain;
  }
  // Compared without dividing: a.gain * b.bytes^alpha vs b.gain * a.bytes^alpha.
  const double lhs = alpha == 1 ? a.gain * static_cast<double>(b.bytes)
                                : a.gain * std::pow(static_cast<double>(b.bytes), alpha);
  const double rhs = alpha == 1 ? b.gain * static_cast<double>(a.bytes)
                                : b.gain * std::pow(static_cast<double>(a.bytes), alpha);
  if (lhs != rhs) return lhs > rhs;
  return a.gain > b.gain;
}

// Greedy: keep the best move (better_ratio) that fits, until none with positive gain fits. Returns the items added.
std::vector<int32_t> fill(const Compiled& m, State& s, int64_t budget, const std::vector<uint8_t>& banned,
                          double alpha = 1) {
  const double eps = tolerance(m);
  std::vector<int32_t> added;
  while (true) {
    std::vector<Move> all = moves(m, s, banned, eps);
    const Move* best = nullptr;
    for (const Move& mv : all) {
      if (s.bytes() + mv.bytes > budget) continue;
      if (best == nullptr || better_ratio(mv, *best, alpha)) best = &mv;
    }
    if (best == nullptr) break;
    for (int32_t i : best->items) {
      s.add(i);
      added.push_back(i);
    }
  }
  return added;
}

// Local search: best improving swap (remove one kept item, apply one move), else the first improving
// drop-and-refill; until a round improves nothing.
// Removes kept items (never a banned one), each time the one losing the least saving per freed byte, until the
// state fits `budget`. Returns false when nothing removable is left before it fits.
bool trim_to_budget(const Compiled& m, State& s, int64_t budget, const std::vector<uint8_t>& banned) {
  while (s.bytes() > budget) {
    int32_t out = -1;
    double out_loss = 0;
    int64_t out_freed = 0;
    for (int32_t i = 0; i < m.n_items(); ++i) {
      if (!s.kept(i) || banned[static_cast<size_t>(i)]) continue;
      const int64_t freed = s.bytes_remove(i);
      if (freed <= 0) continue;
      const double loss = s.loss_remove(i);
      if (out < 0 || loss * static_cast<double>(out_freed) < out_loss * static_cast<double>(freed)) {
        out = i;
        out_loss = loss;
        out_freed = freed;
      }
    }
    if (out < 0) return false;
    s.remove(out);
  }
  return true;
}

void improve(const Compiled& m, State& s, int64_t budget, int32_t rounds) {
  const double eps = tolerance(m);
  std::vector<uint8_t> banned(static_cast<size_t>(m.n_items()), 0);
  for (int32_t round = 0; round < rounds; ++round) {
    const double saved0 = s.saved();
    const std::vector<Move> all = moves(m, s, banned, eps);
    double best_delta = eps;
    int32_t best_out = -1;
    const Move* best_in = nullptr;
    for (int32_t i = 0; i < m.n_items(); ++i) {
      if (!s.kept(i)) continue;
      const double loss = s.loss_remove(i);
      const int64_t freed = s.bytes_remove(i);
      const bool alone = m.group_items[static_cast<size_t>(m.item_group[static_cast<size_t>(i)])].size() == 1;
      for (const Move& mv : all) {
        // Removing i can only lower a move's gain (i is not in it), and without storage sharing the bytes add up.
        if (mv.gain - loss <= best_delta) continue;
        if (alone && s.bytes() - freed + mv.bytes > budget) continue;
        s.remove(i);
        for (int32_t j : mv.items) s.add(j);
        const double delta = s.saved() - saved0;
        const bool fits = s.bytes() <= budget;
        for (auto it = mv.items.rbegin(); it != mv.items.rend(); ++it) s.remove(*it);
        s.add(i);
        if (fits && delta > best_delta) {
          best_delta = delta;
          best_out = i;
          best_in = &mv;
        }
      }
    }
    if (best_in != nullptr) {
      s.remove(best_out);
      for (int32_t j : best_in->items) s.add(j);
      fill(m, s, budget, banned);
      continue;
    }
    // Add-and-repair: keep a move that does not fit, drop the cheapest kept items per freed byte until it does,
    // refill. This is the knapsack step a ratio greedy misses (one large valuable item instead of several small).
    bool improved = false;
    const std::vector<uint8_t> snapshot = s.kept_items();
    for (const Move& mv : all) {
      if (s.bytes() + mv.bytes <= budget) continue;
      for (int32_t j : mv.items) s.add(j);
      for (int32_t j : mv.items) banned[static_cast<size_t>(j)] = 1;  // protected from removal below
      const bool fits = trim_to_budget(m, s, budget, banned);
      for (int32_t j : mv.items) banned[static_cast<size_t>(j)] = 0;
      if (fits) fill(m, s, budget, banned);
      if (fits && s.saved() > saved0 + eps) {
        improved = true;
        break;
      }
      s.reset_to(snapshot);
    }
    if (improved) continue;
    for (int32_t i = 0; i < m.n_items() && !improved; ++i) {
      if (!s.kept(i)) continue;
      s.remove(i);
      banned[static_cast<size_t>(i)] = 1;
      const std::vector<int32_t> added = fill(m, s, budget, banned);
      banned[static_cast<size_t>(i)] = 0;
      if (s.saved() > saved0 + eps) {
        improved = true;
        break;
      }
      for (auto it = added.rbegin(); it != added.rend(); ++it) s.remove(*it);
      s.add(i);
    }
    if (!improved) break;
  }
}

// Max-flow (Dinic) on real capacities, for the Lagrangian subproblem below.
class MaxFlow {
 public:
  explicit MaxFlow(int32_t n)
      : adj_(static_cast<size_t>(n)), level_(static_cast<size_t>(n)), next_(static_cast<size_t>(n)) {}

  void add_edge(int32_t u, int32_t v, double cap) {
    adj_[static_cast<size_t>(u)].push_back(static_cast<int32_t>(edges_.size()));
    edges_.push_back(Edge{v, cap});
    adj_[static_cast<size_t>(v)].push_back(static_cast<int32_t>(edges_.size()));
    edges_.push_back(Edge{u, 0});
  }

  void run(int32_t s, int32_t t, double tiny) {
    tiny_ = tiny;
    while (levels(s, t)) {
      std::fill(next_.begin(), next_.end(), 0);
      while (push(s, t, std::numeric_limits<double>::infinity()) > tiny_) {
      }
    }
  }

  /// After run(): 1 for the nodes reachable from s in the residual graph (the source side of a minimum cut).
  std::vector<uint8_t> source_side(int32_t s) const {
    std::vector<uint8_t> seen(adj_.size(), 0);
    std::vector<int32_t> stack{s};
    seen[static_cast<size_t>(s)] = 1;
    while (!stack.empty()) {
      const int32_t u = stack.back();
      stack.pop_back();
      for (int32_t e : adj_[static_cast<size_t>(u)]) {
        const Edge& ed = edges_[static_cast<size_t>(e)];
        if (ed.cap > tiny_ && !seen[static_cast<size_t>(ed.to)]) {
          seen[static_cast<size_t>(ed.to)] = 1;
          stack.push_back(ed.to);
        }
      }
    }
    return seen;
  }

 private:
  struct Edge {
    int32_t to;
    double cap;
  };

  bool levels(int32_t s, int32_t t) {
    std::fill(level_.begin(), level_.end(), -1);
    std::vector<int32_t> queue{s};
    level_[static_cast<size_t>(s)] = 0;
    for (size_t h = 0; h < queue.size(); ++h) {
      const int32_t u = queue[h];
      for (int32_t e : adj_[static_cast<size_t>(u)]) {
        const Edge& ed = edges_[static_cast<size_t>(e)];
        if (ed.cap > tiny_ && level_[static_cast<size_t>(ed.to)] < 0) {
          level_[static_cast<size_t>(ed.to)] = level_[static_cast<size_t>(u)] + 1;
          queue.push_back(ed.to);
        }
      }
    }
    return level_[static_cast<size_t>(t)] >= 0;
  }

  double push(int32_t u, int32_t t, double limit) {
    if (u == t) return limit;
    auto& out = adj_[static_cast<size_t>(u)];
    for (int32_t& k = next_[static_cast<size_t>(u)]; k < static_cast<int32_t>(out.size()); ++k) {
      Edge& ed = edges_[static_cast<size_t>(out[static_cast<size_t>(k)])];
      if (ed.cap <= tiny_ || level_[static_cast<size_t>(ed.to)] != level_[static_cast<size_t>(u)] + 1) continue;
      const double got = push(ed.to, t, std::min(limit, ed.cap));
      if (got > tiny_) {
        ed.cap -= got;
        edges_[static_cast<size_t>(out[static_cast<size_t>(k)] ^ 1)].cap += got;
        return got;
      }
    }
    return 0;
  }

  std::vector<Edge> edges_;
  std::vector<std::vector<int32_t>> adj_;
  std::vector<int32_t> level_;
  std::vector<int32_t> next_;
  double tiny_ = 0;
};

// Note [Lagrangian points]. For a price lambda per byte, maximizing saved(K) - lambda * bytes(K) is a
// project-selection problem (elements are projects that need all their items), solved exactly by a minimum cut:
// source -> element (weight), element -> its items (infinite), item -> sink (lambda * bytes). Its solutions are
// the vertices of the concave hull of the (bytes, saved) frontier, each optimal for its own bytes. Storage
// sharing is ignored here (each item priced at its bytes beyond the base); State recomputes the real bytes.
std::vector<uint8_t> lagrangian_keep(const Compiled& m, double lambda) {
  const int32_t n_e = m.n_elements();
  const int32_t s = 0, t = 1;
  MaxFlow flow(2 + n_e + m.n_items());
  const double inf = 2 * m.total_weight + 1;
  for (int32_t e = 0; e < n_e; ++e) {
    flow.add_edge(s, 2 + e, m.element_weight[static_cast<size_t>(e)]);
    for (int32_t i : m.element_items[static_cast<size_t>(e)]) flow.add_edge(2 + e, 2 + n_e + i, inf);
  }
  for (int32_t i = 0; i < m.n_items(); ++i) {
    const size_t g = static_cast<size_t>(m.item_group[static_cast<size_t>(i)]);
    const int64_t extra = m.item_bytes[static_cast<size_t>(i)] - m.group_base[g];
    flow.add_edge(2 + n_e + i, t, lambda * static_cast<double>(extra));
  }
  flow.run(s, t, 1e-12 * (m.total_weight + 1));
  const std::vector<uint8_t> side = flow.source_side(s);
  return std::vector<uint8_t>(side.begin() + 2 + n_e, side.end());
}

// Exponents of the greedy starts (better_ratio).
constexpr double kGreedyAlphas[] = {1.0, 0.5, 0.0};

State state_of(const Compiled& m, const std::vector<uint8_t>& kept) {
  State s(m);
  for (int32_t i = 0; i < m.n_items(); ++i) {
    if (kept[static_cast<size_t>(i)]) s.add(i);
  }
  return s;
}

}  // namespace

std::vector<ItemSolution> drop_chain(const Compiled& m) {
  State s(m);
  for (int32_t i = 0; i < m.n_items(); ++i) s.add(i);
  std::vector<ItemSolution> chain{s.solution()};
  for (int32_t step = 0; step < m.n_items(); ++step) {
    int32_t best = -1;
    double best_loss = 0;
    int64_t best_freed = 0;
    for (int32_t i = 0; i < m.n_items(); ++i) {
      if (!s.kept(i)) continue;
      const double loss = s.loss_remove(i);
      const int64_t freed = s.bytes_remove(i);
      // loss / freed < best_loss / best_freed, then more bytes freed.
      const double lhs = loss * static_cast<double>(best_freed);
      const double rhs = best_loss * static_cast<double>(freed);
      if (best < 0 || lhs < rhs || (lhs == rhs && freed > best_freed)) {
        best = i;
        best_loss = loss;
        best_freed = freed;
      }
    }
    s.remove(best);
    chain.push_back(s.solution());
  }
  return chain;
}

std::vector<ItemSolution> lagrangian_hull(const Compiled& m) {
  const double eps = tolerance(m);
  std::vector<uint8_t> all(static_cast<size_t>(m.n_items()), 1);
  std::vector<ItemSolution> hull{State(m).solution(), state_of(m, all).solution()};
  // Eisner-Severance: between two hull points, price bytes at the slope of their chord; a solution strictly above
  // the chord is a new vertex between them.
  std::vector<std::pair<ItemSolution, ItemSolution>> todo{{hull[0], hull[1]}};
  while (!todo.empty() && hull.size() < 4 * static_cast<size_t>(m.n_items()) + 2) {
    auto [lo, hi] = std::move(todo.back());
    todo.pop_back();
    if (hi.bytes <= lo.bytes) continue;
    const double lambda = (hi.saved - lo.saved) / static_cast<double>(hi.bytes - lo.bytes);
    ItemSolution mid = state_of(m, lagrangian_keep(m, lambda)).solution();
    const double line = lo.saved + lambda * static_cast<double>(mid.bytes - lo.bytes);
    if (mid.saved <= line + eps || mid.bytes <= lo.bytes || mid.bytes >= hi.bytes) continue;
    hull.push_back(mid);
    todo.emplace_back(lo, mid);
    todo.emplace_back(std::move(mid), std::move(hi));
  }
  std::sort(hull.begin(), hull.end(), [](const ItemSolution& a, const ItemSolution& b) { return a.bytes < b.bytes; });
  return hull;
}

namespace {

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

}  // namespace

ItemSolution improve_neighbourhood(const Compiled& m, int64_t budget, const ItemSolution& start, int32_t size) {
  return neighbourhood_search(m, budget, start, size, /*sweep=*/false);
}

ItemSolution fill_from(const Compiled& m, const ItemSolution& start, int64_t budget, int32_t neighbourhood) {
  State s = state_of(m, start.kept);
  fill(m, s, budget, std::vector<uint8_t>(static_cast<size_t>(m.n_items()), 0));
  return neighbourhood_search(m, budget, s.solution(), neighbourhood, /*sweep=*/false);
}

ItemSolution trim_from(const Compiled& m, const ItemSolution& start, int64_t budget, int32_t neighbourhood) {
  State s = state_of(m, start.kept);
  const std::vector<uint8_t> none(static_cast<size_t>(m.n_items()), 0);
  trim_to_budget(m, s, budget, none);
  fill(m, s, budget, none);
  return neighbourhood_search(m, budget, s.solution(), neighbourhood, /*sweep=*/false);
}

ItemSolution heuristic_solve(const Compiled& m, int64_t budget, const HeuristicOptions& options,
                             const std::vector<ItemSolution>* chain, const std::vector<ItemSolution>* hull) {
  const int32_t max_improve_rounds = options.max_improve_rounds;
  const std::vector<uint8_t> none(static_cast<size_t>(m.n_items()), 0);
  ItemSolution best;
  bool have = false;
  for (double alpha : kGreedyAlphas) {
    State from_empty(m);
    fill(m, from_empty, budget, none, alpha);
    improve(m, from_empty, budget, max_improve_rounds);
    ItemSolution sol = from_empty.solution();
    if (!have || sol.saved > best.saved || (sol.saved == best.saved && sol.bytes < best.bytes)) best = std::move(sol);
    have = true;
  }

  // Second start: the first state of the drop chain that fits, refilled.
  std::vector<ItemSolution> own_chain;
  if (chain == nullptr) {
    own_chain = drop_chain(m);
    chain = &own_chain;
  }
  // Third start: the largest Lagrangian hull point that fits, refilled.
  std::vector<ItemSolution> own_hull;
  if (hull == nullptr) {
    own_hull = lagrangian_hull(m);
    hull = &own_hull;
  }
  for (auto it = hull->rbegin(); it != hull->rend(); ++it) {
    if (it->bytes > budget) continue;
    State from_hull = state_of(m, it->kept);
    fill(m, from_hull, budget, none);
    improve(m, from_hull, budget, max_improve_rounds);
    ItemSolution sol = from_hull.solution();
    if (sol.saved > best.saved || (sol.saved == best.saved && sol.bytes < best.bytes)) best = std::move(sol);
    break;
  }
  for (const ItemSolution& c : *chain) {
    if (c.bytes > budget) continue;
    State from_chain = state_of(m, c.kept);
    fill(m, from_chain, budget, none);
    improve(m, from_chain, budget, max_improve_rounds);
    ItemSolution sol = from_chain.solution();
    if (sol.saved > best.saved || (sol.saved == best.saved && sol.bytes < best.bytes)) best = std::move(sol);
    break;
  }
  return neighbourhood_search(m, budget, std::move(best), options.neighbourhood, /*sweep=*/true);
}

ItemSolution exact_solve(const Compiled& m, int64_t budget, const ItemSolution& incumbent) {
  const int32_t n = m.n_items();
  TAPESAC_INTERNAL_ASSERT(n <= 64, "exact_solve supports at most 64 items, got ", n);
  const double eps = tolerance(m);
  // Items in order of decreasing potential (weight shared evenly among an element's items, per byte): good
  // solutions come first, which tightens the bound early.
  std::vector<double> potential(static_cast<size_t>(n), 0);
  for (int32_t e = 0; e < m.n_elements(); ++e) {
    const auto& items = m.element_items[static_cast<size_t>(e)];
    for (int32_t i : items) {
      potential[static_cast<size_t>(i)] +=
          m.element_weight[static_cast<size_t>(e)] / static_cast<double>(items.size());
    }
  }
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return potential[static_cast<size_t>(a)] / static_cast<double>(m.item_bytes[static_cast<size_t>(a)]) >
           potential[static_cast<size_t>(b)] / static_cast<double>(m.item_bytes[static_cast<size_t>(b)]);
  });
  // Position space: bit k is item order[k].
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int32_t k = 0; k < n; ++k) pos[static_cast<size_t>(order[static_cast<size_t>(k)])] = k;
  std::vector<uint64_t> emask(static_cast<size_t>(m.n_elements()), 0);
  for (int32_t e = 0; e < m.n_elements(); ++e) {
    for (int32_t i : m.element_items[static_cast<size_t>(e)]) {
      emask[static_cast<size_t>(e)] |= uint64_t{1} << pos[static_cast<size_t>(i)];
    }
  }
  std::vector<int64_t> pbytes(static_cast<size_t>(n));
  std::vector<int32_t> pgroup(static_cast<size_t>(n));
  for (int32_t k = 0; k < n; ++k) {
    pbytes[static_cast<size_t>(k)] = m.item_bytes[static_cast<size_t>(order[static_cast<size_t>(k)])];
    pgroup[static_cast<size_t>(k)] = m.item_group[static_cast<size_t>(order[static_cast<size_t>(k)])];
  }
  std::vector<uint64_t> group_mask(m.group_base.size(), 0);
  for (int32_t k = 0; k < n; ++k) group_mask[static_cast<size_t>(pgroup[static_cast<size_t>(k)])] |= uint64_t{1} << k;


  uint64_t best_mask = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (incumbent.kept[static_cast<size_t>(i)]) best_mask |= uint64_t{1} << pos[static_cast<size_t>(i)];
  }
  double best_saved = incumbent.saved;
  int64_t best_bytes = incumbent.bytes;
  std::vector<int64_t> group_max = m.group_base;

  std::vector<double> density(static_cast<size_t>(n));
  std::vector<int32_t> idx;
  idx.reserve(static_cast<size_t>(n));
  std::vector<double> lb(static_cast<size_t>(n));

  // Iterative DFS would be longer; depth <= 64 keeps the recursion shallow.
  auto dfs = [&](auto&& self, int32_t k, uint64_t keep, uint64_t drop, int64_t bytes) -> void {
    double certain = 0;
    const uint64_t undecided = ~(keep | drop) & (n == 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1));
    std::fill(density.begin(), density.end(), 0.0);
    for (size_t e = 0; e < emask.size(); ++e) {
      const uint64_t s = emask[e];
      if (s & drop) continue;
      const uint64_t open = s & undecided;
      if (open == 0) {
        certain += m.element_weight[e];
        continue;
      }
      double bsum = 0;
      for (uint64_t r = open; r; r &= r - 1) {
        bsum += static_cast<double>(pbytes[static_cast<size_t>(__builtin_ctzll(r))]);
      }
      const double d = m.element_weight[e] / bsum;
      for (uint64_t r = open; r; r &= r - 1) density[static_cast<size_t>(__builtin_ctzll(r))] += d;
    }
    if (certain > best_saved + eps || (certain >= best_saved - eps && bytes < best_bytes)) {
      best_saved = certain;
      best_bytes = bytes;
      best_mask = keep;
    }
    if (k == n) return;
    // Upper bound: fractional knapsack over undecided items, each carrying its shares of the open elements;
    // a shared storage's extra bytes are split evenly among its undecided items (a lower bound on each).
    idx.clear();
    double bound = certain;
    for (uint64_t r = undecided; r; r &= r - 1) {
      const int32_t j = __builtin_ctzll(r);
      if (density[static_cast<size_t>(j)] <= 0) continue;
      const size_t g = static_cast<size_t>(pgroup[static_cast<size_t>(j)]);
      const int64_t extra = std::max<int64_t>(0, pbytes[static_cast<size_t>(j)] - group_max[g]);
      const int32_t open_in_group = __builtin_popcountll(group_mask[g] & undecided);
      lb[static_cast<size_t>(j)] = static_cast<double>(extra) / open_in_group;
      if (lb[static_cast<size_t>(j)] <= 0) {
        bound += density[static_cast<size_t>(j)] * static_cast<double>(pbytes[static_cast<size_t>(j)]);
      } else {
        idx.push_back(j);
      }
    }
    auto per_byte = [&](int32_t j) {
      const size_t u = static_cast<size_t>(j);
      return density[u] * static_cast<double>(pbytes[u]) / lb[u];
    };
    std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return per_byte(a) > per_byte(b); });
    double room = static_cast<double>(budget - bytes);
    for (int32_t j : idx) {
      const double profit = density[static_cast<size_t>(j)] * static_cast<double>(pbytes[static_cast<size_t>(j)]);
      if (lb[static_cast<size_t>(j)] <= room) {
        room -= lb[static_cast<size_t>(j)];
        bound += profit;
      } else {
        bound += profit * room / lb[static_cast<size_t>(j)];
        break;
      }
    }
    if (bound <= best_saved + eps) return;

    const uint64_t bit = uint64_t{1} << k;
    const bool useful = density[static_cast<size_t>(k)] > 0;
    const size_t g = static_cast<size_t>(pgroup[static_cast<size_t>(k)]);
    const int64_t extra = std::max<int64_t>(0, pbytes[static_cast<size_t>(k)] - group_max[g]);
    if (useful && bytes + extra <= budget) {
      const int64_t saved_max = group_max[g];
      group_max[g] = std::max(group_max[g], pbytes[static_cast<size_t>(k)]);
      self(self, k + 1, keep | bit, drop, bytes + extra);
      group_max[g] = saved_max;
    }
    self(self, k + 1, keep, drop | bit, bytes);
  };
  dfs(dfs, 0, 0, 0, 0);

  State s(m);
  for (int32_t k = 0; k < n; ++k) {
    if (best_mask & (uint64_t{1} << k)) s.add(order[static_cast<size_t>(k)]);
  }
  return s.solution();
}

}  // namespace detail

namespace {

Selection to_selection(const BlockProblem& problem, const detail::Compiled& m, const detail::ItemSolution& sol,
                       bool feasible) {
  Selection out;
  out.feasible = feasible;
  out.keep = m.mask(sol.kept);
  out.kept_bytes = kept_bytes(problem, out.keep);
  out.replay_cost_ns = replay_cost_ns(problem, out.keep);
  return out;
}

}  // namespace

Selection select_heuristic(const BlockProblem& problem, int64_t budget_bytes, const HeuristicOptions& options) {
  validate_problem(problem);
  const detail::Compiled m = detail::compile(problem);
  if (budget_bytes < m.base_bytes) {
    return to_selection(problem, m, detail::ItemSolution{std::vector<uint8_t>(static_cast<size_t>(m.n_items()), 0)},
                        false);
  }
  return to_selection(problem, m, detail::heuristic_solve(m, budget_bytes - m.base_bytes, options),
                      true);
}

Selection select_exact(const BlockProblem& problem, int64_t budget_bytes, const ExactOptions& options) {
  validate_problem(problem);
  const detail::Compiled m = detail::compile(problem);
  const int32_t limit = std::min<int32_t>(options.max_candidates, 64);
  TAPESAC_CHECK(m.n_items() <= limit, kConfig, "select_exact: '", problem.signature, "' has ", m.n_items(),
                " candidates to decide, the exact solver accepts at most ", limit,
                " (ExactOptions::max_candidates, <= 64); use select_heuristic");
  if (budget_bytes < m.base_bytes) {
    return to_selection(problem, m, detail::ItemSolution{std::vector<uint8_t>(static_cast<size_t>(m.n_items()), 0)},
                        false);
  }
  const int64_t budget = budget_bytes - m.base_bytes;
  HeuristicOptions quick;
  quick.max_improve_rounds = 0;
  quick.neighbourhood = 0;
  const detail::ItemSolution start = detail::heuristic_solve(m, budget, quick);
  return to_selection(problem, m, detail::exact_solve(m, budget, start), true);
}

}  // namespace tapesac::planner
