// Tape mutators and the debug dump (see tape.h for the model).
#include "tapesac/capture/tape.h"

#include <sstream>
#include <stdexcept>

#include "tapesac/capture/op_kinds.h"

namespace tapesac::capture {

StorageId Tape::add_storage(bool external, int64_t nbytes) {
  StorageInfo s;
  s.external = external;
  s.nbytes = nbytes;
  storages_.push_back(std::move(s));
  return static_cast<StorageId>(storages_.size() - 1);
}

ValueId Tape::add_external_value(StorageId storage, TensorMeta meta) {
  ValueInfo v;
  v.storage = storage;
  v.producer = kExternal;
  v.state = state_of(storage);
  v.meta = std::move(meta);
  values_.push_back(std::move(v));
  return static_cast<ValueId>(values_.size() - 1);
}

ValueId Tape::add_output_value(StorageId storage, int32_t state, TensorMeta meta) {
  (void)this->storage(storage);  // bounds check
  ValueInfo v;
  v.storage = storage;
  v.producer = next_op_index();
  v.state = state;
  v.meta = std::move(meta);
  values_.push_back(std::move(v));
  return static_cast<ValueId>(values_.size() - 1);
}

OpIndex Tape::add_op(OpRecord op) {
  const OpIndex index = next_op_index();
  // Validate everything before changing anything, so a rejected op leaves the tape as it was.
  for (StorageId s : op.writes) {
    if (s < 0 || static_cast<size_t>(s) >= storages_.size()) {
      throw std::out_of_range("tapesac: op writes unknown storage " + std::to_string(s));
    }
  }
  for (const ArgRef& a : op.inputs) {
    if (a.value < 0 || static_cast<size_t>(a.value) >= values_.size()) {
      throw std::out_of_range("tapesac: op reads unknown value " + std::to_string(a.value));
    }
  }
  for (StorageId s : op.writes) {
    auto& writers = storages_[static_cast<size_t>(s)].writers;
    if (writers.empty() || writers.back() != index) writers.push_back(index);
  }
  ops_.push_back(std::move(op));
  return index;
}

std::string Tape::to_string() const {
  std::ostringstream os;
  for (size_t i = 0; i < ops_.size(); ++i) {
    const OpRecord& op = ops_[i];
    os << i << ": ";
    for (size_t j = 0; j < op.outputs.size(); ++j) os << (j ? "," : "") << "v" << op.outputs[j];
    os << " = " << (op.kind >= 0 ? op_kind_name(op.kind) : std::string("?")) << "(";
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      const ArgRef& a = op.inputs[j];
      os << (j ? ", " : "") << "v" << a.value << "@s" << values_[static_cast<size_t>(a.value)].storage << ":" << a.state;
    }
    os << ")";
    if (!op.writes.empty()) {
      os << " writes";
      for (StorageId s : op.writes) os << " s" << s;
    }
    if (op.flags) os << " flags=" << op.flags;
    os << "\n";
  }
  return os.str();
}

void Tape::set_op_times(OpTiming source, const std::vector<int64_t>& ns) {
  if (ns.size() != ops_.size()) {
    throw std::invalid_argument("Tape::set_op_times: expected " + std::to_string(ops_.size()) + " op times, got " +
                                std::to_string(ns.size()));
  }
  for (size_t i = 0; i < ns.size(); ++i) ops_[i].duration_ns = ns[i];
  op_timing_ = source;
}

}  // namespace tapesac::capture
