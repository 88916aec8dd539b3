// Bindings of capture/: recording an op sequence for inspection (record_ops), used by tests and benchmarks.
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/common/errors.h"
#include "tapesac/capture/op_kinds.h"
#include "tapesac/capture/recorder.h"

namespace py = pybind11;

namespace tapesac::python {

void bind_capture(py::module_& m) {
  m.def(
      "record_ops",
      [](const py::function& fn, const py::args& args, const py::kwargs& kwargs) {
        capture::Recorder recorder;
        recorder.start();
        try {
          fn(*args, **kwargs);
        } catch (...) {
          recorder.stop();
          throw;
        }
        recorder.stop();
        TAPESAC_CHECK(recorder.error().empty(), kCapture, "tapesac: ", recorder.error());
        std::vector<std::string> names;
        for (const capture::OpRecord& op : recorder.tape().ops()) names.push_back(capture::op_kind_name(op.kind));
        return names;
      },
      py::arg("fn"),
      "Runs fn(*args, **kwargs) with the recorder active on this thread and returns the recorded op names.");
}

}  // namespace tapesac::python
