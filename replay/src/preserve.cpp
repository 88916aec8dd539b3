// The write watcher (see preserve.h).
#include "tapesac/replay/preserve.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/COW.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "tapesac/capture/dispatch_hook.h"
#include "tapesac/capture/op_info.h"
#include "tapesac/capture/recorder.h"
#include "tapesac/capture/tensor_identity.h"
#include "tapesac/common/clock.h"

namespace tapesac::replay {

enum class RegionKind : uint8_t { kView, kIndexPut, kIndexDim, kScatter, kMasked };

namespace {

thread_local WriteWatcher* t_watcher = nullptr;

using common::now_ns;

// Runs tensor code for the watcher itself: below autograd (no graph, no version bumps on new tensors) and unseen by
// every RecordFunction callback and by the dispatch hook (the recorder must not record it, the watcher must not see
// itself).
struct QuietScope {
  at::RecordFunctionGuard no_callbacks{false};
  c10::impl::ExcludeDispatchKeyGuard no_hook{capture::dispatch_hook::kKey};
  c10::AutoGradMode no_grad{false};
  at::AutoDispatchBelowADInplaceOrView below_autograd;
};

at::Tensor bytes_of_storage(const at::Tensor& t) {
  const int64_t n = static_cast<int64_t>(t.storage().nbytes());
  return at::empty({0}, t.options().dtype(at::kByte)).set_(t.storage(), 0, {n}, {1});
}

at::Tensor view_on(const at::Tensor& bytes, int64_t offset, at::IntArrayRef sizes, at::IntArrayRef strides,
                   at::ScalarType dtype) {
  return at::empty({0}, bytes.options().dtype(dtype)).set_(bytes.storage(), offset, sizes, strides);
}

using capture::view_bytes;

RegionKind region_kind(const char* name, size_t arg) {
  if (arg != 0) return RegionKind::kView;
  static const std::pair<const char*, RegionKind> kinds[] = {
      {"aten::index_put_", RegionKind::kIndexPut},  {"aten::_index_put_impl_", RegionKind::kIndexPut},
      {"aten::index_copy_", RegionKind::kIndexDim}, {"aten::index_fill_", RegionKind::kIndexDim},
      {"aten::index_add_", RegionKind::kIndexDim},  {"aten::index_reduce_", RegionKind::kIndexDim},
      {"aten::scatter_", RegionKind::kScatter},     {"aten::scatter_add_", RegionKind::kScatter},
      {"aten::scatter_reduce_", RegionKind::kScatter}, {"aten::masked_fill_", RegionKind::kMasked},
      {"aten::masked_scatter_", RegionKind::kMasked},
  };
  for (const auto& [n, k] : kinds) {
    if (std::strcmp(n, name) == 0) return k;
  }
  return RegionKind::kView;
}

}  // namespace

const char* preserve_mode_name(PreserveMode m) {
  switch (m) {
    case PreserveMode::kOff: return "off";
    case PreserveMode::kRegions: return "regions";
    case PreserveMode::kSnapshots: return "snapshots";
  }
  return "?";
}

struct WriteWatcher::Write {
  RegionKind kind = RegionKind::kView;
  int64_t offset = 0;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat;
  at::Tensor old;                                   // the overwritten entries, before the write
  c10::List<std::optional<at::Tensor>> indices;     // kIndexPut
  int64_t dim = 0;                                  // kIndexDim, kScatter
  at::Tensor index;                                 // kIndexDim, kScatter
  at::Tensor mask;                                  // kMasked
};

// The entries of `region` a write of kind w.kind touches, and writing them back.
at::Tensor WriteWatcher::take(const Write& w, const at::Tensor& region) {
  switch (w.kind) {
    case RegionKind::kIndexPut: return at::index(region, w.indices);
    case RegionKind::kIndexDim: return region.index_select(w.dim, w.index);
    case RegionKind::kScatter: return region.gather(w.dim, w.index);
    case RegionKind::kMasked: return region.masked_select(w.mask);
    case RegionKind::kView: return region.clone();
  }
  return {};
}

void WriteWatcher::put(const Write& w, at::Tensor& region, const at::Tensor& values) {
  switch (w.kind) {
    case RegionKind::kIndexPut: region.index_put_(w.indices, values); break;
    case RegionKind::kIndexDim: region.index_copy_(w.dim, w.index, values); break;
    case RegionKind::kScatter: region.scatter_(w.dim, w.index, values); break;
    case RegionKind::kMasked: region.masked_scatter_(w.mask, values); break;
    case RegionKind::kView: region.copy_(values); break;
  }
}

struct WriteWatcher::Entry {
  PreserveMode mode = PreserveMode::kRegions;
  int64_t nbytes = 0;
  const void* data = nullptr;  // the storage's allocation when first watched: Note [a storage reallocated unseen]
  // Entries are keyed by StorageImpl address: the weak hold keeps that address from being reused by another storage
  // while the entry exists (the bytes are still freed with the last tensor).
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
  int64_t count = 0;       // writes seen since the storage was first watched
  int64_t last_mark = -1;  // the latest mark handed out (marks never decrease)
  bool broken = false;     // saving a write failed: restores refuse
  std::string broken_why;
  std::vector<Write> writes;                               // kRegions: write k is the (k+1)-th
  std::vector<std::pair<int64_t, at::Tensor>> snapshots;   // kSnapshots: (writes seen before, bytes)
  PreservedStorage stats;
  // Note [a storage reallocated unseen]: since the allocation changed, the byte ranges written into it (sorted,
  // disjoint); the refill ends when they cover the storage. `refill_unknown`: a write whose bytes are not one dense
  // range filled some of it.
  bool refilling = false;
  bool refill_unknown = false;
  std::vector<std::pair<int64_t, int64_t>> refilled;
  // Note [a storage reallocated unseen], seen freed: the HeldAllocation the entry owns a share of (nullptr: none);
  // whether the storage was copy-on-write when last seen; whether check_allocations() looks at it (unheld_).
  void* held = nullptr;
  bool cow = false;
  bool checked = false;
  // Note [a storage reallocated unseen], refilled with other bytes: 8 bytes at the start, the middle and the end of a
  // CPU storage as watched; compared with the refilled bytes before a replay reads them (`unfilled` says why not).
  std::array<uint64_t, 3> probe{};
  bool probed = false;
  std::string unfilled;

