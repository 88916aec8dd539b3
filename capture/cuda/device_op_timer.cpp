// device_op_timers(): the OpTimer implementations of a CUDA session (Note [Op times], tapesac/capture/op_timer.h).
// One OpTimer per block call: CUPTI (CuptiTimer, claimed at the block's first op and released when its recording
// stops) or, when CUPTI cannot be claimed, CUDA events (EventOpTimer, pooled across block calls).
//
// Note [Device timing cost and sampling]. Every block call of a session with device timing is timed: the
// planner's cost model takes per-op medians over the recent calls of a block (planner/from_tape.h), so mixing in
// CPU-clock figures from untimed calls would mix units. The price is one device synchronisation per block call
// (at close of its forward) and, with CUPTI, subscribing and enabling activity kinds per block call. The Python
// package therefore turns device timing on only where the planner consumes the times (policy "auto" on CUDA);
// static policies keep the CPU clock and never synchronise.
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include "tapesac/capture/kernel_times.h"
#include "tapesac/capture/op_timer.h"
#include "tapesac/cuda/cupti_timer.h"
#include "tapesac/cuda/device.h"

namespace tapesac::capture {
namespace {

class CuptiOpTimer final : public OpTimer {
 public:
  explicit CuptiOpTimer(std::unique_ptr<cuda::CuptiTimer> timer) : timer_(std::move(timer)) {}
  ~CuptiOpTimer() override { cancel(); }

  OpTiming kind() const override { return OpTiming::kCupti; }

  void begin(OpIndex op) override {
    if (!timer_) throw std::logic_error("CuptiOpTimer::begin: the timer was finished or cancelled");
    // One CuptiTimer per block call: the block part of the external id is not needed to tell blocks apart.
    timer_->push(external_id(0, op));
    ++depth_;
  }

  void end() override {
    if (!timer_ || depth_ == 0) throw std::logic_error("CuptiOpTimer::end: no op begun");
    timer_->pop();
    --depth_;
  }

  std::vector<int64_t> finish(size_t n_ops) override {
    if (!timer_) throw std::logic_error("CuptiOpTimer::finish: the timer was finished or cancelled");
    if (depth_ != 0) throw std::logic_error("CuptiOpTimer::finish: " + std::to_string(depth_) + " op(s) still open");
    std::unique_ptr<cuda::CuptiTimer> timer = std::move(timer_);
    const cuda::CuptiRecords rec = timer->stop();  // synchronises the device: the one sync of this block call
    if (rec.dropped > 0) {
      throw std::runtime_error("CUPTI dropped " + std::to_string(rec.dropped) +
                               " activity records (buffers full); the block's device times are incomplete");
    }
    const OpKernelTimes t = attribute_kernel_times(rec.activities, rec.correlations, 0, n_ops, {});
    int64_t attributed = 0;
    for (const int32_t r : t.records) attributed += r;
    if (attributed == 0 && t.unattributed_records > 0) {
      throw std::runtime_error("CUPTI delivered " + std::to_string(t.unattributed_records) +
                               " device activities but none carried an op's external correlation id (another "
                               "CUPTI client may have changed the enabled activity kinds)");
    }
    return t.ns;
  }

  void cancel() noexcept override {
    if (!timer_) return;
    // Leave the thread's CUSTOM2 correlation stack as it was found.
    for (; depth_ > 0; --depth_) timer_->pop();
    timer_.reset();  // stops and releases CUPTI, errors ignored
  }

 private:
  std::unique_ptr<cuda::CuptiTimer> timer_;
  int depth_ = 0;
};

/// Event timers handed back by finished block calls, reused so that steady-state blocks create no events.
struct EventTimerPool {
  std::mutex mu;
  std::vector<std::unique_ptr<cuda::EventOpTimer>> free;

