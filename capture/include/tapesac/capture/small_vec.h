// SmallVec<T, N>: a vector that keeps up to N elements inline and moves to the heap beyond. The recorder appends
// a few inputs, outputs and writes per op on every op of every step, so these lists must not allocate in the
// common case. Torch-free; supports the part of std::vector's interface the tape uses (T must be default
// constructible: unused inline slots hold default values).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <initializer_list>
#include <utility>
#include <vector>

namespace tapesac::capture {

template <class T, size_t N>
class SmallVec {
 public:
  using value_type = T;
  using iterator = T*;
  using const_iterator = const T*;

  SmallVec() = default;
  SmallVec(std::initializer_list<T> v) { assign(v.begin(), v.end()); }
  SmallVec(const std::vector<T>& v) { assign(v.begin(), v.end()); }  // NOLINT(google-explicit-constructor)
  SmallVec& operator=(std::initializer_list<T> v) {
    assign(v.begin(), v.end());
    return *this;
  }
  SmallVec& operator=(const std::vector<T>& v) {
    assign(v.begin(), v.end());
    return *this;
  }

  template <class It>
  void assign(It first, It last) {
    clear();
    for (; first != last; ++first) push_back(*first);
  }

  void push_back(const T& x) { emplace_back(x); }
  void push_back(T&& x) { emplace_back(std::move(x)); }
  template <class... Args>
  T& emplace_back(Args&&... args) {
    if (heap_.empty() && size_ < N) {
      inline_[size_] = T(std::forward<Args>(args)...);
      return inline_[size_++];
    }
    if (heap_.empty()) {
      heap_.reserve(2 * N + 2);
      for (size_t i = 0; i < size_; ++i) heap_.push_back(std::move(inline_[i]));
    }
    heap_.emplace_back(std::forward<Args>(args)...);
    ++size_;
    return heap_.back();
  }
  void reserve(size_t n) {
    if (n > N) heap_.reserve(n);
  }
  void clear() {
    for (size_t i = 0; i < std::min(size_, N); ++i) inline_[i] = T();
    heap_.clear();
    size_ = 0;
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* data() { return heap_.empty() ? inline_.data() : heap_.data(); }
  const T* data() const { return heap_.empty() ? inline_.data() : heap_.data(); }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T& back() { return data()[size_ - 1]; }
  const T& back() const { return data()[size_ - 1]; }

  operator std::vector<T>() const { return std::vector<T>(begin(), end()); }  // NOLINT(google-explicit-constructor)

  friend bool operator==(const SmallVec& a, const SmallVec& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  }
  friend bool operator==(const SmallVec& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  }
  friend bool operator==(const std::vector<T>& b, const SmallVec& a) { return a == b; }
  friend bool operator!=(const SmallVec& a, const SmallVec& b) { return !(a == b); }

 private:
  std::array<T, N> inline_{};
  std::vector<T> heap_;
  size_t size_ = 0;
};

}  // namespace tapesac::capture