  Entry() = default;
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
  ~Entry();

  /// Restores of this storage refuse from now on, saying why (ReplayContractError).
  void refuse(std::string why) {
    broken = true;
    broken_why = std::move(why);
  }
};

namespace {

constexpr const char* kReallocatedUnseen =
    "it was reallocated by code no operator call shows (e.g. untyped_storage().resize_()) and ";

/// The bytes [first, second) of its storage a write covers, when the written view covers exactly one dense range of
/// them (a slice, a row block, the whole tensor); nullopt otherwise (strided or index writes).
std::optional<std::pair<int64_t, int64_t>> dense_bytes(const at::Tensor& target, RegionKind kind) {
  if (kind != RegionKind::kView || !target.is_non_overlapping_and_dense()) return std::nullopt;
  const auto item = static_cast<int64_t>(target.element_size());
  return std::make_pair(target.storage_offset() * item, (target.storage_offset() + target.numel()) * item);
}

/// Bytes of [lo, hi) already in `ranges` (sorted, disjoint).
int64_t covered_bytes(const std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t lo, int64_t hi) {
  int64_t n = 0;
  for (const auto& [a, b] : ranges) n += std::max<int64_t>(0, std::min(b, hi) - std::max(a, lo));
  return n;
}

/// Adds [lo, hi) to `ranges` (sorted, disjoint, merged).
void add_range(std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t lo, int64_t hi) {
  ranges.emplace_back(lo, hi);
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  ranges = std::move(merged);
}


// Note [a storage reallocated unseen], seen freed. The reallocation is no operator call, and when the allocator hands
// the same block back (same address, same size, same StorageImpl: glibc after some allocation histories, a caching
// allocator often) nothing about the storage shows it — the refill was then saved as a write, and the replay read
// what the block held before the refill (glibc's free-list pointers over its first 16 bytes; random programs 166 and
// 396 before the generator avoided it). Two ways to see it:
// - a CPU storage of the process's CPU allocator: while watched, its DataPtr is the watcher's HeldAllocation, which
//   owns the allocator's DataPtr and records how the storage let go of it (the data pointer is unchanged; end() puts
//   the allocator's DataPtr back). Not for other allocators (CUDA's caching allocator and pinned host memory find
//   their blocks through the DataPtr's context and deleter: record_stream would silently skip a held one) nor
//   copy-on-write storages. Two sessions' watchers may hold one storage (steps open on two threads): holds nest, and
//   each takes its own layer out (hold_mu serializes them);
// - any storage: check_allocations() at block boundaries finds it empty or moved (FSDP2 frees a parameter after its
//   block's forward and refills it before its backward, with other blocks in between). A free and a same-address
//   refill with no boundary between them stay unseen on those storages (README, Limits and guarantees).
// How the storage let go matters (an adversarial test): resize_(n > 0) and share_memory_() copy the bytes into the new
// allocation before freeing the old one — the bytes are kept, the writes saved before still undo onto them, and a
// later write is a write (taking it for a refill read the written bytes in the replay: silently different
// gradients) —, while resize_(0) empties the storage: its next writes refill it. The HeldAllocation has two owners,
// the storage's DataPtr and the entry: whichever lets go last deletes it.
enum class LetGo : uint8_t { kHeld, kMovedKeepingBytes, kEmptied };

struct HeldAllocation {
  at::DataPtr original;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::atomic<LetGo> let_go{LetGo::kHeld};
  std::atomic<int> owners{2};
  bool released = false;  // original handed back by release_allocation(): the storage's letting go is no free
};

std::mutex hold_mu;  // every watcher's hold and release of a storage's DataPtr

void let_go(HeldAllocation* h) {
  if (h->owners.fetch_sub(1, std::memory_order_acq_rel) == 1) delete h;
}

void free_held(void* ctx) {
  auto* h = static_cast<HeldAllocation*>(ctx);
  if (!h->released) {
    // Called while the storage takes its new DataPtr (its data pointer is already the new one: DataPtr's move
    // assignment sets it before it deletes the old context), or while the storage dies (not lockable then).
    LetGo how = LetGo::kEmptied;
    if (c10::intrusive_ptr<c10::StorageImpl> s = h->storage.lock()) {
      const void* now = s->_mutable_data_ptr_no_checks().get();
      if (now != nullptr && now != h->original.get()) how = LetGo::kMovedKeepingBytes;
    }
    h->original = at::DataPtr();  // the allocation goes now, with its allocator's deleter
    h->let_go.store(how, std::memory_order_release);
  }
  let_go(h);
}

/// Where the probe of a storage of `n` >= 8 bytes samples 8 bytes: its start, middle and end.
std::array<int64_t, 3> probe_offsets(int64_t n) { return {0, (n / 2) & ~int64_t{7}, n - 8}; }

/// The probe of a CPU storage (Note [a storage reallocated unseen], refilled with other bytes): the 8 bytes at each of
/// probe_offsets(). False when it has none (another device, under 8 bytes).
bool read_probe(const c10::StorageImpl& s, std::array<uint64_t, 3>& out) {
  const at::DataPtr& dp = const_cast<c10::StorageImpl&>(s)._mutable_data_ptr_no_checks();
  const auto n = static_cast<int64_t>(s.nbytes());
  if (dp.get() == nullptr || dp.device().type() != c10::kCPU || n < 8) return false;
  const auto* bytes = static_cast<const char*>(dp.get());
  const std::array<int64_t, 3> at = probe_offsets(n);
  for (size_t k = 0; k < 3; ++k) std::memcpy(&out[k], bytes + at[k], 8);
  return true;
}

/// The bytes [first, second) of its storage that `t` (strided) spans.
std::pair<int64_t, int64_t> spanned_bytes(const at::Tensor& t) {
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  const auto item = static_cast<int64_t>(t.element_size());
  return {t.storage_offset() * item, (t.storage_offset() + extent) * item};
}

}  // namespace

WriteWatcher::Entry::~Entry() {
  if (held != nullptr) let_go(static_cast<HeldAllocation*>(held));
}

void WriteWatcher::hold_allocation(Entry& e, c10::StorageImpl& s) {
  if (e.held != nullptr) let_go(static_cast<HeldAllocation*>(e.held));
  e.held = nullptr;
  std::lock_guard<std::mutex> lock(hold_mu);
  at::DataPtr& dp = s._mutable_data_ptr_no_checks();
  if (dp.get() == nullptr || dp.device().type() != c10::kCPU || !s.resizable() ||
      c10::impl::cow::is_cow_data_ptr(dp)) {
    return;  // nothing allocated, another device, copy-on-write
  }
  if (s.allocator() != c10::GetCPUAllocator() && s.allocator() != c10::GetDefaultCPUAllocator()) return;
  if (!e.storage) return;
  auto* h = new HeldAllocation{std::move(dp), *e.storage};
  dp = at::DataPtr(h->original.get(), h, &free_held, h->original.device());
  e.held = h;
}

void WriteWatcher::release_allocation(Entry& e) noexcept {
  if (e.held == nullptr || !e.storage) return;
  c10::intrusive_ptr<c10::StorageImpl> s = e.storage->lock();
  if (!s) return;
  std::lock_guard<std::mutex> lock(hold_mu);
  // The entry's layer may lie under another watcher's (holds nest): take it out where it is.
  at::DataPtr* slot = &s->_mutable_data_ptr_no_checks();
  while (slot->get_deleter() == &free_held) {
    auto* h = static_cast<HeldAllocation*>(slot->get_context());
    if (h == e.held) {
      h->released = true;
      at::DataPtr original = std::move(h->original);
      *slot = std::move(original);  // the storage lets go of h
      return;
    }
    slot = &h->original;
  }
  // Not found: the storage let go of it (freed or reallocated) or handed it to another storage (swap_data_ptr).
}

bool WriteWatcher::allocation_changed(Entry& e, c10::StorageImpl& s) {
  const LetGo how = e.held != nullptr ? static_cast<HeldAllocation*>(e.held)->let_go.load(std::memory_order_acquire)
                                      : LetGo::kHeld;
  const auto nbytes = static_cast<int64_t>(s.nbytes());
  const void* data = s._mutable_data_ptr_no_checks().get();
  if (how == LetGo::kHeld && nbytes == e.nbytes && data == e.data) return false;
  // Reallocated keeping the bytes (held: resize_ to a size as large, share_memory_(); unheld: a copy-on-write storage
  // copied at its first write): the writes saved since the watch undo onto the new allocation as onto the old.
  const bool cow = c10::impl::cow::is_cow_data_ptr(s._mutable_data_ptr_no_checks());
  const bool kept = nbytes >= e.nbytes && e.nbytes > 0 && data != nullptr &&
                    (how == LetGo::kMovedKeepingBytes || (e.cow && !cow));
  e.cow = cow;
  if (!kept) {
    // Note [a storage reallocated unseen]: FSDP2 frees an unsharded parameter's bytes after the forward
    // (untyped_storage().resize_(0)) and reallocates and refills them in the pre-backward hook; the resize is no
    // operator call, so the watcher sees only the refill. The bytes before the refill are not the forward's (they are
    // fresh memory): saving them would hand the replay garbage (test_distributed.py::test_fsdp2[full], NaN
    // gradients). A write into a storage whose allocation changed since it was watched is therefore not saved and
    // not counted: the replay reads the bytes as they are after it, as plain autograd does. Writes saved before the
    // change belong to the old allocation and can no longer be restored: the entry refuses (ReplayContractError).
    if (e.count > 0 && !e.broken) {
      e.refuse("the storage was reallocated (resized) after " + std::to_string(e.count) +
               (e.mode == PreserveMode::kOff ? " write(s) (counted, not saved: preserve=\"off\")" : " saved write(s)") +
               ", by code no operator call shows (e.g. untyped_storage().resize_())");
    }
    e.refilling = true;
    e.refill_unknown = false;
    e.refilled.clear();
  }
  e.nbytes = nbytes;
  e.data = data;
  hold(e, s);  // lets go of the old hold; the new allocation's free is seen too (a second microbatch)
  return true;
}

void WriteWatcher::hold(Entry& e, c10::StorageImpl& s) {
  hold_allocation(e, s);
  if (e.held == nullptr && !e.checked) {  // not holdable: block boundaries check it (check_allocations)
    e.checked = true;
    unheld_.push_back(&e);
  }
}

void WriteWatcher::check_allocations() noexcept {
  // Only the storages not held when first watched: a held one's reallocation frees what is held, which its next
  // write sees (save()).
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < unheld_.size(); ++i) {  // by index: allocation_changed() may append
    Entry* e = unheld_[i];
    if (!e->storage) continue;
    c10::intrusive_ptr<c10::StorageImpl> s = e->storage->lock();
    if (!s) continue;
    try {
      allocation_changed(*e, *s);
    } catch (const std::exception&) {
      // Only holding the new allocation can fail (out of host memory): its free is then seen at boundaries only.
    }
  }
}

