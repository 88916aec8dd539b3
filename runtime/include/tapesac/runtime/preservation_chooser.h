// PreservationChooser: how a step's replays see the external tensors the step writes in place after a block's
// forward read them (replay/preserve.h), chosen per written storage between steps.
//
// Note [Preservation choice]. Three exact ways exist (README: "Replay contracts"):
//   * regions: save the overwritten region's old bytes just before each write, rebuild a private copy per replay
//     (held: the regions; during a replay also one copy of the storage);
//   * snapshots: copy the whole storage at its first write; replays read the copy (held: the storage's size, from
//     the first write to the step's end);
//   * keep: keep the activations whose replay would read it (held: their bytes; no replay of them).
// Which is best depends on where the step's peak falls and on how the writes are spread, which a model of the step
// cannot see well (a region rebuild allocates a copy of the storage during each replay; whether that copy sits at
// the peak depends on the backward's schedule). So preserve="auto" measures instead: the steps after the first such
// write run regions, snapshots and keep in turn (each exact; the limit is not enforced on them, Runtime; under a
// limit only the modes bounded within it, Note [Trials under a limit]), and pick_preservation() chooses from their
// measured peaks and costs; the choice then applies to every storage found
// later, and is made again from the same trials when the limit changes. preserve="keep" keeps the dependents of
// every written storage from the next step on. Choices persist: a storage whose dependents are kept is no longer
// read by replays, so it no longer shows up as written. At most PreservationChooserOptions::max_choices storages
// are remembered (beyond it, only the last step's).
//
// Pure logic on figures (apply() hands the choices to a Session): not thread-safe; used between steps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tapesac/replay/preserve.h"

namespace tapesac::replay {
class Session;
}  // namespace tapesac::replay

namespace tapesac::runtime {

/// How one written storage is preserved.
enum class PreserveChoice : uint8_t { kRegions, kSnapshots, kKeep };

/// "regions", "snapshots", "keep".
const char* preserve_choice_name(PreserveChoice c);
/// The inverse of preserve_choice_name. Throws tapesac::Error (kConfig) listing the names otherwise.
PreserveChoice parse_preserve_choice(const std::string& name);

/// The modes preserve="auto" tries, in order.
inline constexpr PreserveChoice kExploredChoices[] = {PreserveChoice::kRegions, PreserveChoice::kSnapshots,
                                                      PreserveChoice::kKeep};

/// One measured step under one preservation mode, or one mode left untried under a limit (`measured` false: its
/// `peak_bytes` is the bound that did not fit, -1 when there was none; Note [Trials under a limit]).
struct PreservationTrial {
  PreserveChoice mode = PreserveChoice::kRegions;
  int64_t peak_bytes = 0;
  double cost_ms = 0;  ///< replay time plus the preservation's own saving and rebuilding time
  bool measured = true;
};

/// The mode to keep: without a limit (`limit_bytes` <= 0) the lowest measured peak (ties: the cheapest); with one,
/// the cheapest of the modes whose measured peak stays under it (ties: the lower peak), else the lowest peak.
/// Untried modes (`measured` false) are never chosen. Throws tapesac::Error (kConfig) without a measured trial.
PreserveChoice pick_preservation(const std::vector<PreservationTrial>& trials, int64_t limit_bytes);

/// The TapeSAC(preserve=...) setting the chooser serves ("off" also when the contract is off).
enum class PreservePolicy : uint8_t { kOff, kRegions, kSnapshots, kKeep, kAuto };
/// "off", "regions", "snapshots", "keep", "auto". Throws tapesac::Error (kConfig) listing them otherwise.
PreservePolicy parse_preserve_policy(const std::string& name);

struct PreservationChooserOptions {
  PreservePolicy policy = PreservePolicy::kAuto;
  /// Storages whose choice is remembered (Note [Preservation choice]).
  size_t max_choices = 1024;
};

/// What one finished step tells the chooser.
struct PreservationStep {
  std::vector<const void*> written;  ///< storages written after a block read them (PreservedStorage::key)
  int64_t peak_bytes = 0;            ///< the step's measured peak
  double cost_ms = 0;                ///< replay time plus the preservation's saving and rebuilding time

