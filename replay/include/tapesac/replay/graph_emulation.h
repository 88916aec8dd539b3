// An executable graph emulated with eager ops over static tensors: the capture records each op's boxed arguments
// (tensors included) and its outputs; a launch re-runs the enabled ops in capture order on those same tensors and
// copies every result into the output recorded at capture, so values live at fixed addresses and a disabled node
// leaves its outputs' bytes as the previous launch left them — what a CUDA graph does. Random ops draw from the
// generator state the replayed call's forward recorded (the CUDA device gets the same effect from the graph's
// Philox base offset). Nodes: one leading empty node that no op owns (real captures have such nodes), then one
// kernel node per op. A timed launch (GraphDevice::time_launch) charges each enabled node's run to its op on the CPU
// clock.
//
// It runs on any device and exists to test the graph replayer end to end where there is no GPU; it is slower
// than eager replay (one extra copy per output) and is selected explicitly (TapeSAC(backend="emulated_graph")).
#pragma once

#include <memory>
#include <optional>

#include "tapesac/capture/graph_device.h"

namespace tapesac::replay {

/// `graph_device_type`: none (default) runs any op on any device; a type makes the emulation act as a graph bound to
/// that device type (GraphDevice::graph_device_type()), so the replayer's device checks can be exercised on CPU.
std::shared_ptr<capture::GraphDevice> make_emulated_graph_device(
    std::optional<c10::DeviceType> graph_device_type = std::nullopt);

}  // namespace tapesac::replay
