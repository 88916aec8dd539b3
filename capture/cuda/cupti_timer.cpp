// CuptiTimer and EventOpTimer (see tapesac/cuda/cupti_timer.h). CUPTI is reached only through CuptiLibrary's
// function table (dlopen), never linked.
#include "tapesac/cuda/cupti_timer.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <utility>

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <cupti.h>

#include "tapesac/cuda/check.h"
#include "tapesac/cuda/cupti_loader.h"
#include "tapesac/cuda/event.h"

namespace tapesac::cuda {

namespace {

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kAlign = 8;

// CUPTI's buffer callbacks carry no user pointer: they deliver to the one active timer.
std::mutex g_mutex;
CuptiRecords* g_sink = nullptr;
const CuptiApi* g_api = nullptr;
std::atomic<bool> g_active{false};

const CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                     CUPTI_ACTIVITY_KIND_MEMSET,            CUPTI_ACTIVITY_KIND_RUNTIME,
                                     CUPTI_ACTIVITY_KIND_DRIVER,            CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION};

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kAlign, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_sink != nullptr && g_api != nullptr && valid > 0) {
      CUpti_Activity* rec = nullptr;
      while (g_api->next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
          case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
          case CUPTI_ACTIVITY_KIND_KERNEL: {
            const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
            g_sink->activities.push_back({k->correlationId, k->start, k->end, k->graphNodeId});
            break;
          }
          case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
            g_sink->activities.push_back({m->correlationId, m->start, m->end, m->graphNodeId});
            break;
          }
          case CUPTI_ACTIVITY_KIND_MEMSET: {
            const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
            g_sink->activities.push_back({m->correlationId, m->start, m->end, m->graphNodeId});
            break;
          }
          case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
            const auto* e = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(rec);
            if (e->externalKind == CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2) {
              g_sink->correlations.push_back({e->correlationId, e->externalId});
            }
            break;
          }
          default:
            break;  // RUNTIME/DRIVER records are enabled only so that external correlation records are emitted
        }
      }
    }
  }
  std::free(buffer);
}

}  // namespace

struct CuptiTimer::Impl {
  const CuptiLibrary* lib = nullptr;
  CUpti_SubscriberHandle subscriber = nullptr;
  CuptiRecords records;
  bool running = false;
};

namespace {

void CUPTIAPI on_callback(void* user, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void* info) {
  if (domain != CUPTI_CB_DOMAIN_RESOURCE || id != CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED || info == nullptr) return;
  auto* impl = static_cast<CuptiTimer::Impl*>(user);
  const auto* rd = static_cast<const CUpti_ResourceData*>(info);
  const auto* gd = static_cast<const CUpti_GraphData*>(rd->resourceDescriptor);
  if (gd == nullptr) return;
  uint64_t from = 0, to = 0;
  const CuptiApi& api = impl->lib->api();
  if (api.graph_node_id(gd->originalNode, &from) == CUPTI_SUCCESS && api.graph_node_id(gd->node, &to) == CUPTI_SUCCESS) {
    std::lock_guard<std::mutex> lock(g_mutex);
    impl->records.cloned[from] = to;
  }
}

}  // namespace

