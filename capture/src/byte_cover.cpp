// ByteCover (see byte_cover.h).
#include "tapesac/capture/byte_cover.h"

#include <algorithm>
#include <iterator>

namespace tapesac::capture {
namespace {

struct Dim {
  int64_t size = 0;
  int64_t stride = 0;
};

// The element geometry of a view: bytes per element and the dims that move the offset (size > 1, stride != 0),
// innermost (smallest stride) first. False when it cannot be known (no strides: a non-strided layout).
bool geometry(const TensorMeta& v, int64_t* itemsize, std::vector<Dim>* dims, bool* no_elements) {
  int64_t numel = 1;
  for (int64_t s : v.sizes) numel *= s;
  *no_elements = numel == 0;
  if (*no_elements) return true;
  if (v.strides.size() != v.sizes.size() || v.nbytes <= 0 || v.nbytes % numel != 0) return false;
  *itemsize = v.nbytes / numel;
  dims->clear();
  for (size_t i = 0; i < v.sizes.size(); ++i) {
    if (v.strides[i] < 0) return false;  // torch has no negative strides; refuse rather than guess
    if (v.sizes[i] > 1 && v.strides[i] != 0) dims->push_back(Dim{v.sizes[i], v.strides[i]});
  }
  std::sort(dims->begin(), dims->end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  return true;
}

}  // namespace

bool ByteCover::view_runs(const TensorMeta& view, std::vector<std::pair<int64_t, int64_t>>* runs, size_t max_runs) {
  runs->clear();
  int64_t itemsize = 0;
  std::vector<Dim> dims;
  bool no_elements = false;
  if (!geometry(view, &itemsize, &dims, &no_elements)) return false;
  if (no_elements) return true;
  // The innermost dims that continue each other contiguously form one run of `run` elements.
  int64_t run = 1;
  size_t k = 0;
  while (k < dims.size() && dims[k].stride == run) run *= dims[k++].size;
  size_t count = 1;
  for (size_t j = k; j < dims.size(); ++j) {
    if (static_cast<size_t>(dims[j].size) > max_runs / count) return false;
    count *= static_cast<size_t>(dims[j].size);
  }
  runs->reserve(count);
  std::vector<int64_t> index(dims.size(), 0);
  for (size_t n = 0; n < count; ++n) {
    int64_t offset = view.storage_offset;
    for (size_t j = k; j < dims.size(); ++j) offset += index[j] * dims[j].stride;
    runs->emplace_back(offset * itemsize, (offset + run) * itemsize);
    for (size_t j = k; j < dims.size(); ++j) {  // odometer over the outer dims
      if (++index[j] < dims[j].size) break;
      index[j] = 0;
    }
  }
  std::sort(runs->begin(), runs->end());
  size_t out = 0;
  for (size_t i = 0; i < runs->size(); ++i) {
    if (out > 0 && (*runs)[i].first <= (*runs)[out - 1].second) {
      (*runs)[out - 1].second = std::max((*runs)[out - 1].second, (*runs)[i].second);
    } else {
      (*runs)[out++] = (*runs)[i];
    }
  }
  runs->resize(out);
  return true;
}

void ByteCover::add_range(int64_t begin, int64_t end) {
  if (begin >= end) return;
  auto it = runs_.upper_bound(begin);
  if (it != runs_.begin()) {
    auto prev = std::prev(it);
    if (prev->second >= begin) {
      begin = prev->first;
      end = std::max(end, prev->second);
      it = runs_.erase(prev);
    }
  }
  while (it != runs_.end() && it->first <= end) {
    end = std::max(end, it->second);
    it = runs_.erase(it);
  }
  runs_.emplace(begin, end);
}

bool ByteCover::covers_range(int64_t begin, int64_t end) const {
  if (begin >= end) return true;
  auto it = runs_.upper_bound(begin);
  if (it == runs_.begin()) return false;
  --it;
  return it->second >= end;  // runs are merged: a covered range lies inside one run
}

void ByteCover::add(const TensorMeta& view) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  if (!view_runs(view, &runs)) return;  // too strided to enumerate: adds nothing (conservative)
  for (const auto& [b, e] : runs) add_range(b, e);
}

bool ByteCover::covers(const TensorMeta& view) const {
  int64_t itemsize = 0;
  std::vector<Dim> dims;
  bool no_elements = false;
  if (!geometry(view, &itemsize, &dims, &no_elements)) return false;
  if (no_elements) return true;
  // Fast path: the view's whole span [first byte, last byte] is covered.
  int64_t last = view.storage_offset;
  for (const Dim& d : dims) last += (d.size - 1) * d.stride;
  if (covers_range(view.storage_offset * itemsize, (last + 1) * itemsize)) return true;
  std::vector<std::pair<int64_t, int64_t>> runs;
  if (!view_runs(view, &runs)) return false;
  for (const auto& [b, e] : runs) {
    if (!covers_range(b, e)) return false;
  }
  return true;
}

}  // namespace tapesac::capture
