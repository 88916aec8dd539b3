// CuptiLibrary (see tapesac/cuda/cupti_loader.h).
#include "tapesac/cuda/cupti_loader.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>

namespace tapesac::cuda {

namespace {

template <typename Fn>
bool resolve(void* lib, const char* name, Fn& slot, std::string& missing) {
  slot = reinterpret_cast<Fn>(dlsym(lib, name));
  if (slot == nullptr) {
    if (!missing.empty()) missing += ", ";
    missing += name;
  }
  return slot != nullptr;
}

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

// Loaded libraries live for the process: dlclose of CUPTI while torch may use it is unsafe.
std::map<std::string, std::unique_ptr<CuptiLibrary>>& registry() {
  static auto* r = new std::map<std::string, std::unique_ptr<CuptiLibrary>>();
  return *r;
}

}  // namespace

const CuptiLibrary* CuptiLibrary::load(const std::string& path, std::string* why) {
  auto fail = [&](std::string msg) -> const CuptiLibrary* {
    if (why != nullptr) *why = std::move(msg);
    return nullptr;
  };
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (const auto it = registry().find(path); it != registry().end()) return it->second.get();
  // RTLD_NOLOAD first: bind to the copy torch (Kineto) already loaded when there is one.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    return fail("CUPTI unavailable: dlopen(\"" + path + "\") failed: " + (err != nullptr ? err : "unknown error") +
                "; kernel times fall back to CUDA events");
  }
  auto out = std::unique_ptr<CuptiLibrary>(new CuptiLibrary());
  CuptiApi& a = out->api_;
  std::string missing;
  resolve(lib, "cuptiGetVersion", a.get_version, missing);
  resolve(lib, "cuptiGetResultString", a.get_result_string, missing);
  resolve(lib, "cuptiSubscribe_v2", a.subscribe, missing);
  resolve(lib, "cuptiUnsubscribe", a.unsubscribe, missing);
  resolve(lib, "cuptiEnableCallback", a.enable_callback, missing);
  resolve(lib, "cuptiActivityRegisterCallbacks", a.register_callbacks, missing);
  resolve(lib, "cuptiActivityEnable", a.enable, missing);
  resolve(lib, "cuptiActivityDisable", a.disable, missing);
  resolve(lib, "cuptiActivityGetNextRecord", a.next_record, missing);
  resolve(lib, "cuptiActivityFlushAll", a.flush_all, missing);
  resolve(lib, "cuptiActivityGetNumDroppedRecords", a.dropped_records, missing);
  resolve(lib, "cuptiActivityPushExternalCorrelationId", a.push_external_id, missing);
  resolve(lib, "cuptiActivityPopExternalCorrelationId", a.pop_external_id, missing);
  resolve(lib, "cuptiGetGraphNodeId", a.graph_node_id, missing);
  if (!missing.empty()) {
    dlclose(lib);
    return fail("CUPTI unavailable: \"" + path + "\" lacks " + missing + "; expected CUPTI 13 (CUDA 13.0)");
  }
  uint32_t v = 0;
  if (a.get_version(&v) != CUPTI_SUCCESS || v / 100 != CUPTI_API_VERSION / 100) {
    dlclose(lib);
    return fail("CUPTI unavailable: \"" + path + "\" reports API version " + std::to_string(v) + ", expected " +
                std::to_string(CUPTI_API_VERSION / 100) + "xx (the activity records are read as CUDA 13.0's)");
  }
  out->version_ = v;
  out->path_ = path;
  const CuptiLibrary* raw = out.get();
  registry().emplace(path, std::move(out));
  return raw;
}

const CuptiLibrary* CuptiLibrary::load_default(std::string* why) {
  static std::once_flag once;
  static const CuptiLibrary* lib = nullptr;
  static std::string reason;
  std::call_once(once, [] {
    std::string all;
    for (const char* name : kDefaultNames) {
      std::string w;
      lib = load(name, &w);
      if (lib != nullptr) return;
      all += (all.empty() ? "" : " | ") + w;
    }
    reason = all;
  });
  if (lib == nullptr && why != nullptr) *why = reason;
  return lib;
}

std::string CuptiLibrary::result_string(CUptiResult r) const {
  const char* s = nullptr;
  if (api_.get_result_string != nullptr && api_.get_result_string(r, &s) == CUPTI_SUCCESS && s != nullptr) return s;
  return "CUptiResult " + std::to_string(static_cast<int>(r));
}

}  // namespace tapesac::cuda
