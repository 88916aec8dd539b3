// What replay needs to execute one tape op, kept beside the structural tape: the operator, its boxed arguments
// with every tensor slot emptied (tensors are referenced by value id in OpRecord::inputs, never held here), and the
// generator state to restore before a random op.
#pragma once

#include <optional>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include "tapesac/capture/small_vec.h"

namespace tapesac::capture {

struct OpPayload {
  /// The overload that ran (post-decomposition, as autograd saw it).
  std::optional<c10::OperatorHandle> handle;
  /// Boxed arguments; Tensor slots are None, Tensor[] slots are empty lists of the right type, Tensor?[] lists hold
  /// None where a tensor was.
  SmallVec<c10::IValue, 6> args;
  /// For random ops: the generator the op drew from and its state just before the op.
  std::optional<at::Generator> generator;
  c10::intrusive_ptr<c10::TensorImpl> generator_state;
  /// Position of the op's `Generator? generator` argument (-1: none). Replay passes a private generator there, so
  /// it never touches a generator other threads draw from.
  int16_t generator_arg = -1;
};

}  // namespace tapesac::capture
