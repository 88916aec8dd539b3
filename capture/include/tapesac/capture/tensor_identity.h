// Tensor identity without the recorder: the key of a tensor's allocation, an alias of a tensor that holds its
// memory without joining the autograd graph, and the two byte sizes everything counts (allocation, view). Used wherever a tensor must be recognised or held across a step (the
// recorder's identity maps, the write watcher's entries, the session's kept and parameter storages). Pure functions;
// thread-safe; they dispatch no op (nothing is recorded or seen by a RecordFunction callback).
#pragma once

#include <ATen/core/Tensor.h>

namespace tapesac::capture {

/// The identity of `t`'s allocation: its StorageImpl, or the TensorImpl itself for tensors without storage
/// (sparse, nested, some wrappers), which then carry no aliasing information. Valid as an identity only while
/// something holds the storage (strongly or weakly): a freed address can be reused.
const void* storage_key(const at::Tensor& t);

/// A detached alias of `t` (shares storage and version counter, no autograd metadata) made without dispatching,
/// so that holding it creates no reference cycle with the autograd graph and records nothing. Undefined for an
/// undefined `t`.
at::Tensor detached_alias(const at::Tensor& t);

/// Bytes of `t`'s whole allocation (0 for an undefined tensor or one without storage).
int64_t storage_bytes(const at::Tensor& t);

/// Bytes `t`'s view spans (numel * element size; 0 for an undefined tensor).
int64_t view_bytes(const at::Tensor& t);

}  // namespace tapesac::capture