  std::unique_ptr<cuda::EventOpTimer> take() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!free.empty()) {
        auto t = std::move(free.back());
        free.pop_back();
        return t;
      }
    }
    auto t = std::make_unique<cuda::EventOpTimer>();
    t->reserve(64);
    return t;
  }

  void give(std::unique_ptr<cuda::EventOpTimer> t) noexcept {
    t->reset();
    std::lock_guard<std::mutex> lock(mu);
    if (free.size() < 4) {
      try {
        free.push_back(std::move(t));
      } catch (...) {
        // Out of memory: the timer is destroyed instead of pooled.
      }
    }
  }
};

class EventsOpTimer final : public OpTimer {
 public:
  EventsOpTimer(std::shared_ptr<EventTimerPool> pool, std::string note)
      : pool_(std::move(pool)), timer_(pool_->take()), note_(std::move(note)) {}
  ~EventsOpTimer() override { cancel(); }

  OpTiming kind() const override { return OpTiming::kCudaEvents; }
  std::string note() const override { return note_; }

  void begin(OpIndex op) override {
    if (!timer_) throw std::logic_error("EventsOpTimer::begin: the timer was finished or cancelled");
    timer_->begin(op);
  }

  void end() override {
    if (!timer_) throw std::logic_error("EventsOpTimer::end: no op begun");
    timer_->end();
  }

  std::vector<int64_t> finish(size_t n_ops) override {
    if (!timer_) throw std::logic_error("EventsOpTimer::finish: the timer was finished or cancelled");
    std::vector<int64_t> ns = timer_->collect(n_ops);  // synchronises on the block's last event
    pool_->give(std::move(timer_));
    return ns;
  }

  void cancel() noexcept override {
    if (timer_) pool_->give(std::move(timer_));
  }

 private:
  std::shared_ptr<EventTimerPool> pool_;
  std::unique_ptr<cuda::EventOpTimer> timer_;
  std::string note_;
};

class DeviceOpTimers final : public OpTimerFactory {
 public:
  explicit DeviceOpTimers(int device) : device_(device), pool_(std::make_shared<EventTimerPool>()) {}

  std::unique_ptr<OpTimer> make(const std::string& /*block*/, std::string* why) override {
    auto refuse = [&](std::string msg) -> std::unique_ptr<OpTimer> {
      if (why != nullptr) *why = std::move(msg);
      return nullptr;
    };
    const int n = cuda::device_count();
    if (device_ < 0 || device_ >= n) {
      return refuse("no CUDA device " + std::to_string(device_) + " (" + std::to_string(n) +
                    " visible); op times are the CPU clock");
    }
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream().stream(), &status) != cudaSuccess ||
        status != cudaStreamCaptureStatusNone) {
      (void)cudaGetLastError();
      return refuse("the current CUDA stream is capturing a graph (device timing would add nodes to it); op times "
                    "are the CPU clock");
    }
    // Kineto holds CUPTI's activity buffers while torch.profiler runs; claiming them would break its trace
    // (reference/cuda.md §C5). Its subscriber is not always registered, so ask torch rather than CUPTI.
    if (torch::profiler::impl::profilerEnabled()) {
      try {
        return std::make_unique<EventsOpTimer>(
            pool_, "torch.profiler is active on this thread and owns CUPTI; op times from CUDA events");
      } catch (const std::exception& e) {
        return refuse(std::string("CUDA events failed (") + e.what() + "); op times are the CPU clock");
      }
    }
    std::string refused;
    std::unique_ptr<cuda::CuptiTimer> cupti = cuda::CuptiTimer::start(&refused);
    if (cupti) return std::make_unique<CuptiOpTimer>(std::move(cupti));
    try {
      return std::make_unique<EventsOpTimer>(pool_, refused);
    } catch (const std::exception& e) {
      return refuse(refused + "; CUDA events failed too (" + e.what() + "); op times are the CPU clock");
    }
  }

 private:
  int device_;
  std::shared_ptr<EventTimerPool> pool_;
};

}  // namespace

std::shared_ptr<OpTimerFactory> device_op_timers(int device) { return std::make_shared<DeviceOpTimers>(device); }

}  // namespace tapesac::capture
