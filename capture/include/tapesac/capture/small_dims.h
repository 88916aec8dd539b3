// SmallDims: a list of int64 (sizes or strides) stored inline up to kInline entries, on the heap beyond. The
// recorder makes one TensorMeta per value on every op, so tensor metadata must not allocate in the common case.
// Torch-free; a value type with the small part of std::vector's interface the tape needs.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace tapesac::capture {

class SmallDims {
 public:
  static constexpr size_t kInline = 6;

  SmallDims() = default;
  SmallDims(std::initializer_list<int64_t> v) { assign(v.begin(), v.end()); }
  SmallDims& operator=(std::initializer_list<int64_t> v) {
    assign(v.begin(), v.end());
    return *this;
  }

  template <class It>
  void assign(It first, It last) {
    size_ = static_cast<size_t>(std::distance(first, last));
    if (size_ <= kInline) {
      heap_.clear();
      std::copy(first, last, inline_.begin());
    } else {
      heap_.assign(first, last);
    }
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const int64_t* data() const { return size_ <= kInline ? inline_.data() : heap_.data(); }
  const int64_t* begin() const { return data(); }
  const int64_t* end() const { return data() + size_; }
  int64_t operator[](size_t i) const { return data()[i]; }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(begin(), end()); }

  friend bool operator==(const SmallDims& a, const SmallDims& b) {
    return a.size_ == b.size_ && std::equal(a.begin(), a.end(), b.begin());
  }
  friend bool operator!=(const SmallDims& a, const SmallDims& b) { return !(a == b); }
  /// Compares with any contiguous range of int64 (e.g. at::IntArrayRef) without allocating.
  template <class Range>
  bool equals(const Range& r) const {
    return static_cast<size_t>(r.size()) == size_ && std::equal(begin(), end(), r.begin());
  }

 private:
  std::array<int64_t, kInline> inline_{};
  std::vector<int64_t> heap_;
  size_t size_ = 0;
};

}  // namespace tapesac::capture
