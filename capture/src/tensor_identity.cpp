// Tensor identity (see tensor_identity.h).
#include "tapesac/capture/tensor_identity.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <utility>

namespace tapesac::capture {

const void* storage_key(const at::Tensor& t) {
  if (!t.has_storage()) return t.unsafeGetTensorImpl();
  return t.storage().unsafeGetStorageImpl();
}

at::Tensor detached_alias(const at::Tensor& t) {
  if (!t.defined()) return t;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  // Bookkeeping, not the user's computation: with a TorchDispatchMode active, shallow_copy_and_detach asks the
  // mode's Python detach (FlopCounterMode returned a float for a wrapped number: a capture error per block call).
  // Tensor subclasses that dispatch to Python are never recorded (Note [Python tensor subclasses]).
  c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  auto copy = impl->shallow_copy_and_detach(impl->version_counter(), /*allow_tensor_metadata_change=*/false);
  return at::Tensor(std::move(copy));
}

int64_t storage_bytes(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

int64_t view_bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace tapesac::capture
