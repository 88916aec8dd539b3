// What approximate rematerialization did in one block call (approx.h), as a field list (Note [Statistics defined
// once] in stats_fields.h). BlockStats holds one ApproxStats; its fields reach Python prefixed "approx_".
#pragma once

#include "tapesac/replay/stats_fields.h"

// X(type, name, combine, doc)
#define TAPESAC_APPROX_STATS_FIELDS(X)                                                                               \
  X(int64_t, mlp, kSum, "gated MLPs approximated")                                                                   \
  X(int64_t, mlp_skipped, kSum,                                                                                      \
    "gated MLPs found but replayed exactly (a value kept, a reader outside the pattern, an in-place write, ...)")     \
  X(int64_t, units_total, kSum, "hidden units of the approximated MLPs")                                             \
  X(int64_t, units_recomputed, kSum, "hidden units of the approximated MLPs that replay recomputes")                  \
  X(int64_t, attn, kSum, "attentions approximated (units are query heads)")                                          \
  X(int64_t, attn_skipped, kSum, "attentions found but replayed exactly")                                            \
  X(int64_t, heads_total, kSum, "query heads of the approximated attentions")                                        \
  X(int64_t, heads_recomputed, kSum, "query heads that replay recomputes")                                           \
  X(int64_t, kv_heads_total, kSum, "key/value heads of the approximated attentions")                                 \
  X(int64_t, kv_heads_recomputed, kSum, "key/value heads that replay recomputes (those of a selected query head)")   \
  X(int64_t, kept_values, kSum, "dropped values kept because their replay would read an approximated output")

namespace tapesac::replay {

struct ApproxStats {
#define TAPESAC_X(type, name, combine, doc) type name{};
  TAPESAC_APPROX_STATS_FIELDS(TAPESAC_X)
#undef TAPESAC_X
};

}  // namespace tapesac::replay