bool WriteWatcher::refills(Entry& e, const char* op, size_t arg, const at::Tensor& target, bool first) {
  // Note [a storage reallocated unseen], refilled in pieces: FSDP2 copies a parameter back in one write, but a refill
  // shard by shard writes several; saving the later ones restored their bytes before the write — fresh memory — for
  // the replay (silently different gradients). A write into bytes not written since the reallocation refills them: not
  // saved, not counted, read by the replay as they are (as plain autograd reads them). A write of refilled bytes is a
  // write (saved). A write that mixes both, or one whose bytes cannot be told while the refill is unfinished, makes the
  // storage's replays refuse (ReplayContractError).
  const auto span = dense_bytes(target, region_kind(op, arg));
  if (!span.has_value() || e.refill_unknown) {
    if (first) {
      e.refill_unknown = true;
      return true;
    }
    e.refuse(std::string(kReallocatedUnseen) + "refilled by writes whose bytes tapesac cannot tell apart (" + op + ")");
    return false;
  }
  const auto [lo, hi] = *span;
  const int64_t seen = covered_bytes(e.refilled, lo, hi);
  if (seen == hi - lo && hi > lo) return false;  // refilled bytes written again: a write
  if (seen > 0) {
    e.refuse(std::string(kReallocatedUnseen) + op + " wrote bytes partly refilled since, partly not");
    return false;
  }
  add_range(e.refilled, lo, hi);
  if (covered_bytes(e.refilled, 0, e.nbytes) >= e.nbytes) e.refilling = false;
  return true;
}

