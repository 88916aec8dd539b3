// Per-operator facts the recorder needs on every call, computed once per overload from its schema and dispatch
// table and cached: whether the op is seen by autograd (or decomposes into ops that are), which arguments it writes,
// whether it draws random numbers. Thread-safe; entries live for the process.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>

#include "tapesac/capture/tape.h"

namespace tapesac::capture {

struct OpInfo {
  c10::OperatorHandle handle;
  OpKind kind = -1;
  /// Has a CompositeImplicitAutograd kernel that autograd runs for dense CPU / CUDA tensors: the op itself never
  /// reaches below autograd, its children are recorded instead.
  bool decomposes_cpu = false;
  bool decomposes_cuda = false;
  /// Has an autocast kernel: when autocast is on for the device, the inner (cast) call is recorded instead.
  bool autocast_cpu = false;
  bool autocast_cuda = false;
  /// Schema tag nondeterministic_seeded, or a Generator argument in the schema.
  bool random = false;
  /// An operator outside aten and prims (a torch.library custom op, a C++ extension's) not known to be random: its
  /// kernel may draw from the device's default generator below autograd, where the recorder does not see it. The
  /// recorder compares that generator before and after the call (Note [Random numbers drawn below a custom op]).
  bool probe_rng = false;
  /// Schema tag nondeterministic_bitwise.
  bool nondeterministic_bitwise = false;
  /// Collectives and other ops whose effects must not happen twice.
  bool effectful = false;
  /// Per argument: alias annotation with a write (Tensor(a!)).
  std::vector<bool> writes_arg;
  /// Per argument: the op does not read this tensor's bytes — it overwrites it whole (out= arguments, the self of
  /// copy_, fill_, zero_ and the random fills) or reads only its metadata (the self of *_like and new_* factories).
  /// See Note [Bytes no recorded op wrote] in tape.h.
  std::vector<bool> bytes_unread_arg;
  /// Allocates or resizes storage without setting its bytes (empty*, empty.out, resize_): kUninitialized.
  bool uninitialized = false;
  /// The kernel's results depend on grad mode, which replay (inside the backward) does not reproduce: e.g.
  /// aten::mkldnn_rnn_layer (nn.LSTM on CPU) runs oneDNN's training primitive, with a workspace output, only with
  /// grad mode on, and its inference primitive gives other bits. Recorded with grad mode on, it is not replayed.
  bool grad_mode_kernel = false;
  /// Forward-mode AD's own ops (aten::_fw_primal, _make_dual, _unpack_dual and their copies): a block running dual
  /// tensors is not recorded (Note [Forward-mode AD in a block], recorder.cpp).
  bool forward_ad = false;
  /// aten::fill_: with torch.use_deterministic_algorithms(True) and fill_uninitialized_memory (the default), PyTorch
  /// fills what empty.out / resize_ allocate with NaN through a fill_ the recorder sees; that fill still counts as
  /// leaving the bytes unset (Note [Bytes no recorded op wrote]).
  bool fill = false;
  /// Leaves part of its outputs unwritten (OpFlag kUnwrittenBytes): aten::_ctc_loss and the cuDNN variant.
  bool unwritten_outputs = false;
  /// Argument positions (or -1): dropout probability, train flag, explicit generator.
  int p_arg = -1;
  int train_arg = -1;
  int generator_arg = -1;

  explicit OpInfo(c10::OperatorHandle h) : handle(std::move(h)) {}
};

/// The cached facts for an operator, by name ("aten::add", overload "Tensor"). Returns nullptr when no such
/// operator is registered.
const OpInfo* op_info(const c10::OperatorName& name);
/// Counts operator deregistrations in the process (Note [Operators deregistered], op_info.cpp): facts looked up
/// in an earlier epoch may belong to an operator that no longer exists.
uint64_t op_registry_epoch();

}  // namespace tapesac::capture
