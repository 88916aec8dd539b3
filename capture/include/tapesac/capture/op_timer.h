// Per-op device timing for the recorder: the CUDA-free interface (OpTimer, OpTimerFactory) the recorder calls
// around every recorded op when a timer is set, and the factory of the CUDA implementations (capture/cuda,
// device_op_timer.cpp; without the GPU backend it hands out no timers and says why).
//
// Note [Op times]. The planner's cost model reads OpRecord::duration_ns (planner/from_tape.cpp). On CPU the
// recorder's steady clock from op entry to op exit is the op's cost. On CUDA, kernels run asynchronously, so that
// clock measures the launch, not the op: there the recorder asks an OpTimer for device times instead —
//  * CUPTI (preferred): activity records of every kernel, memcpy and memset, attributed to the op whose external
//    correlation id was on the thread's stack when it was launched (Note [Kernel time attribution]); pure device
//    time, launch gaps excluded.
//  * CUDA events (fallback, when CUPTI is held by a profiler or cannot be loaded): one event at every op boundary
//    on the current stream; stream time, so gaps where the GPU waits for the CPU count too, and work an op
//    forks to other streams is missed unless joined before the op returns (reference/cuda.md §C6).
// Calls nest (a CompositeImplicitAutograd op that decomposes is bracketed around its recorded children): time is
// charged to the innermost open op, i.e. exclusive time. An op's bracket is opened with the index it will get if
// it is recorded (the tape length at entry); a decomposing composite shares that index with its first child, so
// its own work between children (rare: its children are recorded) is charged to that child.
// Reading device times needs the device to finish the block's work: the timers synchronise once, in finish(),
// which the recorder calls when the block's recording stops (BlockCall::close_forward) — the planner reads the
// tape right after (Session::set_tape_observer), so deferring to step end would leave it CPU figures.
// When the timer fails (begin/end/finish throw, or finish returns a wrong size), the recorder cancels it, keeps
// its CPU-clock figures for the block and says why (Recorder::op_timing_note()).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tapesac/capture/tape.h"

namespace tapesac::capture {

/// Times the ops of one block call. Used by one thread (the recording one); begin()/end() nest and balance.
class OpTimer {
 public:
  virtual ~OpTimer() = default;
  /// What the figures of finish() are.
  virtual OpTiming kind() const = 0;
  /// Why this kind was chosen when it is not the preferred one (e.g. why CUPTI was refused), or "".
  virtual std::string note() const { return {}; }
  /// Op `op` (the index it gets if recorded) starts on this thread. Hot path: must not allocate per op once
  /// warmed up. May throw std::exception (the recorder then cancels the timer).
  virtual void begin(OpIndex op) = 0;
  /// The innermost begun op ends. May throw std::exception.
  virtual void end() = 0;
  /// Every bracket is closed: waits for the device (at most one synchronisation) and returns the nanoseconds of
  /// ops [0, n_ops) (ops never begun: 0). Called at most once; the timer is spent afterwards. May throw.
  virtual std::vector<int64_t> finish(size_t n_ops) = 0;
  /// Abandons the measurement (after a throw, or when recording stopped with brackets open): releases whatever
  /// the timer holds (CUPTI, correlation stacks, events) so nothing is left behind. Idempotent.
  virtual void cancel() noexcept = 0;
};

/// Makes the OpTimer of each block call of a Session. Thread-safe.
class OpTimerFactory {
 public:
  virtual ~OpTimerFactory() = default;
  /// A timer for one call of block `block`, or null (the recorder keeps its CPU clock) with *why set.
  virtual std::unique_ptr<OpTimer> make(const std::string& block, std::string* why) = 0;
};

/// The device timers of CUDA device `device`: CUPTI when it can be claimed for the block call, else CUDA events;
/// no timer (with the reason) when there is no device, the current stream is capturing a graph, or tapesac was
/// built without the GPU backend. Never null.
std::shared_ptr<OpTimerFactory> device_op_timers(int device);

}  // namespace tapesac::capture