WriteWatcher::WriteWatcher(PreserveMode mode, std::unordered_map<const void*, PreserveMode> overrides)
    : mode_(mode), overrides_(std::move(overrides)) {}

WriteWatcher::~WriteWatcher() { end(); }

void WriteWatcher::attach() {
  // The recorders' choice of hook (Note [Dispatch hook]) is the watcher's too.
  hooked_ = capture::resolve_recorder_hook(capture::RecorderHook::kDefault) == capture::RecorderHook::kDispatchKey;
  if (hooked_) {
    capture::dispatch_hook::attach(this);
  } else {
    callback_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&WriteWatcher::on_enter, &WriteWatcher::on_exit).needsInputs(true).scopes(
            {at::RecordScope::FUNCTION}));
  }
  attached_ = true;
  t_watcher = this;
  depth_ = 0;
  paused_ = false;
}

void WriteWatcher::install() {
  if (attached_) return;
  if (t_watcher != nullptr) return;  // another session's step watches this thread: replays it cannot cover reject
  owner_ = std::this_thread::get_id();
  attach();
}

void WriteWatcher::resume() {
  if (!paused_ || std::this_thread::get_id() != owner_) return;
  if (attached_) {
    paused_ = false;  // paused from another thread: the callback is still attached
  } else if (t_watcher == nullptr) {
    attach();
  }
}

