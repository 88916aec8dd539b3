// Process-wide table of op kinds: a small integer per distinct operator overload, so tape records stay compact and
// torch-free. Thread-safe; ids are never reused or removed.
#pragma once

#include <string>

#include "tapesac/capture/tape.h"

namespace tapesac::capture {

/// Returns the id of `qualified_name` ("aten::add.Tensor", "aten::mm"), adding it on first use. Thread-safe.
OpKind intern_op_kind(const std::string& qualified_name);

/// The name interned as `kind`. Throws std::out_of_range for an id never returned by intern_op_kind.
const std::string& op_kind_name(OpKind kind);

}  // namespace tapesac::capture
