// Moved to tapesac/common/fnv.h; this forwarding header goes once every include is switched.
#pragma once

#include "tapesac/common/fnv.h"

namespace tapesac::replay {
using common::Fnv64;
}  // namespace tapesac::replay