void WriteWatcher::detach() noexcept {
  if (hooked_) {
    capture::dispatch_hook::detach(this);
  } else {
    at::removeCallback(callback_);
    callback_ = 0;
  }
  attached_ = false;
}

void WriteWatcher::pause() noexcept {
  paused_ = true;
  if (attached_ && std::this_thread::get_id() == owner_) {
    detach();
    if (t_watcher == this) t_watcher = nullptr;
  }
}

void WriteWatcher::end() noexcept {
  if (attached_) detach();
  if (t_watcher == this) t_watcher = nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, e] : entries_) release_allocation(*e);
  probes_after_.clear();
  unheld_.clear();
  entries_.clear();
  dropped_.clear();
  written_dropped_.clear();
}

bool WriteWatcher::kept_written(const void* key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return written_dropped_.count(key) > 0;
}

void WriteWatcher::keep_if_written(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return;
  std::lock_guard<std::mutex> lock(mu_);
  dropped_.emplace(capture::storage_key(t), t.storage().getWeakStorageImpl());
}

std::unique_ptr<at::ObserverContext> WriteWatcher::on_enter(const at::RecordFunction& fn) {
  WriteWatcher* w = t_watcher;
  if (w == nullptr || w->paused_.load(std::memory_order_relaxed)) return nullptr;
  // Named regions that are not operator calls are transparent: autograd wraps every node of the backward in one
  // ("autograd::engine::evaluate_function: ..."), and a write from a tensor hook runs inside it.
  if (!w->operator_call(fn)) return nullptr;
  // Only calls made from user code (depth 0) write "for real": the children of an in-place op are its kernel.
  if (w->depth_ == 0 && !w->busy_) w->see(fn.name(), fn.inputs(), [&fn] { return fn.operator_name(); });
  ++w->depth_;
  return nullptr;
}

bool WriteWatcher::on_call_enter(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int depth) noexcept {
  // Only calls made from user code (depth 0) write "for real" (see on_enter). The hook runs this with itself
  // excluded, so what see() dispatches is not seen again.
  if (depth != 0 || busy_ || paused_.load(std::memory_order_relaxed)) return false;
  try {
    see(op.schema().name().c_str(), args, [&op] { return std::optional<c10::OperatorName>(op.operator_name()); });
  } catch (const std::exception&) {
    // see() marks the entry it failed on as broken (its replays refuse); anything else failed before a write was
    // attributed to a watched storage.
  }
  return false;
}

void WriteWatcher::on_call_exit(const c10::OperatorHandle& /*op*/, c10::ArrayRef<c10::IValue> /*returns*/) noexcept {
  if (!probes_after_.empty()) check_probes();
}

void WriteWatcher::check_probes() noexcept {
  // Note [a storage reallocated unseen], refilled with other bytes: FSDP2 gives a parameter its bytes back; a refill
  // with others (zeros, a scaled copy) was read by the replay silently — plain autograd reads it only where it saved
  // the tensor itself (an adversarial test: a buffer only a replay reads, gradients off by 6.4). Compared when the
  // call that refilled them has run, for every storage it refilled (FSDP2's split_with_sizes_copy refills all of a
  // block's parameters in one call), on the samples inside the refilled bytes (a flat buffer's gaps stay unwritten).
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PendingProbe> pending;
  pending.swap(probes_after_);
  for (const PendingProbe& p : pending) {
    Entry& e = *p.entry;
    c10::intrusive_ptr<c10::StorageImpl> s = e.storage ? e.storage->lock() : nullptr;
    std::array<uint64_t, 3> now{};
    if (!s || !e.unfilled.empty() || !read_probe(*s, now)) continue;
    const std::array<int64_t, 3> at = probe_offsets(static_cast<int64_t>(s->nbytes()));
    for (size_t k = 0; k < 3; ++k) {
      if (at[k] >= p.lo && at[k] + 8 <= p.hi && now[k] != e.probe[k]) {
        e.unfilled = std::string(kReallocatedUnseen) + "refilled with other bytes than the forward's (the 8 bytes at " +
                     "offset " + std::to_string(at[k]) + " differ)";
        break;
      }
    }
  }
}

