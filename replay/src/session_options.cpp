// Parsing the option names of the Python front into SessionOptions' enums (see session_options.h).
#include "tapesac/replay/session_options.h"

#include "tapesac/common/errors.h"

namespace tapesac::replay {

PolicyKind parse_policy(const std::string& name) {
  if (name == "none") return PolicyKind::kNone;
  if (name == "full") return PolicyKind::kFull;
  if (name == "save_ops") return PolicyKind::kSaveOps;
  if (name == "plan") return PolicyKind::kPlan;
  TAPESAC_CHECK(false, kConfig, "unknown policy '", name, "'; expected 'none', 'full', 'save_ops' or 'plan'");
  return PolicyKind::kFull;
}

PreserveMode parse_preserve(const std::string& name) {
  if (name == "off") return PreserveMode::kOff;
  if (name == "regions") return PreserveMode::kRegions;
  if (name == "snapshots") return PreserveMode::kSnapshots;
  TAPESAC_CHECK(false, kConfig, "unknown preservation '", name, "'; expected 'off', 'regions' or 'snapshots'");
  return PreserveMode::kOff;
}

LaunchTiming parse_graph_timing(const std::string& name) {
  if (name == "off") return LaunchTiming::kOff;
  if (name == "first") return LaunchTiming::kFirst;
  if (name == "every") return LaunchTiming::kEvery;
  TAPESAC_CHECK(false, kConfig, "unknown graph_timing '", name, "'; expected 'off', 'first' or 'every'");
  return LaunchTiming::kOff;
}

std::shared_ptr<Approx> make_approx(double fraction, const std::string& method, bool mlp, bool attn, uint64_t seed,
                                    bool reweight) {
  TAPESAC_CHECK(fraction > 0 && fraction <= 1, kConfig, "approx fraction must be in (0, 1], got ", fraction);
  TAPESAC_CHECK(method == "sketch" || method == "greedy", kConfig, "approx method must be 'sketch' or 'greedy', got '",
                method, "'");
  ApproxOptions o;
  o.fraction = fraction;
  o.method = method == "greedy" ? ApproxMethod::kGreedy : ApproxMethod::kSketch;
  o.mlp = mlp;
  o.attn = attn;
  o.seed = seed;
  o.reweight = reweight;
  return std::make_shared<Approx>(o);
}

}  // namespace tapesac::replay
