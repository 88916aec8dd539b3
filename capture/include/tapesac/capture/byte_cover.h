// ByteCover: the bytes of one storage that recorded ops have written since its last uninitialising write, as a set
// of disjoint byte intervals, so that the recorder can tell whether a read sees only bytes a recorded op wrote (see
// Note [Bytes no recorded op wrote] in tape.h). Torch-free: views are described by TensorMeta.
//
// Conservative by construction: a view with more than kMaxRuns separate runs of bytes (a very strided view) adds
// nothing when written and is not covered when read, unless it is dense (then it is one run). Wrongly answering
// "not covered" only keeps a tensor that could have been rebuilt; "covered" is answered only when it is true.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "tapesac/capture/tape.h"

namespace tapesac::capture {

class ByteCover {
 public:
  /// Most runs of bytes a view may have to be enumerated.
  static constexpr size_t kMaxRuns = 4096;

  /// The byte intervals [begin, end) that `view` spans, merged and sorted. Returns false when the view has more
  /// than `max_runs` runs (then `runs` is left empty). A view of zero elements spans nothing (true, no runs).
  static bool view_runs(const TensorMeta& view, std::vector<std::pair<int64_t, int64_t>>* runs,
                        size_t max_runs = kMaxRuns);

  /// Marks the bytes of `view` as written.
  void add(const TensorMeta& view);
  /// Marks [begin, end) as written.
  void add_range(int64_t begin, int64_t end);
  /// True when every byte of `view` is written.
  bool covers(const TensorMeta& view) const;
  /// True when every byte of [begin, end) is written.
  bool covers_range(int64_t begin, int64_t end) const;
  /// Nothing written.
  void clear() { runs_.clear(); }
  bool empty() const { return runs_.empty(); }
  /// Number of disjoint runs held (for tests).
  size_t size() const { return runs_.size(); }

 private:
  std::map<int64_t, int64_t> runs_;  // begin -> end; disjoint and not adjacent
};

}  // namespace tapesac::capture
