// The step session (see session.h): opens and closes steps and block calls, and keeps what persists between steps.
#include "tapesac/replay/session.h"

#include <algorithm>

#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/tensor_identity.h"
#include "tapesac/common/clock.h"
#include "tapesac/common/errors.h"

namespace tapesac::replay {

Session::Session(SessionOptions options) : options_(std::move(options)) {
  if (!options_.device_memory) options_.device_memory = capture::cuda_device_memory();
  if (options_.graph_device) graphs_ = std::make_unique<GraphCache>(options_.graph_device, options_.graph);
}

Session::~Session() { end_step(); }

int64_t Session::baseline_of(const std::vector<at::Tensor>& params) {
  param_storages_.clear();
  int64_t baseline = 0;
  std::unordered_set<const void*> counted;
  for (const at::Tensor& p : params) {
    if (!p.defined()) continue;
    const void* key = capture::storage_key(p);
    param_storages_.insert(key);
    if (counted.insert(key).second) baseline += capture::storage_bytes(p);
    const at::Tensor& g = p.grad();
    if (g.defined() && g.has_storage() && counted.insert(capture::storage_key(g)).second) baseline += capture::storage_bytes(g);
  }
  if (graphs_) baseline += graphs_->static_bytes();  // captured graphs hold their static tensors between steps
  return baseline;
}

void Session::begin_step(const std::vector<at::Tensor>& params) {
  TAPESAC_CHECK(!in_step_, kGeneric,
                "tapesac: sac.step() was entered while a step of the same TapeSAC is open; steps cannot nest. "
                "Close the first `with sac.step():` before opening the next.");
  const int64_t baseline = baseline_of(params);
  backward_failed_->store(false, std::memory_order_relaxed);
  blocks_.clear();
  if (!allocator_use_) allocator_use_ = std::make_unique<allocator::CountingAllocatorUse>();
  memory_ = std::make_shared<StepMemory>(options_.timeline_points, baseline, options_.device_memory);
  counter_scope_.emplace(memory_->counter_ptr());
  if (approx_) approx_->begin_step();
  // Writes are watched for the replays; under policy "none" nothing is dropped, so nothing is ever replayed (and the
  // watcher's callback would box every op's arguments for nothing). Under preserve="off" the watcher counts the writes
  // without saving (Note [Writes counted under preserve="off"], preserve.h): a write that moves no version counter
  // (`.data`, an alias made by set_, untyped_storage().copy_) was served to the replay silently, wrong gradients with
  // records saying "match" (found by an adversarial test); it is now rejected, as the README says "off" does.
  if (options_.check_versions && options_.policy != PolicyKind::kNone) {
    watcher_ = std::make_shared<WriteWatcher>(options_.preserve, preserve_modes_);
    watcher_->install();
  }
  in_step_ = true;
  unpack_clock_.store(0, std::memory_order_relaxed);
  backward_started_ = false;
  second_backward_started_ = false;
  if (!second_backward_starts_) {
    second_backward_starts_ = [this](BlockCall& caller) {
      once_on_every_call(second_backward_started_, caller, &BlockCall::note_second_backward_locked,
                         &BlockCall::note_second_backward);
    };
  }
  if (!backward_starts_) {
    backward_starts_ = [this](BlockCall& caller) {
      once_on_every_call(backward_started_, caller, &BlockCall::refresh_alive_dropped_locked,
                         &BlockCall::refresh_alive_dropped);
    };
  }
}

void Session::once_on_every_call(std::atomic<bool>& done, BlockCall& caller, void (BlockCall::*locked)(),
                                 void (BlockCall::*unlocked)()) {
  // Once per step, from the unpack that starts it (the caller's lock held; the others are taken one at a time: no
  // other call's lock is held while waiting for one).
  if (done.exchange(true)) return;
  for (const auto& b : blocks_) {
    if (b.get() == &caller) {
      (b.get()->*locked)();
    } else {
      (b.get()->*unlocked)();
    }
  }
}

void Session::set_preservation(std::unordered_map<const void*, PreserveMode> modes,
                               std::unordered_set<const void*> keep) {
  TAPESAC_CHECK(!in_step_, kGeneric, "tapesac: preservation can only be chosen between steps");
  preserve_modes_ = std::move(modes);
  keep_dependents_ = std::move(keep);
}

void Session::set_plans(std::unordered_map<std::string, BlockPlan> plans) {
  TAPESAC_CHECK(!in_step_, kGeneric, "tapesac: a plan can only be set between steps");
  plans_ = std::move(plans);
}

void Session::set_approx(std::shared_ptr<Approx> approx) {
  TAPESAC_CHECK(!in_step_, kGeneric, "tapesac: approximation can only be configured between steps");
  approx_ = std::move(approx);
}

void Session::shutdown() noexcept {
  end_step();
  allocator_use_.reset();
  graphs_.reset();  // the graphs' static memory goes now, not when the Session object does
}

void Session::set_unplanned_schedule(ForcedSchedule shape) {
  TAPESAC_CHECK(!in_step_, kGeneric, "tapesac: the schedule of unplanned block calls can only be set between steps");
  options_.unplanned_schedule = shape == ForcedSchedule::kNone ? ForcedSchedule::kOneSegment : shape;
}

void Session::force_schedule(ForcedSchedule shape) {
  TAPESAC_CHECK(!in_step_, kGeneric, "tapesac: a replay schedule can only be forced between steps");
  options_.forced_schedule = shape;
}

void Session::set_memory_limit(int64_t bytes) {
  TAPESAC_CHECK(bytes >= 0, kConfig, "memory_limit must be a non-negative number of bytes (0: no limit), got ", bytes);
  options_.memory_limit = bytes;
}

BlockContext Session::block_context(const std::string& name) {
  BlockContext c;
  c.options = &options_;
  c.param_storages = &param_storages_;
  c.save_cache = &save_cache_;
  c.memory = memory_;
  c.watcher = watcher_;
  c.keep_dependents = &keep_dependents_;
  c.observer = &observer_;
  c.plans = &plans_;
  c.orders = &orders_;
  c.decisions = &decisions_;
  c.approx = approx_.get();
  c.graphs = graphs_.get();
  c.last_peak = last_peak_;
  if (observer_) {
    c.backward_starts = &backward_starts_;
    c.second_backward_starts = &second_backward_starts_;
    c.unpack_clock = &unpack_clock_;
  }
  auto hint = expected_ops_.find(name);
  c.expected_ops = hint == expected_ops_.end() ? 64 : hint->second + 8;
  int32_t earlier = 0;  // calls of this block earlier in the step
  for (const auto& b : blocks_) earlier += b->name() == name ? 1 : 0;
  c.plan_key = plan_key(name, earlier);
  return c;
}

std::shared_ptr<BlockCall> Session::begin_block(const std::string& name) {
  if (current_ != nullptr) return nullptr;
  auto block = std::make_shared<BlockCall>(name, block_context(name));
  block->start_forward();
  blocks_.push_back(block);
  current_ = block;
  return block;
}

// Note [Forwards whose graph died]. With sac.attach(optimizer) a step lasts until optimizer.step(): forwards with
// gradients whose graphs die unused (a validation loop without torch.no_grad()) all joined one step, whose block
// calls — tapes, records, decisions: ~100 KB each on a tiny Qwen3 — stayed until the optimizer stepped (an adversarial
// test: 122 MiB of host memory after 600 such forwards, 0.2 MiB without tapesac). The attachment ends such a step
// when the next block forward starts (attach.py). Checked newest call first: in a live forward the previous call still
// holds its saved tensors.
bool Session::forwards_died() const {
  if (current_ != nullptr) return false;
  bool died = false;
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) {
    const int state = (*it)->forward_died();
    if (state == 0) return false;
    died = died || state == 1;
  }
  return died;
}

