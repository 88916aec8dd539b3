// CUPTI, loaded at run time: dlopen + dlsym of the few entry points the kernel timer uses, so the module imports
// where CUPTI is absent and binds to the copy torch already loaded (same SONAME, reference/cuda.md §C5, §D3).
//
// Contract: CuptiLibrary::load() never throws and never aborts; when the library or a symbol is missing, or its
// version is not CUPTI 13.x (the record structs used are CUDA 13.0's), it returns null and sets *why. A loaded
// library stays loaded for the process (dlclose of CUPTI while torch uses it is unsafe), so the table is valid
// forever. Loading does not initialise CUPTI or need a device. Thread-safe.
#pragma once

#include <string>

#include <cupti.h>

namespace tapesac::cuda {

/// The CUPTI entry points tapesac uses (signatures from the CUDA 13.0 headers).
struct CuptiApi {
  decltype(&cuptiGetVersion) get_version = nullptr;
  decltype(&cuptiGetResultString) get_result_string = nullptr;
  decltype(&cuptiSubscribe_v2) subscribe = nullptr;
  decltype(&cuptiUnsubscribe) unsubscribe = nullptr;
  decltype(&cuptiEnableCallback) enable_callback = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNumDroppedRecords) dropped_records = nullptr;
  decltype(&cuptiActivityPushExternalCorrelationId) push_external_id = nullptr;
  decltype(&cuptiActivityPopExternalCorrelationId) pop_external_id = nullptr;
  decltype(&cuptiGetGraphNodeId) graph_node_id = nullptr;
};

class CuptiLibrary {
 public:
  /// The library names tried by load_default(), in order.
  static constexpr const char* kDefaultNames[] = {"libcupti.so.13", "libcupti.so"};

  /// dlopen(`path`) and resolve every entry point of CuptiApi; null (and *why set, if given) on any failure.
  static const CuptiLibrary* load(const std::string& path, std::string* why);
  /// The first of kDefaultNames that loads; cached after the first call (also a failure).
  static const CuptiLibrary* load_default(std::string* why);

  const CuptiApi& api() const { return api_; }
  /// cuptiGetVersion() of the loaded library (e.g. 130001).
  uint32_t version() const { return version_; }
  const std::string& path() const { return path_; }
  /// "CUPTI_ERROR_..." text for a result code.
  std::string result_string(CUptiResult r) const;

 private:
  CuptiApi api_;
  uint32_t version_ = 0;
  std::string path_;
};

}  // namespace tapesac::cuda
