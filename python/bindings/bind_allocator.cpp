// Bindings of allocator/: MemoryMeter (allocator/meter.h, behind tapesac.MemoryMeter), the conversion of gauges to
// Python objects, byte formatting, and the CUDA device's memory figures and graph device (GPU builds).
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/allocator/limit.h"
#include "tapesac/allocator/meter.h"
#include "tapesac/allocator/telemetry.h"
#include "tapesac/common/bytes.h"
#include "tapesac/common/errors.h"
#ifdef TAPESAC_WITH_CUDA
#include "tapesac/cuda/arena.h"
#include "tapesac/cuda/graph_device.h"
#endif

namespace py = pybind11;

namespace tapesac::python {

py::dict gauge_to_dict(const allocator::Gauge& g) {
  py::dict d;
  d["current"] = g.current;
  d["peak"] = g.peak;
  d["allocated"] = g.allocated;
  d["allocations"] = g.allocations;
  return d;
}

void bind_allocator(py::module_& m) {
  py::class_<allocator::MemoryMeter>(m, "MemoryMeter")
      .def(py::init<>())
      .def("start", &allocator::MemoryMeter::start)
      .def("stop", &allocator::MemoryMeter::stop)
      .def("gauge", [](const allocator::MemoryMeter& mm) { return gauge_to_dict(mm.gauge()); });
  m.def("counting_allocator_installed", &allocator::CountingAllocatorUse::installed,
        "Whether tapesac's counting layer is torch's CPU allocator now.");
  m.def("format_bytes", &common::format_bytes);
  m.def(
      "device_memory",
      [](int device) {
#ifdef TAPESAC_WITH_CUDA
        const auto dm = cuda::device_memory(device);
        py::dict d;
        d["allocated_current"] = dm.allocated_current;
        d["allocated_peak"] = dm.allocated_peak;
        d["reserved_current"] = dm.reserved_current;
        d["reserved_peak"] = dm.reserved_peak;
        return py::object(d);
#else
        (void)device;
        return py::object(py::none());
#endif
      },
      py::arg("device"), "The caching allocator's aggregate byte statistics of a CUDA device (None without CUDA).");
#ifdef TAPESAC_WITH_CUDA
  m.def(
      "cuda_graph_device",
      [](int device, std::pair<uint64_t, uint64_t> pool, bool map_nodes) -> std::shared_ptr<capture::GraphDevice> {
        return cuda::make_cuda_graph_device(device, pool.first, pool.second, map_nodes);
      },
      py::arg("device"), py::arg("pool"), py::arg("map_nodes") = true,
      "The CUDA-graph device of the graph replayer on CUDA device `device`, capturing into the memory pool `pool` "
      "(a MemPool id tuple; (0, 0): a private pool per capture). map_nodes: map each graph's executable nodes to "
      "tape ops at instantiation (CUPTI), so that launches can be timed per op. Raises ConfigError for a device "
      "index outside the visible devices.");
#endif
}

}  // namespace tapesac::python