void WriteWatcher::on_exit(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  WriteWatcher* w = t_watcher;
  if (w == nullptr || !w->operator_call(fn)) return;  // not counted on entry
  if (w->depth_ > 0) --w->depth_;
  if (w->depth_ == 0 && !w->probes_after_.empty()) w->check_probes();
}

bool WriteWatcher::operator_call(const at::RecordFunction& fn) {
  // Note [Operator calls by name]: every call on the thread passes here twice, and RecordFunction::operator_name()
  // copies the operator's name and overload into strings each time. An operator call's name() is its schema's name
  // string, alive (at one address) while the operator is registered, so that address identifies an operator; a
  // named region's name() is a string of its own RecordFunction (its address is reused), so only operators are
  // cached. Entry and exit of one call answer alike: the cache only grows.
  const char* name = fn.name();
  if (operator_names_.count(name) != 0) return true;
  if (!fn.operator_name().has_value()) return false;
  operator_names_.insert(name);
  return true;
}

void WriteWatcher::see(const char* name, c10::ArrayRef<c10::IValue> inputs,
                       const std::function<std::optional<c10::OperatorName>()>& operator_name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.empty() && dropped_.empty()) return;
  auto it = writes_by_name_.find(name);
  if (it == writes_by_name_.end()) {
    std::vector<bool> writes;
    if (auto op = operator_name(); op.has_value()) {
      if (const capture::OpInfo* info = capture::op_info(*op)) writes = info->writes_arg;
    }
    it = writes_by_name_.emplace(name, std::move(writes)).first;
  }
  const std::vector<bool>& writes = it->second;
  if (writes.empty()) return;
  for (size_t a = 0; a < writes.size() && a < inputs.size(); ++a) {
    if (!writes[a]) continue;
    auto visit = [&](const at::Tensor& t) {
      if (!t.defined() || !t.has_storage()) return;
      const void* key = capture::storage_key(t);
      if (auto d = dropped_.find(key); d != dropped_.end()) {  // keep_if_written()
        if (c10::intrusive_ptr<c10::StorageImpl> impl = d->second.lock()) {
          written_dropped_.emplace(key, c10::Storage(std::move(impl)));
        }
        dropped_.erase(d);
      }
      auto e = entries_.find(key);
      if (e != entries_.end()) save(*e->second, name, inputs, a, t);
    };
    const c10::IValue& v = inputs[a];
    if (v.isTensor()) {
      visit(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) visit(t);
    }
  }
}

WriteWatcher::Write WriteWatcher::region_write(const char* op, c10::ArrayRef<c10::IValue> inputs, size_t arg,
                                               const at::Tensor& target) {
  Write w;
  w.kind = region_kind(op, arg);
  w.offset = target.storage_offset();
  w.sizes = target.sizes().vec();
  w.strides = target.strides().vec();
  w.dtype = target.scalar_type();
  try {
    switch (w.kind) {
      case RegionKind::kIndexPut:
        // Python's `b[:, idx] = v` passes an undefined tensor (a None) for each full slice before the index.
        for (const c10::IValue& i : inputs.at(1).toListRef()) {
          const bool index = i.isTensor() && i.toTensor().defined();
          w.indices.push_back(index ? std::optional<at::Tensor>(i.toTensor().clone()) : std::nullopt);
        }
        break;
      case RegionKind::kIndexDim: {
        w.dim = inputs.at(1).toInt();
        // index_fill_ accepts negative indices; index_select and index_copy_ (take and put) do not.
        const at::Tensor& index = inputs.at(2).toTensor();
        w.index = at::where(index < 0, index + target.size(w.dim), index);
        break;
      }
      case RegionKind::kScatter:
        w.dim = inputs.at(1).toInt();
        w.index = inputs.at(2).toTensor().clone();
        break;
      case RegionKind::kMasked:
        w.mask = inputs.at(1).toTensor().clone();
        break;
      case RegionKind::kView:
        break;
    }
    w.old = take(w, target);
  } catch (const std::exception&) {
    // Note [A region that cannot be indexed]: an index form the region save does not know (before 2026-12-07 the
    // two above refused every replay reading the storage, on every step: adversarial tests) saves the whole written
    // view instead, which holds every entry the write can touch.
    Write whole;
    whole.kind = RegionKind::kView;
    whole.offset = w.offset;
    whole.sizes = std::move(w.sizes);
    whole.strides = std::move(w.strides);
    whole.dtype = w.dtype;
    whole.old = take(whole, target);
    return whole;
  }
  return w;
}