  /// The figures of a step from its preserved storages and its total replay time (ns).
  static PreservationStep of(const std::vector<replay::PreservedStorage>& preserved, int64_t replay_ns,
                             int64_t peak_bytes);
};

/// Note [Trials under a limit]. A trial step runs its mode for real, so under a memory limit a mode that might not
/// fit is not tried: it would be a step over the limit (random program 2926: snapshots peaked 16.4% over). After
/// each step the runtime bounds the peak each remaining mode would have from that step's figures: snapshots hold at
/// most each written storage's size instead of its saved regions from the first write on (the step's peak plus
/// the sum of nbytes - held_bytes); keep holds the activations whose replays read the storage, at most every value
/// the step dropped (its peak plus its dropped bytes, or auto's keep-everything ceiling when that is lower). A mode
/// whose bound is over the limit, or unknown (-1), is recorded as untried (PreservationTrial::measured false) and
/// skipped. Without a limit every mode is tried.
struct PreservationBounds {
  int64_t snapshots_peak = -1;
  int64_t keep_peak = -1;
  int64_t of(PreserveChoice c) const {
    return c == PreserveChoice::kSnapshots ? snapshots_peak : c == PreserveChoice::kKeep ? keep_peak : 0;
  }
  /// The bounds after a step that peaked at `peak_bytes`, preserved `preserved` and dropped `dropped_bytes`;
  /// `keep_all_ceiling` (INT64_MAX: none) caps the keep bound.
  static PreservationBounds after(const std::vector<replay::PreservedStorage>& preserved, int64_t peak_bytes,
                                  int64_t dropped_bytes, int64_t keep_all_ceiling);
};

/// The per-storage preservation choices of one TapeSAC (Note [Preservation choice]).
class PreservationChooser {
 public:
  explicit PreservationChooser(PreservationChooserOptions options = {}) : options_(options) {}

  /// preserve="auto" is measuring its trials (the next step is one): the step runs without the memory limit, so
  /// that a mode over the limit is measured and not chosen rather than failing the step.
  bool exploring() const;
  /// After a step: records a trial (preserve="auto") and updates the choices. Returns true when they changed (hand
  /// them to the session with apply()). `bounds`: the peaks the modes not tried yet would at most have on the next
  /// step (Note [Trials under a limit]); under a limit a mode not known to fit is skipped.
  bool after_step(const PreservationStep& step, int64_t limit_bytes, const PreservationBounds& bounds = {});
  /// A new limit: preserve="auto" chooses again from its trials. Returns true when it did (apply() the choices).
  bool set_limit(int64_t limit_bytes);
  /// Hands the choices to the session (Session::set_preservation): regions/snapshots per storage, and the storages
  /// whose dependents are kept.
  void apply(replay::Session& session) const;

  const std::unordered_map<const void*, PreserveChoice>& choices() const { return choices_; }
  const std::vector<PreservationTrial>& trials() const { return trials_; }
  /// preserve="auto": the mode chosen after the trials (nullopt while measuring).
  std::optional<PreserveChoice> chosen() const { return chosen_; }
  const PreservationChooserOptions& options() const { return options_; }

 private:
  /// The mode for this step's storages, or nullopt when nothing is to be chosen.
  std::optional<PreserveChoice> mode_after(const PreservationStep& step, int64_t limit_bytes,
                                           const PreservationBounds& bounds);

  PreservationChooserOptions options_;
  std::unordered_map<const void*, PreserveChoice> choices_;
  std::vector<PreservationTrial> trials_;
  PreserveChoice trying_ = PreserveChoice::kRegions;  // the mode the session runs while measuring
  std::optional<PreserveChoice> chosen_;
};

}  // namespace tapesac::runtime
