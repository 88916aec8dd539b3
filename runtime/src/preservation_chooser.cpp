// PreservationChooser and pick_preservation (preservation_chooser.h, Note [Preservation choice]).
#include "tapesac/runtime/preservation_chooser.h"

#include <algorithm>
#include <tuple>
#include <unordered_set>

#include "tapesac/common/errors.h"
#include "tapesac/replay/session.h"

namespace tapesac::runtime {

const char* preserve_choice_name(PreserveChoice c) {
  switch (c) {
    case PreserveChoice::kRegions: return "regions";
    case PreserveChoice::kSnapshots: return "snapshots";
    case PreserveChoice::kKeep: return "keep";
  }
  return "?";
}

PreserveChoice parse_preserve_choice(const std::string& name) {
  for (PreserveChoice c : kExploredChoices) {
    if (name == preserve_choice_name(c)) return c;
  }
  TAPESAC_CHECK(false, kConfig, "unknown preservation mode '", name, "'; expected one of ['regions', 'snapshots', "
                "'keep']");
  return PreserveChoice::kRegions;
}

PreservePolicy parse_preserve_policy(const std::string& name) {
  if (name == "off") return PreservePolicy::kOff;
  if (name == "auto") return PreservePolicy::kAuto;
  if (name == "keep") return PreservePolicy::kKeep;
  if (name == "regions") return PreservePolicy::kRegions;
  TAPESAC_CHECK(name == "snapshots", kConfig, "preserve='", name,
                "' is not supported; expected one of ['auto', 'regions', 'snapshots', 'keep', 'off']");
  return PreservePolicy::kSnapshots;
}

PreserveChoice pick_preservation(const std::vector<PreservationTrial>& trials, int64_t limit_bytes) {
  TAPESAC_CHECK(std::any_of(trials.begin(), trials.end(), [](const PreservationTrial& t) { return t.measured; }),
                kConfig, "pick() needs at least one measured trial");
  auto by_peak = [](const PreservationTrial& t) { return std::make_tuple(t.peak_bytes, t.cost_ms); };
  auto by_cost = [](const PreservationTrial& t) { return std::make_tuple(t.cost_ms, t.peak_bytes); };
  // The first of the smallest by `key` (as Python's min()), among the trials `fits` accepts.
  auto first_min = [&](auto key, auto fits) -> const PreservationTrial* {
    const PreservationTrial* best = nullptr;
    for (const PreservationTrial& t : trials) {
      if (t.measured && fits(t) && (best == nullptr || key(t) < key(*best))) best = &t;
    }
    return best;
  };
  if (limit_bytes > 0) {
    const PreservationTrial* fit =
        first_min(by_cost, [&](const PreservationTrial& t) { return t.peak_bytes <= limit_bytes; });
    if (fit != nullptr) return fit->mode;
  }
  return first_min(by_peak, [](const PreservationTrial&) { return true; })->mode;
}

PreservationStep PreservationStep::of(const std::vector<replay::PreservedStorage>& preserved, int64_t replay_ns,
                                      int64_t peak_bytes) {
  PreservationStep s;
  int64_t own_ns = 0;
  for (const replay::PreservedStorage& p : preserved) {
    s.written.push_back(p.key);
    own_ns += p.save_ns + p.restore_ns;
  }
  s.peak_bytes = peak_bytes;
  s.cost_ms = static_cast<double>(replay_ns) * 1e-6 + static_cast<double>(own_ns) / 1e6;
  return s;
}

PreservationBounds PreservationBounds::after(const std::vector<replay::PreservedStorage>& preserved, int64_t peak_bytes,
                                             int64_t dropped_bytes, int64_t keep_all_ceiling) {
  PreservationBounds b;
  int64_t snapshot_extra = 0;  // a whole copy of each storage instead of its saved regions
  for (const replay::PreservedStorage& p : preserved) snapshot_extra += std::max<int64_t>(0, p.nbytes - p.held_bytes);
  b.snapshots_peak = peak_bytes + snapshot_extra;
  b.keep_peak = std::min(peak_bytes + dropped_bytes, keep_all_ceiling);
  return b;
}

bool PreservationChooser::exploring() const {
  return options_.policy == PreservePolicy::kAuto && !chosen_ && !choices_.empty();
}

std::optional<PreserveChoice> PreservationChooser::mode_after(const PreservationStep& step, int64_t limit_bytes,
                                                              const PreservationBounds& bounds) {
  if (options_.policy == PreservePolicy::kKeep) return PreserveChoice::kKeep;
  if (options_.policy != PreservePolicy::kAuto) return std::nullopt;
  if (chosen_) return chosen_;
  if (choices_.empty() && step.written.empty()) return std::nullopt;  // nothing written yet
  trials_.push_back(PreservationTrial{trying_, step.peak_bytes, step.cost_ms});
  for (PreserveChoice c : kExploredChoices) {
    const bool tried =
        std::any_of(trials_.begin(), trials_.end(), [&](const PreservationTrial& t) { return t.mode == c; });
    if (tried) continue;
    const int64_t bound = bounds.of(c);
    if (limit_bytes > 0 && (bound < 0 || bound > limit_bytes)) {  // Note [Trials under a limit]
      trials_.push_back(PreservationTrial{c, bound, 0.0, false});
      continue;
    }
    return trying_ = c;
  }
  return chosen_ = pick_preservation(trials_, limit_bytes);
}

bool PreservationChooser::after_step(const PreservationStep& step, int64_t limit_bytes,
                                     const PreservationBounds& bounds) {
  const std::optional<PreserveChoice> mode = mode_after(step, limit_bytes, bounds);
  if (!mode) return false;
  std::unordered_map<const void*, PreserveChoice> next;
  for (const void* key : step.written) next[key] = *mode;
  for (const auto& [key, _] : choices_) next[key] = *mode;
  if (next == choices_) return false;
  if (next.size() > options_.max_choices) {
    next.clear();
    for (const void* key : step.written) next[key] = *mode;
  }
  choices_ = std::move(next);
  return true;
}

bool PreservationChooser::set_limit(int64_t limit_bytes) {
  if (!chosen_ || trials_.empty()) return false;
  chosen_ = pick_preservation(trials_, limit_bytes);
  for (auto& [key, choice] : choices_) choice = *chosen_;
  return true;
}

void PreservationChooser::apply(replay::Session& session) const {
  std::unordered_map<const void*, replay::PreserveMode> modes;
  std::unordered_set<const void*> keep;
  for (const auto& [key, choice] : choices_) {
    if (choice == PreserveChoice::kKeep) {
      keep.insert(key);
    } else {
      modes[key] = choice == PreserveChoice::kRegions ? replay::PreserveMode::kRegions
                                                      : replay::PreserveMode::kSnapshots;
    }
  }
  session.set_preservation(std::move(modes), std::move(keep));
}

}  // namespace tapesac::runtime