int64_t WriteWatcher::held_bytes(const Write& w) {
  int64_t n = view_bytes(w.old) + view_bytes(w.index) + view_bytes(w.mask);
  for (size_t k = 0; k < w.indices.size(); ++k) {
    const std::optional<at::Tensor> i = w.indices.get(k);
    if (i.has_value()) n += view_bytes(*i);
  }
  return n;
}

void WriteWatcher::save(Entry& e, const std::string& op, c10::ArrayRef<c10::IValue> inputs, size_t arg,
                        const at::Tensor& target) {
  allocation_changed(e, *target.storage().unsafeGetStorageImpl());  // Note [a storage reallocated unseen]
  const bool first = e.refilled.empty() && !e.refill_unknown;
  // Under preserve="off" a refill is counted like any write after the forward (Note [Writes counted under
  // preserve="off"]): replays reading the storage refuse. The other modes let the replay read the refilled bytes, as
  // FSDP2's refill gives back the forward's; a refill with other bytes is read as it is (README: only
  // contract="strict" compares a replay's inputs with the forward's bytes).
  if (e.refilling) {
    const auto span = dense_bytes(target, region_kind(op.c_str(), arg));  // a strided or indexed refill: anywhere
    if (refills(e, op.c_str(), arg, target, first) && e.mode != PreserveMode::kOff) {
      // The refilled bytes are written once this call has run: their probe samples are compared then.
      if (e.probed) probes_after_.push_back({&e, span ? span->first : 0, span ? span->second : e.nbytes});
      return;
    }
  }
  const int64_t t0 = now_ns();
  const int64_t held_before = e.stats.held_bytes;
  busy_ = true;
  try {
    QuietScope quiet;
    if (e.mode == PreserveMode::kOff) {
      // Note [Writes counted under preserve="off"]: nothing is saved, the write is only counted, so that a replay
      // reading the storage is rejected (restore() refuses) even when the write moved no version counter.
    } else if (e.mode == PreserveMode::kSnapshots) {
      // A reader needs the bytes as they are now, and no snapshot holds them yet.
      if (e.last_mark == e.count && (e.snapshots.empty() || e.snapshots.back().first != e.count)) {
        at::Tensor bytes = bytes_of_storage(target).clone();
        e.stats.held_bytes += view_bytes(bytes);
        e.snapshots.emplace_back(e.count, std::move(bytes));
      }
    } else if (!e.broken) {
      Write w = region_write(op.c_str(), inputs, arg, target);
      e.stats.held_bytes += held_bytes(w);
      e.writes.push_back(std::move(w));
    }
  } catch (const std::exception& ex) {
    e.refuse(std::string("saving the region of ") + op + " failed: " + ex.what());
  }
  busy_ = false;
  ++e.count;
  ++e.stats.writes;
  e.stats.save_ns += now_ns() - t0;
  e.stats.last_save_ns = t0;
  if (e.stats.held_bytes > held_before) e.stats.saves.emplace_back(t0, e.stats.held_bytes - held_before);
}

int64_t WriteWatcher::watch(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<Entry>& e = entries_[capture::storage_key(t)];
  if (!e) {
    e = std::make_unique<Entry>();
    auto o = overrides_.find(capture::storage_key(t));
    e->mode = o != overrides_.end() ? o->second : mode_;
    if (e->mode == PreserveMode::kOff) e->mode = mode_;
    e->nbytes = static_cast<int64_t>(t.storage().nbytes());
    e->data = t.storage().data();
    e->storage.emplace(t.storage().getWeakStorageImpl());
    e->stats.key = capture::storage_key(t);
    e->stats.nbytes = e->nbytes;
    c10::StorageImpl& impl = *t.storage().unsafeGetStorageImpl();
    e->cow = c10::impl::cow::is_cow_data_ptr(impl._mutable_data_ptr_no_checks());
    hold(*e, impl);  // Note [a storage reallocated unseen], seen freed
    e->probed = read_probe(impl, e->probe);
  }
  e->last_mark = e->count;
  return e->count;
}

WriteWatcher::Swap::~Swap() {
  // Forward order: each write's current entries go back, ending at the bytes the step left.
  try {
    QuietScope quiet;
    for (size_t k = 0; k < current_.size(); ++k) {
      const Write& w = *writes_[k];
      at::Tensor region = view_on(storage_, w.offset, w.sizes, w.strides, w.dtype);
      put(w, region, current_[k]);
    }
  } catch (...) {
    // Only an allocation can fail here (index tensors); the step's bytes would be lost: there is no safe recovery
    // short of aborting, which the runtime must not do. Left as the forward saw them (documented).
  }
}

