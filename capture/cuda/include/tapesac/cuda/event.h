// Event: a move-only RAII owner of one cudaEvent_t, for timing and ordering GPU work.
//
// Contract: an Event owns its handle from construction (or adopt()) to destruction; destruction never throws
// and ignores CUDA errors (the process may be tearing down the context). Methods throw std::runtime_error
// (TAPESAC_CUDA_CHECK) on CUDA failure and std::logic_error when called on a moved-from Event. Not
// thread-safe: one Event is used by one thread at a time.
#pragma once

#include <memory>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "tapesac/cuda/check.h"

namespace tapesac::cuda {

/// Flags for a new Event.
struct EventOptions {
  bool timing = true;          ///< false adds cudaEventDisableTiming (cheaper; elapsed_ms then throws).
  bool blocking_sync = false;  ///< true adds cudaEventBlockingSync (synchronize() yields the CPU thread).
};

class Event {
 public:
  /// Creates a new event on the current device. Throws std::runtime_error if CUDA fails (e.g. no device).
  explicit Event(EventOptions options = {});

  /// Takes ownership of `raw` (created elsewhere with cudaEventCreate*); it is destroyed with the Event.
  static Event adopt(cudaEvent_t raw) noexcept;

  Event(Event&&) noexcept = default;
  Event& operator=(Event&&) noexcept = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() = default;

  /// Records the event on `stream` (nullptr: the legacy default stream).
  void record(cudaStream_t stream = nullptr);
  /// Blocks until the work captured by the last record() has completed.
  void synchronize() const;
  /// True when the work captured by the last record() has completed (or record() was never called).
  bool query() const;
  /// Milliseconds from `start` to this event; both recorded and completed, both created with timing on.
  float elapsed_ms(const Event& start) const;

  /// The raw handle, borrowed: valid while this Event lives; nullptr after a move.
  cudaEvent_t get() const noexcept { return handle_.get(); }

 private:
  struct Deleter {
    void operator()(cudaEvent_t event) const noexcept;
  };
  using Handle = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, Deleter>;

  explicit Event(Handle handle) noexcept : handle_(std::move(handle)) {}
  cudaEvent_t checked_get(const char* what) const;

  Handle handle_;
};

}  // namespace tapesac::cuda
