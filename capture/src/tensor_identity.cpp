// Tensor identity (see tensor_identity.h).
#include "tapesac/capture/tensor_identity.h"

#include <utility>

namespace tapesac::capture {

const void* storage_key(const at::Tensor& t) {
  if (!t.has_storage()) return t.unsafeGetTensorImpl();
  return t.storage().unsafeGetStorageImpl();
}

at::Tensor detached_alias(const at::Tensor& t) {
  if (!t.defined()) return t;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  auto copy = impl->shallow_copy_and_detach(impl->version_counter(), /*allow_tensor_metadata_change=*/false);
  return at::Tensor(std::move(copy));
}

}  // namespace tapesac::capture