void Session::end_block(bool aborted) {
  if (current_ == nullptr) return;
  std::shared_ptr<BlockCall> block = std::move(current_);  // closed even if deciding keep/drop throws
  block->close_forward(aborted);
}

void Session::end_step() noexcept {
  try {
    end_block();
  } catch (...) {
    // Closing the block's forward failed (e.g. out of memory while checksumming); the step is being torn down
    // anyway and close_step() below releases everything the block holds.
  }
  if (!in_step_) return;
  collect_block_stats();
  if (watcher_) {
    try {
      last_preserved_ = watcher_->stats();
      if (memory_) {  // on the step's memory clock
        const int64_t step_began = common::now_ns() - memory_->elapsed_ns();
        for (PreservedStorage& p : last_preserved_) {
          if (p.last_save_ns >= 0) p.last_save_ns = std::max<int64_t>(0, p.last_save_ns - step_began);
          for (auto& save : p.saves) save.first = std::max<int64_t>(0, save.first - step_began);
        }
      }
    } catch (...) {
      last_preserved_.clear();
    }
    watcher_->end();
    watcher_.reset();
  }
  counter_scope_.reset();
  collect_memory();
  memory_.reset();
  in_step_ = false;
}

void Session::collect_block_stats() noexcept {
  last_stats_.clear();
  last_liveness_.clear();
  last_replayed_.clear();
  last_records_.clear();
  last_preserved_.clear();
  try {
    const int64_t final_unpacks = unpack_clock_.load(std::memory_order_relaxed);
    for (const auto& b : blocks_) {
      b->close_step();
      last_stats_.push_back(b->stats());
      if (observer_) {
        last_liveness_.push_back(b->liveness());
        last_liveness_.back().held_through_backward = b->held_through_backward(final_unpacks);
      }
      remember_order(*b);
      expected_ops_[b->name()] = static_cast<size_t>(last_stats_.back().ops_recorded);
      for (const auto& [kind, count] : b->replayed_by_kind()) last_replayed_[capture::op_kind_name(kind)] += count;
    }
  } catch (...) {
    // Out of memory copying statistics: the blocks are closed below all the same; the step's figures are partial.
    for (const auto& b : blocks_) b->close_step();
  }
  blocks_.clear();
}

