// Approximate rematerialization, the replay override (approx.h): while the eager replayer rebuilds a block call's
// dropped values, BlockApprox::run computes the approximated components' projections over the selected units'
// columns only and their attention over the selected heads only; BlockApprox::finish then reweights the rebuilt
// values autograd reads (factors times the units' weights, a logsumexp shifted by -log(w)). Both run under the
// owning BlockCall's lock.
#include <cstdint>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include "tapesac/common/errors.h"
#include "tapesac/replay/approx.h"
#include "replay_guard.h"

namespace tapesac::replay {

bool BlockApprox::run(OpIndex op, std::vector<c10::IValue>& stack) const {
  auto it = op_match_.find(op);
  if (it == op_match_.end()) return false;
  const Applied& a = applied_[it->second.applied];
  const Role role = it->second.role;
  if (role == Role::kSdpa) {
    // SDPA over the selected heads, each with its kv head (so grouped-query attention needs no head grouping).
    at::Tensor q = stack.at(0).toTensor(), k = stack.at(1).toTensor(), v = stack.at(2).toTensor();
    std::vector<c10::IValue> sub(stack.begin(), stack.end());
    sub[0] = q.index_select(1, a.units);
    sub[1] = k.index_select(1, a.kv_of_head);
    sub[2] = v.index_select(1, a.kv_of_head);
    const auto mask_at = static_cast<size_t>(a.mask_arg);
    if (a.mask_arg >= 0 && sub.size() > mask_at && sub[mask_at].isTensor()) {
      const at::Tensor mask = sub[mask_at].toTensor();
      if (mask.dim() == 4 && mask.size(1) == a.heads) sub[mask_at] = mask.index_select(1, a.units);
    }
    a.sdpa->callBoxed(sub);
    TAPESAC_INTERNAL_ASSERT(sub.size() >= 2, "approximate attention: the SDPA kernel returned ", sub.size(), " values");
    const at::Tensor o_sel = sub[0].toTensor(), lse_sel = sub[1].toTensor();
    at::Tensor out = at::empty_strided(a.out_sizes, a.out_strides, o_sel.options()).zero_();
    out.index_copy_(1, a.units, o_sel);
    // Unselected heads: any finite value (finish() turns them into +inf with w = 0). A memory-efficient kernel pads
    // the logsumexp's last dimension to a multiple of 32; the selected heads' rows have the forward's shape too.
    at::Tensor lse = at::empty_strided(a.lse_sizes, a.lse_strides, lse_sel.options()).zero_();
    lse.index_copy_(1, a.units, lse_sel);
    // The kernel's other outputs (sequence offsets, philox state, debug mask) as the sub-call made them.
    sub[0] = std::move(out);
    sub[1] = std::move(lse);
    stack = std::move(sub);
    return true;
  }
  const at::Tensor& cols = role == Role::kQ ? a.q_cols : role == Role::kKv ? a.kv_cols : a.units;
  // Columns not recomputed: 0 for an MLP (its reweighting multiplies them by 0 anyway); 1 for attention, a finite
  // value that per-head norms (rsqrt of a mean square) cannot turn into inf.
  const double fill = role == Role::kColumns ? 0.0 : 1.0;
  at::Tensor part;
  at::Tensor x;
  if (it->second.addmm) {  // addmm(bias, mat1, mat2, beta, alpha)
    x = stack.at(1).toTensor();
    part = at::addmm(stack[0].toTensor().index_select(0, cols), x, stack[2].toTensor().index_select(1, cols),
                     stack[3].toScalar(), stack[4].toScalar());
  } else {  // mm(self, mat2)
    x = stack.at(0).toTensor();
    part = at::mm(x, stack[1].toTensor().index_select(1, cols));
  }
  const int64_t total_cols = it->second.addmm ? stack[2].toTensor().size(1) : stack[1].toTensor().size(1);
  at::Tensor out = at::full({x.size(0), total_cols}, fill, part.options());
  out.index_copy_(1, cols, part);
  stack.clear();
  stack.emplace_back(std::move(out));
  return true;
}

void BlockApprox::finish(std::unordered_map<ValueId, at::Tensor>& rebuilt) const {
  ReplayDispatchGuard guard;  // Note [Replay outside the backward's transforms]
  for (auto& [value, tensor] : rebuilt) {
    auto it = scaled_match_.find(value);
    if (it == scaled_match_.end() || !tensor.defined()) continue;
    const Scale& sc = it->second;
    at::Tensor w = applied_[sc.applied].weights;
    if (w.scalar_type() != tensor.scalar_type()) w = w.to(tensor.scalar_type());
    if (sc.layout.merged) {
      if (sc.group > 1) w = w.repeat_interleave(sc.group);
    } else {
      std::vector<int64_t> shape(static_cast<size_t>(tensor.dim() - sc.layout.axis), 1);
      shape[0] = w.numel();
      w = w.view(shape);
    }
    tensor = sc.log_shift ? at::sub(tensor, at::log(w)) : at::mul(tensor, w);
  }
}

}  // namespace tapesac::replay
