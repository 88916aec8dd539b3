// Registration functions of the _C module, one per C++ module (bind_<module>.cpp). Bindings only register: no logic.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

#include <pybind11/pybind11.h>

#include "tapesac/allocator/telemetry.h"

namespace tapesac::replay {
class Session;
}  // namespace tapesac::replay

namespace tapesac::python {

void bind_errors(pybind11::module_& m);
/// Sets the Python error for a C++ exception as the module's translator would (tapesac::Error -> tapesac.errors'
/// classes, error_already_set restored, other std::exception -> RuntimeError), for functions bound without pybind11.
void set_python_error(std::exception_ptr p) noexcept;
void bind_capture(pybind11::module_& m);
void bind_replay(pybind11::module_& m);
/// The Session's saved_tensor_hooks() and the switch of Note [Saved tensors without Python] (saved_hooks.cpp).
void bind_saved_hooks(pybind11::module_& m, pybind11::class_<replay::Session>& session);
void bind_allocator(pybind11::module_& m);
void bind_runtime(pybind11::module_& m);
void bind_stats(pybind11::module_& m);
/// The Session's methods that return the last step's results (bind_stats.cpp).
void bind_session_results(pybind11::class_<replay::Session>& c);

/// {current, peak, allocated, allocations} of a gauge.
pybind11::dict gauge_to_dict(const allocator::Gauge& g);

/// The Python object of a scalar field (statistics, plans): one conversion for every binding's field loop.
inline pybind11::object to_py(int64_t v) { return pybind11::int_(v); }
inline pybind11::object to_py(double v) { return pybind11::float_(v); }
inline pybind11::object to_py(bool v) { return pybind11::bool_(v); }
inline pybind11::object to_py(const std::string& v) { return pybind11::str(v); }

}  // namespace tapesac::python