void Session::remember_order(const BlockCall& b) {
  // The first complete observation of a signature is kept (Note [Replay schedule]: stable per signature).
  if (orders_.count(b.signature())) return;
  UnpackObservation order = b.observed_order();
  if (order.values.empty()) return;
  if (orders_.size() >= kMaxOrders) orders_.clear();
  orders_.emplace(b.signature(), std::move(order));
}

void Session::collect_memory() noexcept {
  try {
    if (memory_) last_records_ = memory_->take_records();
    StepMemoryStats m;
    if (memory_) m = StepMemoryStats::of(*memory_, options_.memory_limit);
    // The limit the step is held to (the user's), also on auto's measuring step, whose enforced limit is none: the
    // over-limit flag is computed against it (an adversarial test found over_limit set and memory_limit None).
    const int64_t limit = std::max(options_.memory_limit, options_.graph_memory_limit);
    m.memory_limit = limit;
    last_peak_ = m.baseline + m.total.peak;
    if (options_.has_arena() && options_.device_memory) {
      last_peak_ = std::max(last_peak_, options_.device_memory->allocated_peak(options_.arena_device));
    }
    last_memory_ = std::move(m);
    last_summary_ = summarize_step(last_stats_, last_records_);
    // The limit is promised for the whole step: a peak over it is reported however it came about.
    if (limit > 0) {
      int64_t& over = last_summary_.totals.over_limit_bytes;
      over = std::max<int64_t>({over, last_peak_ - limit, 0});
    }
  } catch (...) {
    last_memory_ = StepMemoryStats{};  // out of memory copying the timeline: the step's figures are lost
  }
}

}  // namespace tapesac::replay
