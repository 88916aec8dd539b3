// PtrIndexMap: an open-addressing hash map from object addresses to int32 indices, for the recorder's identity
// maps (TensorImpl -> value, StorageImpl -> storage). Lookups and inserts happen on every recorded op, so it has
// no per-entry allocation (linear probing in one power-of-two table) and no erase. Torch-free; not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <utility>
#include <vector>

namespace tapesac::capture {

class PtrIndexMap {
 public:
  static constexpr int32_t kMissing = -1;

  /// The index stored for `key`, or kMissing.
  int32_t find(const void* key) const {
    if (slots_.empty()) return kMissing;
    for (size_t i = bucket(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.index;
      if (s.key == nullptr) return kMissing;
    }
  }

  /// Stores `index` for `key` (replacing an existing entry). Returns true when the key was new.
  bool assign(const void* key, int32_t index) {
    if ((size_ + 1) * 4 > slots_.size() * 3) grow();
    for (size_t i = bucket(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == key) {
        s.index = index;
        return false;
      }
      if (s.key == nullptr) {
        s.key = key;
        s.index = index;
        ++size_;
        return true;
      }
    }
  }

  /// Pre-sizes the table for `n` entries.
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap * 3 < n * 4) cap *= 2;
    if (cap > slots_.size()) rehash(cap);
  }

  void clear() {
    slots_.clear();
    slots_.shrink_to_fit();
    mask_ = 0;
    size_ = 0;
  }

  /// Empties the table and keeps its capacity (a recorder's scratch handed to the next recording).
  void reset() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    size_ = 0;
  }

  void swap(PtrIndexMap& other) noexcept {
    slots_.swap(other.slots_);
    std::swap(mask_, other.mask_);
    std::swap(size_, other.size_);
  }

  size_t size() const { return size_; }

 private:
  struct Slot {
    const void* key = nullptr;
    int32_t index = kMissing;
  };

  size_t bucket(const void* key) const {
    // Fibonacci hashing of the address (low bits are alignment zeros).
    const auto h = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(key)) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> 20) & mask_;
  }

  void grow() { rehash(slots_.empty() ? 16 : slots_.size() * 2); }

  void rehash(size_t cap) {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    size_ = 0;
    for (const Slot& s : old) {
      if (s.key != nullptr) assign(s.key, s.index);
    }
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace tapesac::capture
