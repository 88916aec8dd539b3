// The tapesac._C extension module: registration only. Import torch before this module (tapesac/__init__ does).
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/common/errors.h"

namespace py = pybind11;

namespace tapesac::python {

namespace {

struct ErrorClasses {
  py::handle generic, config, memory, contract, capture;
};
ErrorClasses g_errors;

void set_tapesac_error(const tapesac::Error& e) {
  py::handle cls = g_errors.generic;
  switch (e.kind()) {
    case ErrorKind::kConfig: cls = g_errors.config; break;
    case ErrorKind::kMemoryLimit: cls = g_errors.memory; break;
    case ErrorKind::kReplayContract: cls = g_errors.contract; break;
    case ErrorKind::kCapture: cls = g_errors.capture; break;
    case ErrorKind::kGeneric: break;
  }
  PyErr_SetString(cls.ptr(), e.what());
}

}  // namespace

void set_python_error(std::exception_ptr p) noexcept {
  try {
    std::rethrow_exception(p);
  } catch (const tapesac::Error& e) {
    set_tapesac_error(e);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "tapesac: an unknown C++ exception");
  }
}

void bind_errors(py::module_& m) {
  // The Python classes live in tapesac.errors so that users can catch them without the extension.
  py::module_ errors = py::module_::import("tapesac.errors");
  g_errors.generic = py::object(errors.attr("TapeSACError")).release();
  g_errors.config = py::object(errors.attr("ConfigError")).release();
  g_errors.memory = py::object(errors.attr("MemoryLimitError")).release();
  g_errors.contract = py::object(errors.attr("ReplayContractError")).release();
  g_errors.capture = py::object(errors.attr("CaptureError")).release();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tapesac::Error& e) {
      set_tapesac_error(e);
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
