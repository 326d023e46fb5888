#include "faults.h"

#include <cerrno>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

#include "errors.h"

namespace vmmd {
namespace faults {
namespace {

struct Fault {
  std::string name;
  uint64_t nth;
  int error;
  bool fired = false;
};

std::mutex mutex;
std::vector<Fault> plan;
std::map<std::string, uint64_t> calls;
bool active = false;

// The errors a plan may name: errno names for OS functions, CUresult names for the driver.
const std::map<std::string, int>& ErrorNames() {
  static const std::map<std::string, int> names = {
      {"ENOMEM", ENOMEM},
      {"EMFILE", EMFILE},
      {"ENFILE", ENFILE},
      {"EINVAL", EINVAL},
      {"EBADF", EBADF},
      {"EAGAIN", EAGAIN},
      {"EPERM", EPERM},
      {"ENOSPC", ENOSPC},
      {"ENOBUFS", ENOBUFS},
      {"CUDA_ERROR_INVALID_VALUE", 1},
      {"CUDA_ERROR_OUT_OF_MEMORY", 2},
      {"CUDA_ERROR_NOT_PERMITTED", 800},
      {"CUDA_ERROR_NOT_SUPPORTED", 801},
      {"CUDA_ERROR_UNKNOWN", 999},
  };
  return names;
}

}  // namespace

std::string Set(const std::string& text) {
  std::vector<Fault> parsed;
  std::stringstream entries(text);
  std::string entry;
  while (std::getline(entries, entry, ',')) {
    if (entry.empty()) continue;
    // From the right: names may hold ':' themselves ("mmap:reserve").
    size_t second = entry.rfind(':');
    size_t first = second == std::string::npos || second == 0 ? std::string::npos : entry.rfind(':', second - 1);
    if (first == std::string::npos || first == 0) return "\"" + entry + "\" is not NAME:N:ERROR";
    std::string name = entry.substr(0, first);
    std::string count = entry.substr(first + 1, second - first - 1);
    std::string error = entry.substr(second + 1);
    char* end = nullptr;
    uint64_t nth = std::strtoull(count.c_str(), &end, 10);
    if (count.empty() || *end != '\0' || nth == 0) return "\"" + entry + "\": N must be a call number from 1";
    auto found = ErrorNames().find(error);
    if (found == ErrorNames().end()) return "\"" + entry + "\": unknown error " + error;
    parsed.push_back({name, nth, found->second});
  }
  std::lock_guard<std::mutex> lock(mutex);
  plan = std::move(parsed);
  calls.clear();
  active = !plan.empty();
  return "";
}

int Hit(const char* name) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!active) return 0;
  uint64_t call = ++calls[name];
  for (Fault& fault : plan) {
    if (!fault.fired && fault.nth == call && fault.name == name) {
      fault.fired = true;
      return fault.error;
    }
  }
  return 0;
}

namespace {

// faultsSet(plan): replaces the plan ("" turns injection off). Throws on a bad plan.
Napi::Value FaultsSet(const Napi::CallbackInfo& info) {
  if (!info[0].IsString()) ThrowArg(info.Env(), "plan must be a string");
  std::string problem = Set(info[0].As<Napi::String>().Utf8Value());
  if (!problem.empty()) ThrowArg(info.Env(), "VMMD_FAULTS: " + problem);
  return info.Env().Undefined();
}

// faultsState() -> { active, calls: { name: count }, pending: [names not fired yet] }
Napi::Value FaultsState(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::lock_guard<std::mutex> lock(mutex);
  Napi::Object out = Napi::Object::New(env);
  out.Set("active", Napi::Boolean::New(env, active));
  Napi::Object counts = Napi::Object::New(env);
  for (const auto& [name, count] : calls) counts.Set(name, Napi::Number::New(env, static_cast<double>(count)));
  out.Set("calls", counts);
  Napi::Array pending = Napi::Array::New(env);
  uint32_t index = 0;
  for (const Fault& fault : plan) {
    if (!fault.fired) pending.Set(index++, Napi::String::New(env, fault.name + ":" + std::to_string(fault.nth)));
  }
  out.Set("pending", pending);
  return out;
}

}  // namespace

void Init(Napi::Env env, Napi::Object exports) {
  const char* text = std::getenv("VMMD_FAULTS");
  if (text != nullptr && *text != '\0') {
    std::string problem = Set(text);
    // A bad plan must not pass silently: the process would test nothing.
    if (!problem.empty()) ThrowArg(env, "VMMD_FAULTS: " + problem);
  }
  exports.Set("faultsSet", Napi::Function::New(env, FaultsSet, "faultsSet"));
  exports.Set("faultsState", Napi::Function::New(env, FaultsState, "faultsState"));
}

}  // namespace faults
}  // namespace vmmd