WriteWatcher::Restored WriteWatcher::restore(const at::Tensor& t, int64_t mark, uint32_t version_delta,
                                             std::string* why) {
  std::unique_lock<std::mutex> lock(mu_);
  Restored out;
  auto it = entries_.find(capture::storage_key(t));
  if (it == entries_.end()) {
    *why = "its storage was not watched (preserve=\"off\", or the tensor was replaced)";
    return out;
  }
  Entry& e = *it->second;
  const int64_t seen = e.count - mark;
  if (static_cast<int64_t>(version_delta) > seen) {
    *why = "its version moved by " + std::to_string(version_delta) + " but the step's thread made only " +
           std::to_string(seen) +
           " in-place writes to it; the others happened on another thread, during the backward, or outside the "
           "dispatcher, where tapesac cannot save what they overwrite";
    return out;
  }
  if (e.broken) {
    *why = e.broken_why;
    return out;
  }
  if (e.mode == PreserveMode::kOff) {
    *why = "preserve=\"off\" saved nothing to undo the " + std::to_string(seen) + " write(s) it saw";
    return out;
  }
  const int64_t t0 = now_ns();
  QuietScope quiet;
  if (e.mode == PreserveMode::kSnapshots) {
    // Replay never writes the tensors it reads live (the pruning pass refuses ops that write external storages),
    // so the snapshot itself serves every replay: no copy.
    at::Tensor bytes;
    for (const auto& [seq, snap] : e.snapshots) {
      if (seq == mark) bytes = snap;
    }
    if (!bytes.defined()) {
      *why = "no snapshot holds its bytes as of the block's forward";
      return out;
    }
    out.copy = view_on(bytes, t.storage_offset(), t.sizes(), t.strides(), t.scalar_type());
  } else {
    // Swap the overwritten regions back in, newest write first, remembering what they hold now; the Swap puts
    // those back when the replay is done. Only the regions are copied, never the storage.
    lock.unlock();  // the swap lock orders replays; the entry is not written while the backward runs
    auto swap = std::unique_ptr<Swap>(new Swap(swap_mu_));
    swap->storage_ = bytes_of_storage(t);
    for (int64_t k = e.count - 1; k >= mark; --k) {
      const Write& w = e.writes.at(static_cast<size_t>(k));
      at::Tensor region = view_on(swap->storage_, w.offset, w.sizes, w.strides, w.dtype);
      swap->current_.insert(swap->current_.begin(), take(w, region));
      swap->writes_.insert(swap->writes_.begin(), &w);
      put(w, region, w.old);
    }
    out.swap = std::move(swap);
    lock.lock();
  }
  ++e.stats.restores;
  e.stats.restore_ns += now_ns() - t0;
  return out;
}

int64_t WriteWatcher::writes_since(const at::Tensor& t, int64_t mark, std::string* unfilled) {
  if (!t.defined() || !t.has_storage()) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(capture::storage_key(t));
  if (it == entries_.end()) return 0;
  Entry& e = *it->second;
  if (unfilled != nullptr && e.storage) {
    // Note [a storage reallocated unseen], read unfilled: bytes of a storage emptied since the forward and not
    // written since are the allocator's; a replay reading them computed from garbage (an adversarial test: a buffer
    // freed and reallocated between forward and backward, gradients off by 12.7; plain autograd never read it).
    if (c10::intrusive_ptr<c10::StorageImpl> s = e.storage->lock()) {
      try {
        allocation_changed(e, *s);
      } catch (const std::exception&) {
        // Only holding the new allocation can fail (out of host memory); what was seen stands.
      }
    }
    if (!e.unfilled.empty()) *unfilled = e.unfilled;
    if (e.refilling && !e.refill_unknown && t.numel() > 0) {
      // The bytes t reads, not the whole storage: a flat buffer's gaps are read by nobody.
      const auto [lo, hi] = spanned_bytes(t);
      const int64_t filled = covered_bytes(e.refilled, lo, hi);
      if (e.nbytes == 0 || filled < hi - lo) {
        *unfilled = std::string(kReallocatedUnseen) + "only " + std::to_string(filled) + " of the " +
                    std::to_string(hi - lo) + " bytes the replay reads were written since: the others are the " +
                    "allocator's, not the forward's";
      }
    }
  }
  return e.count - mark;
}

std::vector<PreservedStorage> WriteWatcher::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PreservedStorage> out;
  for (const auto& [key, e] : entries_) {
    if (e->stats.writes > 0) {
      out.push_back(e->stats);
      out.back().mode = e->mode;
    }
  }
  return out;
}

int64_t WriteWatcher::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [key, e] : entries_) n += e->stats.held_bytes;
  return n;
}

}  // namespace tapesac::replay