CuptiTimer::CuptiTimer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<CuptiTimer> CuptiTimer::start(std::string* why) {
  auto fail = [&](std::string msg) -> std::unique_ptr<CuptiTimer> {
    if (why != nullptr) *why = std::move(msg);
    return nullptr;
  };
  std::string reason;
  const CuptiLibrary* lib = CuptiLibrary::load_default(&reason);
  if (lib == nullptr) return fail(reason);
  bool expected = false;
  if (!g_active.compare_exchange_strong(expected, true)) {
    return fail("CUPTI is already in use by another tapesac timer; kernel times fall back to CUDA events");
  }
  auto impl = std::make_unique<Impl>();
  impl->lib = lib;
  const CuptiApi& api = lib->api();
  char holder[CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN] = {0};
  CUpti_SubscriberParams params{};
  params.structSize = CUpti_SubscriberParams_STRUCT_SIZE;
  params.subscriberName = "tapesac";
  params.oldSubscriberName = holder;
  params.oldSubscriberSize = sizeof holder;
  CUptiResult r = api.subscribe(&impl->subscriber, reinterpret_cast<CUpti_CallbackFunc>(&on_callback), impl.get(),
                                &params);
  if (r != CUPTI_SUCCESS) {
    g_active = false;
    return fail("CUPTI unavailable: cuptiSubscribe_v2 returned " + lib->result_string(r) +
                (holder[0] != 0 ? std::string(" (held by ") + holder + ")" : std::string()) +
                "; a profiler (torch.profiler, Nsight) owns CUPTI. torch.profiler's kineto stays subscribed after its "
                "session ends, so once a process ran torch.profiler, tapesac cannot claim CUPTI again in it (run the "
                "profiler in another process); kernel times fall back to CUDA events");
  }
  auto undo = [&](const char* what, CUptiResult res) {
    for (const auto k : kKinds) api.disable(k);
    {
      // The buffer callbacks may stay registered: they must not deliver into this dying timer's records.
      std::lock_guard<std::mutex> lock(g_mutex);
      g_sink = nullptr;
      g_api = nullptr;
    }
    api.unsubscribe(impl->subscriber);
    g_active = false;
    return fail(std::string("CUPTI unavailable: ") + what + " returned " + lib->result_string(res) +
                "; kernel times fall back to CUDA events");
  };
  r = api.enable_callback(1, impl->subscriber, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_GRAPHNODE_CLONED);
  if (r != CUPTI_SUCCESS) return undo("cuptiEnableCallback(GRAPHNODE_CLONED)", r);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_sink = &impl->records;
    g_api = &api;
  }
  r = api.register_callbacks(&buffer_requested, &buffer_completed);
  if (r != CUPTI_SUCCESS) return undo("cuptiActivityRegisterCallbacks", r);
  for (const auto k : kKinds) {
    r = api.enable(k);
    if (r != CUPTI_SUCCESS) return undo("cuptiActivityEnable", r);
  }
  impl->running = true;
  return std::unique_ptr<CuptiTimer>(new CuptiTimer(std::move(impl)));
}

void CuptiTimer::push(uint64_t external_id) {
  impl_->lib->api().push_external_id(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2, external_id);
}

void CuptiTimer::pop() {
  uint64_t last = 0;
  impl_->lib->api().pop_external_id(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2, &last);
}

CuptiRecords CuptiTimer::stop() {
  if (!impl_->running) throw std::logic_error("CuptiTimer::stop: the timer was already stopped");
  const CuptiApi& api = impl_->lib->api();
  impl_->running = false;
  // FlushAll does not synchronise; records of unfinished work would be lost.
  const cudaError_t sync = cudaDeviceSynchronize();
  api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  for (const auto k : kKinds) api.disable(k);
  size_t dropped = 0;
  if (api.dropped_records(nullptr, 0, &dropped) == CUPTI_SUCCESS) impl_->records.dropped = dropped;
  api.unsubscribe(impl_->subscriber);
  CuptiRecords out;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_sink = nullptr;
    out = std::move(impl_->records);
  }
  g_active = false;
  TAPESAC_CUDA_CHECK(sync);
  return out;
}

CuptiTimer::~CuptiTimer() {
  if (impl_ && impl_->running) {
    try {
      (void)stop();
    } catch (...) {
      // A destructor must not throw; the records are dropped.
    }
  }
}

uint64_t CuptiTimer::graph_node_id(uint64_t node_handle) const {
  uint64_t id = 0;
  const CUptiResult r =
      impl_->lib->api().graph_node_id(reinterpret_cast<CUgraphNode>(static_cast<uintptr_t>(node_handle)), &id);
  if (r != CUPTI_SUCCESS) {
    throw std::runtime_error("cuptiGetGraphNodeId failed: " + impl_->lib->result_string(r));
  }
  return id;
}

