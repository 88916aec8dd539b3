// Keep-set selection, the min-cut side (select.h): the vertices of the concave hull of the (bytes, saved) frontier,
// each the exact optimum of a Lagrangian subproblem solved as a minimum cut (Note [Lagrangian points]). The
// heuristic starts from one of them; the frontier takes them all as points and searches between neighbouring ones.
#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "compiled.h"
#include "select_state.h"

namespace tapesac::planner::detail {
namespace {

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

}  // namespace

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

}  // namespace tapesac::planner::detail
