// Moved to tapesac/common/errors.h; this forwarding header goes once every include is switched.
#pragma once
#include "tapesac/common/errors.h"
