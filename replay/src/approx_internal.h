// Internal to approximate rematerialization: what the preparation (approx_prepare.cpp) uses of the tape matching
// (approx_match.cpp) beyond approx.h.
#pragma once

#include "tapesac/capture/tape.h"

namespace tapesac::replay {

/// True when `op` is aten::addmm (bias, mat1, mat2, beta, alpha) rather than aten::mm: the approximate projection
/// then slices the bias too (BlockApprox::run).
bool is_addmm(const capture::OpRecord& op);

}  // namespace tapesac::replay
