// Registration functions of the _C module, one per C++ module (bind_<module>.cpp). Bindings only register: no logic.
#pragma once

#include <pybind11/pybind11.h>

namespace tapesac::python {

void bind_errors(pybind11::module_& m);
void bind_capture(pybind11::module_& m);
void bind_replay(pybind11::module_& m);

}  // namespace tapesac::python