std::unordered_map<uint64_t, capture::OpIndex> CuptiTimer::exec_node_owner(
    const std::vector<uint64_t>& template_handles, const std::vector<capture::OpIndex>& owner,
    const CuptiRecords& records) const {
  if (template_handles.size() != owner.size()) {
    throw std::invalid_argument("CuptiTimer::exec_node_owner: " + std::to_string(template_handles.size()) +
                                " handles but " + std::to_string(owner.size()) + " owners");
  }
  std::vector<uint64_t> ids(template_handles.size(), 0);
  for (size_t i = 0; i < owner.size(); ++i) {
    if (owner[i] >= 0) ids[i] = graph_node_id(template_handles[i]);
  }
  return capture::exec_node_owner(ids, owner, records.cloned);
}

// One event per bracket boundary, reused across collect()s (no event is created per op once the pool covers a
// block): segment [boundary i, boundary i + 1) is charged to the op innermost at boundary i (exclusive time).
struct EventOpTimer::Impl {
  std::vector<Event> pool;
  size_t used = 0;
  std::vector<capture::OpIndex> segment_op;  // per recorded boundary: the op charged until the next one (-1: none)
  std::vector<capture::OpIndex> stack;

  void boundary() {
    if (used == pool.size()) pool.emplace_back(EventOptions{});
    pool[used].record(c10::cuda::getCurrentCUDAStream().stream());
    ++used;
    segment_op.push_back(stack.empty() ? -1 : stack.back());
  }
};

EventOpTimer::EventOpTimer() : impl_(std::make_unique<Impl>()) {}
EventOpTimer::~EventOpTimer() = default;

void EventOpTimer::reserve(size_t ops) {
  while (impl_->pool.size() < 2 * ops) impl_->pool.emplace_back(EventOptions{});
  impl_->segment_op.reserve(2 * ops);
  impl_->stack.reserve(16);
}

void EventOpTimer::begin(capture::OpIndex op) {
  impl_->stack.push_back(op);
  try {
    impl_->boundary();
  } catch (...) {
    impl_->stack.pop_back();
    throw;
  }
}

void EventOpTimer::end() {
  if (impl_->stack.empty()) throw std::logic_error("EventOpTimer::end: no op begun");
  const capture::OpIndex op = impl_->stack.back();
  impl_->stack.pop_back();
  try {
    impl_->boundary();
  } catch (...) {
    impl_->stack.push_back(op);
    throw;
  }
}

std::vector<int64_t> EventOpTimer::collect(size_t n_ops) {
  if (!impl_->stack.empty()) throw std::logic_error("EventOpTimer::collect: an op is still open");
  std::vector<int64_t> ns(n_ops, 0);
  const size_t used = impl_->used;
  impl_->used = 0;
  std::vector<capture::OpIndex> segment_op;
  segment_op.swap(impl_->segment_op);  // reset even when a CUDA call below throws
  impl_->segment_op.reserve(segment_op.size());
  if (used == 0) return ns;
  TAPESAC_CUDA_CHECK(cudaEventSynchronize(impl_->pool[used - 1].get()));
  for (size_t i = 0; i + 1 < used; ++i) {
    const capture::OpIndex op = segment_op[i];
    if (op < 0 || static_cast<size_t>(op) >= n_ops) continue;
    float ms = 0.f;
    TAPESAC_CUDA_CHECK(cudaEventElapsedTime(&ms, impl_->pool[i].get(), impl_->pool[i + 1].get()));
    ns[static_cast<size_t>(op)] += static_cast<int64_t>(static_cast<double>(ms) * 1e6);
  }
  return ns;
}

void EventOpTimer::reset() noexcept {
  impl_->used = 0;
  impl_->segment_op.clear();
  impl_->stack.clear();
}

}  // namespace tapesac::cuda
