// TEMPORARY (branch gpudev, until merged with the graph-replay branch): registers capture::GraphDevice so that
// tapesac._C.cuda_graph_device (bind_allocator.cpp) can return one. The graph-replay branch registers the same class
// in bind_replay.cpp; on merge, delete this file and its call in module.cpp.
#include <memory>

#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/capture/graph_device.h"

namespace py = pybind11;

namespace tapesac::python {

void bind_graph_device(py::module_& m) {
  py::class_<capture::GraphDevice, std::shared_ptr<capture::GraphDevice>>(m, "GraphDevice")
      .def_property_readonly("name", [](const capture::GraphDevice& d) { return std::string(d.name()); });
}

}  // namespace tapesac::python
