// The subset of the CUDA driver API that vmmd calls, declared here so the addon
// builds without the CUDA toolkit and never links libcuda: the library is
// opened with dlopen at run time. The driver's ABI for these is stable; where
// cuda.h is on the include path, cuda_driver.cc checks every declaration here
// against it at compile time.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vmmd {
namespace cu {

using Result = int;
using Device = int;
using Context = struct OpaqueContext*;
using Stream = struct OpaqueStream*;
using DevicePtr = unsigned long long;
using GenericHandle = unsigned long long;

constexpr Result SUCCESS = 0;
constexpr Result ERROR_INVALID_VALUE = 1;
constexpr Result ERROR_OUT_OF_MEMORY = 2;
constexpr Result ERROR_NO_DEVICE = 100;
constexpr Result ERROR_NOT_PERMITTED = 800;
constexpr Result ERROR_NOT_SUPPORTED = 801;

enum LocationType : int { LOCATION_INVALID = 0, LOCATION_DEVICE = 1, LOCATION_HOST = 2, LOCATION_HOST_NUMA = 3 };
enum HandleTypeBits : int { HANDLE_NONE = 0, HANDLE_POSIX_FD = 0x1, HANDLE_FABRIC = 0x8 };
enum AccessFlags : int { ACCESS_NONE = 0, ACCESS_READ = 1, ACCESS_READWRITE = 3 };
constexpr int ALLOCATION_TYPE_PINNED = 1;
constexpr int GRANULARITY_MINIMUM = 0;
constexpr int GRANULARITY_RECOMMENDED = 1;

constexpr int ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;
constexpr int ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103;
constexpr int ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128;
constexpr int ATTRIBUTE_HOST_NUMA_ID = 134;

struct Uuid {
  char bytes[16];
};

struct MemLocation {
  LocationType type;
  int id;
};

struct MemAllocationProp {
  int type;
  int requestedHandleTypes;
  MemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

struct MemAccessDesc {
  MemLocation location;
  AccessFlags flags;
};

struct FabricHandle {
  unsigned char data[64];
};

// The driver's entry points, resolved by name with dlsym.
struct Api {
  Result (*cuInit)(unsigned int);
  Result (*cuDriverGetVersion)(int*);
  Result (*cuGetErrorName)(Result, const char**);
  Result (*cuDeviceGetCount)(int*);
  Result (*cuDeviceGet)(Device*, int);
  Result (*cuDeviceGetName)(char*, int, Device);
  Result (*cuDeviceGetUuid_v2)(Uuid*, Device);
  Result (*cuDeviceTotalMem_v2)(size_t*, Device);
  Result (*cuDeviceGetAttribute)(int*, int, Device);
  Result (*cuDeviceCanAccessPeer)(int*, Device, Device);
  Result (*cuDevicePrimaryCtxRetain)(Context*, Device);
  Result (*cuCtxSetCurrent)(Context);
  Result (*cuCtxSynchronize)();
  Result (*cuStreamCreate)(Stream*, unsigned int);
  Result (*cuStreamSynchronize)(Stream);
  Result (*cuMemGetInfo_v2)(size_t*, size_t*);
  Result (*cuMemAddressReserve)(DevicePtr*, size_t, size_t, DevicePtr, unsigned long long);
  Result (*cuMemAddressFree)(DevicePtr, size_t);
  Result (*cuMemCreate)(GenericHandle*, size_t, const MemAllocationProp*, unsigned long long);
  Result (*cuMemRelease)(GenericHandle);
  Result (*cuMemMap)(DevicePtr, size_t, size_t, GenericHandle, unsigned long long);
  Result (*cuMemUnmap)(DevicePtr, size_t);
  Result (*cuMemSetAccess)(DevicePtr, size_t, const MemAccessDesc*, size_t);
  Result (*cuMemGetAccess)(unsigned long long*, const MemLocation*, DevicePtr);
  Result (*cuMemExportToShareableHandle)(void*, GenericHandle, int, unsigned long long);
  Result (*cuMemImportFromShareableHandle)(GenericHandle*, void*, int);
  Result (*cuMemGetAllocationGranularity)(size_t*, const MemAllocationProp*, int);
  Result (*cuMemGetAllocationPropertiesFromHandle)(MemAllocationProp*, GenericHandle);
  Result (*cuMemRetainAllocationHandle)(GenericHandle*, void*);
  Result (*cuMemcpyHtoDAsync_v2)(DevicePtr, const void*, size_t, Stream);
  Result (*cuMemcpyDtoHAsync_v2)(void*, DevicePtr, size_t, Stream);
  // Unified addressing: either side may be device memory or host memory mapped for the device.
  Result (*cuMemcpyAsync)(DevicePtr, DevicePtr, size_t, Stream);
  Result (*cuMemHostRegister_v2)(void*, size_t, unsigned int);
  Result (*cuMemHostUnregister)(void*);
  Result (*cuMemHostGetDevicePointer_v2)(DevicePtr*, void*, unsigned int);
  // Legacy allocation: only the benchmarks' in-process reference uses it.
  Result (*cuMemAlloc_v2)(DevicePtr*, size_t);
  Result (*cuMemFree_v2)(DevicePtr);
};

constexpr unsigned int HOST_REGISTER_PORTABLE = 0x01;
constexpr unsigned int HOST_REGISTER_DEVICEMAP = 0x02;

}  // namespace cu
}  // namespace vmmd
