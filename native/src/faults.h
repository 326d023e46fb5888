// Fault injection: off unless VMMD_FAULTS is set (or faultsSet() is called).
// "name:N:ERROR[,name:N:ERROR…]" (names may hold ':') makes the N-th call (1-based) of the named
// OS or driver function fail once with ERROR, an errno name ("ENOMEM",
// "EMFILE") for OS functions or a CUresult name ("CUDA_ERROR_OUT_OF_MEMORY")
// for driver ones. Names are the functions' own, with the use for mmap
// ("memfd_create", "mmap:reserve", "mmap:map", "mmap:unmap", "munmap", "mprotect", "dup",
// "fstat", "fcntl:seal", "fchmod", "sendmsg", "cuMemCreate", "cuMemExportToShareableHandle",
// "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap",
// "cuMemSetAccess", "cuMemUnmap", "cuMemRelease", "cuMemAddressFree"). Thread-safe: driver calls also run on worker threads.
#pragma once

#include <napi.h>
#include <cerrno>
#include <string>

namespace vmmd {
namespace faults {

// The error to inject for this call of `name` (an errno value or a CUresult), or 0.
int Hit(const char* name);

// For an OS call: true (with errno set) when this call is to fail.
inline bool Inject(const char* name) {
  int error = Hit(name);
  if (error == 0) return false;
  errno = error;
  return true;
}

// Replaces the plan; "" turns injection off. Returns "" or what is wrong with the text.
std::string Set(const std::string& plan);

void Init(Napi::Env env, Napi::Object exports);

}  // namespace faults
}  // namespace vmmd
