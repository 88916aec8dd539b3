// Process-wide op-kind table (see op_kinds.h).
#include "tapesac/capture/op_kinds.h"

#include <deque>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace tapesac::capture {
namespace {

struct Table {
  std::mutex mu;
  std::unordered_map<std::string, OpKind> ids;
  // deque: references handed out by op_kind_name stay valid while the table grows.
  std::deque<std::string> names;
};

Table& table() {
  static Table* t = new Table();  // leaked on purpose: used from thread-local destructors at exit
  return *t;
}

}  // namespace

OpKind intern_op_kind(const std::string& qualified_name) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.ids.find(qualified_name);
  if (it != t.ids.end()) return it->second;
  const auto id = static_cast<OpKind>(t.names.size());
  t.names.push_back(qualified_name);
  t.ids.emplace(qualified_name, id);
  return id;
}

const std::string& op_kind_name(OpKind kind) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  if (kind < 0 || static_cast<size_t>(kind) >= t.names.size()) {
    throw std::out_of_range("tapesac: unknown op kind " + std::to_string(kind));
  }
  return t.names[static_cast<size_t>(kind)];
}

}  // namespace tapesac::capture
