// The dispatcher state every replay runs its recorded ops under (internal to replay/src).
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace tapesac::replay {

// Note [Replay outside the backward's transforms]. A backward can run under functorch layers the forward never saw:
// torch.autograd.grad(..., is_grads_batched=True) and autograd.functional.jacobian(vectorize=True) run it under vmap,
// so an unpack, and the replay it starts, ran inside the vmap layer, where a recorded dropout raised PyTorch's
// untyped "We do not yet support calling random operations inside of vmap". The tape holds plain tensors (a block
// call under a transform is not recorded, Note [torch.func] in python/tapesac/hooks.py), so its ops run with the
// functorch keys excluded: exactly what the forward ran, and what a plain run's backward reads.
inline constexpr c10::DispatchKeySet kFunctorchLayerKeys =
    c10::functorch_transforms_ks | c10::DispatchKeySet({c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
                                                        c10::DispatchKey::FuncTorchDynamicLayerBackMode});

/// Replayed ops run below autograd (they join no graph and bump no version the forward did not), without autocast
/// (the tape holds the ops autocast produced, casts included) and outside functorch's layers (see the Note).
struct ReplayDispatchGuard {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
  c10::impl::ExcludeDispatchKeyGuard no_functorch{kFunctorchLayerKeys};
};

}  // namespace tapesac::replay
