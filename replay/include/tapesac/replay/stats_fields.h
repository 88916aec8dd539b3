// The machinery of statistics defined once (Note [Statistics defined once]).
//
// Note [Statistics defined once]. Every statistic tapesac reports per block call is one line of a field list
// (TAPESAC_BLOCK_STATS_FIELDS in block_stats.h, TAPESAC_APPROX_STATS_FIELDS in approx_stats.h):
//     X(type, name, combine, "what it means")
// The list generates the C++ struct members, a visitor over them (for_each_block_field), the step totals (the sum
// of the kSum fields, the largest of the kMax fields, replay/step_summary.h), the dict the bindings hand to Python (one generic loop) and the
// schema from which the Python package builds its BlockStats/StepStats dataclasses and their docstrings
// (tapesac/stats.py). Units are part of the name:
// `_ns` fields are nanoseconds in C++ and become `_ms` (milliseconds, float) in Python — the only conversion
// (stats.py's table). Adding a counter is one line here plus where it is counted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tapesac::replay {

/// How a step combines a block-call field over its block calls.
enum class Combine : uint8_t {
  kSum,   ///< the step reports the sum
  kMax,   ///< the step reports the largest
  kNone,  ///< per block call only
};

/// "sum", "max" or "" (the schema's name of a Combine).
constexpr const char* combine_name(Combine c) {
  return c == Combine::kSum ? "sum" : c == Combine::kMax ? "max" : "";
}

/// One op's time in a timed graph launch: its tape index, its op name, nanoseconds.
struct OpTime {
  int64_t op = 0;
  std::string name;
  int64_t ns = 0;
};
using OpTimes = std::vector<OpTime>;

/// The static description of one field, for the schema Python reads.
struct FieldInfo {
  const char* name;
  const char* type;  // "int", "bool", "str", "op_times"
  Combine combine;
  const char* doc;
};

template <class T>
constexpr const char* stats_type_name();
template <>
constexpr const char* stats_type_name<int64_t>() { return "int"; }
template <>
constexpr const char* stats_type_name<bool>() { return "bool"; }
template <>
constexpr const char* stats_type_name<std::string>() { return "str"; }
template <>
constexpr const char* stats_type_name<OpTimes>() { return "op_times"; }

}  // namespace tapesac::replay

/// Declares a field of a stats struct with its zero value.
#define TAPESAC_STATS_DECLARE(type, name, combine, doc) type name{};
