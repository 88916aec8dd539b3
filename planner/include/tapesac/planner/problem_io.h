// A line-based, versioned text form of BlockProblem, so that real model tapes can be dumped to files and used as
// test fixtures. Format (version 1; blank lines and lines starting with '#' are ignored):
//
//   tapesac-plan-problem 1
//   signature <rest of the line>
//   values <N>
//   <bytes> <producer> <storage>                                          N lines, value ids 0..N-1
//   ops <M>
//   <cost_ns> <replayable 0|1> <name|-> <n_in> <in...> <n_out> <out...>     M lines, tape order
//   candidates <K>
//   <value> <must_keep 0|1>                                               K lines
//   end
//
// Costs are written with 17 significant digits, so a round trip is exact.
#pragma once

#include <istream>
#include <ostream>

#include "tapesac/planner/problem.h"

namespace tapesac::planner {

constexpr int kProblemFormatVersion = 1;

/// Writes `problem` (validated first; throws tapesac::Error kConfig when invalid or when an op name holds
/// whitespace).
void write_problem(std::ostream& out, const BlockProblem& problem);

/// Reads one problem written by write_problem and validates it. Throws tapesac::Error (kConfig) naming the line
/// on a syntax error, an unknown version or an invalid problem.
BlockProblem read_problem(std::istream& in);

}  // namespace tapesac::planner
