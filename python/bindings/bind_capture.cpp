// Bindings of capture/: recording an op sequence for inspection (record_ops), used by tests and benchmarks.
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "tapesac/common/errors.h"
#include "tapesac/capture/dispatch_hook.h"
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
  m.def(
      "recorder_hook", [] { return std::string(capture::recorder_hook_name(capture::default_recorder_hook())); },
      "How recorders started from now on see operator calls: 'auto' (the dispatch hook when available), "
      "'dispatch_key' or 'record_function'.");
  m.def(
      "set_recorder_hook",
      [](const std::string& name) {
        try {
          const capture::RecorderHook hook = capture::parse_recorder_hook(name);
          TAPESAC_CHECK(hook != capture::RecorderHook::kDispatchKey || capture::dispatch_hook::available(), kConfig,
                        "tapesac: the dispatch hook is not available in this process (another library registered a "
                        "fallback on its dispatch key); use 'record_function' or 'auto'");
          capture::set_default_recorder_hook(hook);  // refuses 'default'
        } catch (const std::invalid_argument& e) {
          TAPESAC_CHECK(false, kConfig, e.what());
        }
      },
      py::arg("name"), "Sets recorder_hook() (tests and diagnostics).");
  m.def(
      "dispatch_hook_key", [] { return static_cast<int>(capture::dispatch_hook::kKey); },
      "The dispatch key the hook is registered on, as an integer (torch._C.DispatchKey(value) in Python).");
  m.def("dispatch_hook_available", &capture::dispatch_hook::available,
        "True when the dispatch hook could be registered (Note [Dispatch hook]).");
}

}  // namespace tapesac::python
