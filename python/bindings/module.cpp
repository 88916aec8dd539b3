// The tapesac._C extension module: registration only. Import torch before this module (tapesac/__init__ does).
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/common/errors.h"

namespace py = pybind11;

namespace tapesac::python {

void bind_errors(py::module_& m) {
  // The Python classes live in tapesac.errors so that users can catch them without the extension.
  py::module_ errors = py::module_::import("tapesac.errors");
  static py::handle generic = py::object(errors.attr("TapeSACError")).release();
  static py::handle config = py::object(errors.attr("ConfigError")).release();
  static py::handle memory = py::object(errors.attr("MemoryLimitError")).release();
  static py::handle contract = py::object(errors.attr("ReplayContractError")).release();
  static py::handle capture = py::object(errors.attr("CaptureError")).release();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tapesac::Error& e) {
      py::handle cls = generic;
      switch (e.kind()) {
        case ErrorKind::kConfig: cls = config; break;
        case ErrorKind::kMemoryLimit: cls = memory; break;
        case ErrorKind::kReplayContract: cls = contract; break;
        case ErrorKind::kCapture: cls = capture; break;
        case ErrorKind::kGeneric: break;
      }
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
  (void)m;
}

}  // namespace tapesac::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "tapesac C++ runtime (recorder, pruning, replay)";
  tapesac::python::bind_errors(m);
  tapesac::python::bind_capture(m);
  tapesac::python::bind_replay(m);
  tapesac::python::bind_allocator(m);
  tapesac::python::bind_runtime(m);
  tapesac::python::bind_stats(m);
#ifdef TAPESAC_WITH_CUDA
  m.attr("has_cuda_backend") = true;
#else
  m.attr("has_cuda_backend") = false;
#endif
}
