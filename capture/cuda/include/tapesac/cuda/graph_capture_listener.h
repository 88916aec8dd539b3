// The integration point between the recorder and the graph capture: a RecorderListener that forwards each
// recorded op to the listener the session already installed, then attributes the graph nodes the op launched.
//
// Contract: while a block's forward is being captured, install it with recorder.set_listener(&listener) in place of
// `inner` (the session), and restore `inner` afterwards. on_op_recorded runs on the recording thread right after the
// op was appended to the tape, so the nodes added since the previous op belong to it. Borrows both pointers.
// Not yet used by the session (README "GPU backend").
#pragma once

#include "tapesac/capture/recorder.h"
#include "tapesac/cuda/graph_capture.h"

namespace tapesac::cuda {

class GraphCaptureListener final : public capture::RecorderListener {
 public:
  GraphCaptureListener(GraphCapture& capture, capture::RecorderListener* inner) : capture_(&capture), inner_(inner) {}

  void on_op_recorded(capture::Recorder& recorder, capture::OpIndex op) override {
    if (inner_ != nullptr) inner_->on_op_recorded(recorder, op);
    capture_->after_op(op);
  }

 private:
  GraphCapture* capture_;
  capture::RecorderListener* inner_;
};

}  // namespace tapesac::cuda
