// Keep-set selection, the heuristic side (select.h): greedy constructions (closure-aware moves), local search
// (swaps, add-and-repair, drop-and-refill), the drop chain, and heuristic_solve, which runs them from several starts
// (empty, a Lagrangian hull point, a drop-chain state) and ends with the exact-neighbourhood search
// (select_exact.cpp).
//
// Note [Set form]. After compile(), keeping a set K of items saves the weight of the elements whose items are all
// in K. A single item often saves nothing alone (an expensive op feeding two saved values is needed as long as
// either is dropped), so the greedy and the local search also move whole "completion sets": the items of one
// element that are not kept yet. Dropping, priced by the weight it alone brings back, is the dual view; the drop
// chain (drop the cheapest per freed byte until nothing is kept) gives a second start and the frontier's seeds.
#include <algorithm>
#include <cmath>
#include <vector>

#include "compiled.h"
#include "select_state.h"

namespace tapesac::planner::detail {
namespace {

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

// Local search: the best improving swap (remove one kept item, apply one move), else the first improving
// add-and-repair, else the first improving drop-and-refill; until a round improves nothing or `rounds` are done.
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

// Exponents of the greedy starts (better_ratio).
constexpr double kGreedyAlphas[] = {1.0, 0.5, 0.0};

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

}  // namespace tapesac::planner::detail
