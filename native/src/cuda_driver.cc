// The cuda backend's mechanism: the driver's VMM API through dlopen, with the
// device's primary context current on whichever thread makes the call. Slow
// calls (export, unmap, release, copies) run on worker threads and return
// promises. No policy and no registry here: TypeScript validates first.
#include "cuda_driver.h"

#include <dlfcn.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_api.h"
#include "errors.h"
#include "faults.h"

#if __has_include(<cuda.h>)
#include <cuda.h>
// The declarations in cuda_api.h must match the driver's own.
static_assert(sizeof(vmmd::cu::MemAllocationProp) == sizeof(CUmemAllocationProp), "CUmemAllocationProp layout");
static_assert(offsetof(vmmd::cu::MemAllocationProp, location) == offsetof(CUmemAllocationProp, location), "location offset");
static_assert(offsetof(vmmd::cu::MemAllocationProp, allocFlags) == offsetof(CUmemAllocationProp, allocFlags), "allocFlags offset");
static_assert(sizeof(vmmd::cu::MemAccessDesc) == sizeof(CUmemAccessDesc), "CUmemAccessDesc layout");
static_assert(sizeof(vmmd::cu::MemLocation) == sizeof(CUmemLocation), "CUmemLocation layout");
static_assert(sizeof(vmmd::cu::FabricHandle) == sizeof(CUmemFabricHandle), "CUmemFabricHandle layout");
static_assert(static_cast<int>(vmmd::cu::LOCATION_HOST_NUMA) == static_cast<int>(CU_MEM_LOCATION_TYPE_HOST_NUMA), "location type");
static_assert(static_cast<int>(vmmd::cu::HANDLE_FABRIC) == static_cast<int>(CU_MEM_HANDLE_TYPE_FABRIC), "handle type");
static_assert(static_cast<int>(vmmd::cu::ACCESS_READWRITE) == static_cast<int>(CU_MEM_ACCESS_FLAGS_PROT_READWRITE), "access flags");
static_assert(vmmd::cu::ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, "attribute");
static_assert(vmmd::cu::ATTRIBUTE_HOST_NUMA_ID == CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, "attribute");
static_assert(vmmd::cu::ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ==
                  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
              "attribute");
static_assert(vmmd::cu::ERROR_NOT_PERMITTED == CUDA_ERROR_NOT_PERMITTED, "result");
static_assert(vmmd::cu::HOST_REGISTER_PORTABLE == CU_MEMHOSTREGISTER_PORTABLE, "host register flag");
static_assert(vmmd::cu::HOST_REGISTER_DEVICEMAP == CU_MEMHOSTREGISTER_DEVICEMAP, "host register flag");
#endif

namespace vmmd {
namespace {

struct Driver {
  void* library = nullptr;
  cu::Api api{};
  int driverVersion = 0;
  std::vector<cu::Context> contexts;  // the primary context of each device, retained for the process
  std::string failure;                // why the driver is not usable, when it is not
  bool attempted = false;
};

Driver driver;
std::mutex driverMutex;

std::string ResultName(cu::Result result) {
  const char* name = nullptr;
  if (driver.api.cuGetErrorName != nullptr && driver.api.cuGetErrorName(result, &name) == cu::SUCCESS && name) {
    return name;
  }
  return "CUDA_ERROR_" + std::to_string(result);
}

Napi::Error CudaError(Napi::Env env, cu::Result result, const std::string& call) {
  std::string name = ResultName(result);
  Napi::Error error = Napi::Error::New(env, name + ": " + call);
  error.Set("code", Napi::String::New(env, name));
  error.Set("result", Napi::Number::New(env, result));
  return error;
}

void Check(Napi::Env env, cu::Result result, const std::string& call) {
  if (result != cu::SUCCESS) throw CudaError(env, result, call);
}

// A driver call, unless fault injection makes this one fail (faults.h).
template <typename Call>
cu::Result Injected(const char* name, Call call) {
  int error = faults::Hit(name);
  return error != 0 ? static_cast<cu::Result>(error) : call();
}

// VMMD_DRIVER_TRACE=1: one stderr line per driver call made on a worker thread, with its
// begin and end on CLOCK_MONOTONIC (comparable across processes of one host), pid, thread
// id and result. A diagnostic for ordering questions (which copy ran before which unmap).
const bool traceDriver = [] {
  const char* value = std::getenv("VMMD_DRIVER_TRACE");
  return value != nullptr && value[0] != '\0' && value[0] != '0';
}();

uint64_t MonotonicNs() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<uint64_t>(now.tv_sec) * 1000000000ull + static_cast<uint64_t>(now.tv_nsec);
}

void TraceCall(const std::string& call, uint64_t address, uint64_t begin, uint64_t end, int result) {
  char line[256];
  int length = snprintf(line, sizeof(line), "vmmd-trace pid=%d tid=%ld begin=%llu end=%llu result=%d address=0x%llx call=%s\n",
                        getpid(), static_cast<long>(syscall(SYS_gettid)), static_cast<unsigned long long>(begin),
                        static_cast<unsigned long long>(end), result, static_cast<unsigned long long>(address), call.c_str());
  // One write per line: lines of concurrent threads and processes do not interleave.
  if (length > 0) (void)!write(STDERR_FILENO, line, static_cast<size_t>(length) < sizeof(line) ? length : sizeof(line) - 1);
}

std::string Sized(const char* call, uint64_t size) { return std::string(call) + "(" + std::to_string(size) + ")"; }

// Opens libcuda.so.1, resolves every entry point, initializes the driver and
// retains each device's primary context. Returns "" or the reason it failed.
std::string LoadDriver() {
  std::lock_guard<std::mutex> lock(driverMutex);
  if (driver.attempted) return driver.failure;
  driver.attempted = true;
  driver.library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver.library == nullptr) {
    const char* why = dlerror();
    driver.failure = std::string("libcuda.so.1 not found (") + (why ? why : "dlopen failed") +
                     "): run on a host with the NVIDIA driver, or use --backend host";
    return driver.failure;
  }
  struct Entry {
    const char* name;
    void** slot;
  };
  cu::Api& a = driver.api;
  const Entry entries[] = {
      {"cuInit", reinterpret_cast<void**>(&a.cuInit)},
      {"cuDriverGetVersion", reinterpret_cast<void**>(&a.cuDriverGetVersion)},
      {"cuGetErrorName", reinterpret_cast<void**>(&a.cuGetErrorName)},
      {"cuDeviceGetCount", reinterpret_cast<void**>(&a.cuDeviceGetCount)},
      {"cuDeviceGet", reinterpret_cast<void**>(&a.cuDeviceGet)},
      {"cuDeviceGetName", reinterpret_cast<void**>(&a.cuDeviceGetName)},
      {"cuDeviceGetUuid_v2", reinterpret_cast<void**>(&a.cuDeviceGetUuid_v2)},
      {"cuDeviceTotalMem_v2", reinterpret_cast<void**>(&a.cuDeviceTotalMem_v2)},
      {"cuDeviceGetAttribute", reinterpret_cast<void**>(&a.cuDeviceGetAttribute)},
      {"cuDeviceCanAccessPeer", reinterpret_cast<void**>(&a.cuDeviceCanAccessPeer)},
      {"cuDevicePrimaryCtxRetain", reinterpret_cast<void**>(&a.cuDevicePrimaryCtxRetain)},
      {"cuCtxSetCurrent", reinterpret_cast<void**>(&a.cuCtxSetCurrent)},
      {"cuCtxSynchronize", reinterpret_cast<void**>(&a.cuCtxSynchronize)},
      {"cuStreamCreate", reinterpret_cast<void**>(&a.cuStreamCreate)},
      {"cuStreamSynchronize", reinterpret_cast<void**>(&a.cuStreamSynchronize)},
      {"cuMemGetInfo_v2", reinterpret_cast<void**>(&a.cuMemGetInfo_v2)},
      {"cuMemAddressReserve", reinterpret_cast<void**>(&a.cuMemAddressReserve)},
      {"cuMemAddressFree", reinterpret_cast<void**>(&a.cuMemAddressFree)},
      {"cuMemCreate", reinterpret_cast<void**>(&a.cuMemCreate)},
      {"cuMemRelease", reinterpret_cast<void**>(&a.cuMemRelease)},
      {"cuMemMap", reinterpret_cast<void**>(&a.cuMemMap)},
      {"cuMemUnmap", reinterpret_cast<void**>(&a.cuMemUnmap)},
      {"cuMemSetAccess", reinterpret_cast<void**>(&a.cuMemSetAccess)},
      {"cuMemGetAccess", reinterpret_cast<void**>(&a.cuMemGetAccess)},
      {"cuMemExportToShareableHandle", reinterpret_cast<void**>(&a.cuMemExportToShareableHandle)},
      {"cuMemImportFromShareableHandle", reinterpret_cast<void**>(&a.cuMemImportFromShareableHandle)},
      {"cuMemGetAllocationGranularity", reinterpret_cast<void**>(&a.cuMemGetAllocationGranularity)},
      {"cuMemGetAllocationPropertiesFromHandle", reinterpret_cast<void**>(&a.cuMemGetAllocationPropertiesFromHandle)},
      {"cuMemRetainAllocationHandle", reinterpret_cast<void**>(&a.cuMemRetainAllocationHandle)},
      {"cuMemcpyHtoDAsync_v2", reinterpret_cast<void**>(&a.cuMemcpyHtoDAsync_v2)},
      {"cuMemcpyDtoHAsync_v2", reinterpret_cast<void**>(&a.cuMemcpyDtoHAsync_v2)},
      {"cuMemcpyAsync", reinterpret_cast<void**>(&a.cuMemcpyAsync)},
      {"cuMemHostRegister_v2", reinterpret_cast<void**>(&a.cuMemHostRegister_v2)},
      {"cuMemHostUnregister", reinterpret_cast<void**>(&a.cuMemHostUnregister)},
      {"cuMemHostGetDevicePointer_v2", reinterpret_cast<void**>(&a.cuMemHostGetDevicePointer_v2)},
      {"cuMemAlloc_v2", reinterpret_cast<void**>(&a.cuMemAlloc_v2)},
      {"cuMemFree_v2", reinterpret_cast<void**>(&a.cuMemFree_v2)},
  };
  for (const Entry& entry : entries) {
    *entry.slot = dlsym(driver.library, entry.name);
    if (*entry.slot == nullptr) {
      driver.failure = std::string("libcuda.so.1 has no ") + entry.name + ": the NVIDIA driver is too old for vmmd";
      return driver.failure;
    }
  }
  cu::Result result = a.cuInit(0);
  if (result != cu::SUCCESS) {
    driver.failure = "cuInit failed with " + ResultName(result) +
                     (result == cu::ERROR_NO_DEVICE ? ": no CUDA device is visible" : "") + "; use --backend host";
    return driver.failure;
  }
  a.cuDriverGetVersion(&driver.driverVersion);
  int count = 0;
  result = a.cuDeviceGetCount(&count);
  if (result != cu::SUCCESS || count == 0) {
    driver.failure = "no CUDA device is visible (cuDeviceGetCount: " + ResultName(result) + "); use --backend host";
    return driver.failure;
  }
  for (int index = 0; index < count; index++) {
    cu::Device device = 0;
    cu::Context context = nullptr;
    result = a.cuDeviceGet(&device, index);
    if (result == cu::SUCCESS) result = a.cuDevicePrimaryCtxRetain(&context, device);
    if (result != cu::SUCCESS) {
      driver.failure = "cannot retain the primary context of device " + std::to_string(index) + ": " + ResultName(result);
      return driver.failure;
    }
    driver.contexts.push_back(context);
  }
  return "";
}

void RequireDriver(Napi::Env env) {
  std::string failure = LoadDriver();
  if (!failure.empty()) {
    Napi::Error error = Napi::Error::New(env, failure);
    error.Set("code", Napi::String::New(env, "CUDA_UNAVAILABLE"));
    throw error;
  }
}

// Makes the device's primary context current on this thread.
cu::Result UseDevice(int device) {
  if (device < 0 || device >= static_cast<int>(driver.contexts.size())) return cu::ERROR_INVALID_VALUE;
  return driver.api.cuCtxSetCurrent(driver.contexts[device]);
}

int DeviceArg(const Napi::CallbackInfo& info, size_t index) {
  int device = info[index].As<Napi::Number>().Int32Value();
  if (device < 0 || device >= static_cast<int>(driver.contexts.size())) {
    ThrowArg(info.Env(), "device " + std::to_string(device) + " does not exist");
  }
  Check(info.Env(), UseDevice(device), "cuCtxSetCurrent");
  return device;
}

cu::MemAllocationProp Prop(int locationType, int locationId, int handleTypes) {
  cu::MemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = cu::ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = handleTypes;
  prop.location.type = static_cast<cu::LocationType>(locationType);
  prop.location.id = locationId;
  return prop;
}

// This worker thread's own stream on `device` (whose context is current), made on first use
// and kept for the thread's life (worker threads live as long as the process). Blocking
// (flags 0): it waits for work queued on the legacy default stream, as a synchronous copy does.
cu::Result CopyStream(int device, cu::Stream* stream) {
  thread_local std::vector<cu::Stream> streams;
  if (streams.size() < driver.contexts.size()) streams.resize(driver.contexts.size(), nullptr);
  if (streams[device] == nullptr) {
    cu::Result result = driver.api.cuStreamCreate(&streams[device], 0);
    if (result != cu::SUCCESS) return result;
  }
  *stream = streams[device];
  return cu::SUCCESS;
}

// Copies host bytes into device memory and returns only once they are there. NOTE:
// cuMemcpyHtoD from pageable memory returns as soon as the bytes are staged for DMA, before
// the DMA lands (the driver API's "API synchronization behavior"); a caller that unmapped the
// range then faulted the context under the copy engine (CUDA_ERROR_LAUNCH_FAILED at the next
// copy). An async copy on this thread's stream and a synchronize of that stream wait for it.
cu::Result CopyToDevice(int device, cu::DevicePtr address, const void* source, size_t length) {
  cu::Stream stream = nullptr;
  cu::Result result = CopyStream(device, &stream);
  if (result == cu::SUCCESS) result = driver.api.cuMemcpyHtoDAsync_v2(address, source, length, stream);
  if (result == cu::SUCCESS) result = driver.api.cuStreamSynchronize(stream);
  return result;
}

// Copies device bytes into host memory on this thread's stream, and returns once they are
// there. Into page-locked memory (a registered staging buffer) the copy is a DMA of the copy
// engine at full speed; into pageable memory the driver stages it, as cuMemcpyDtoH does.
cu::Result CopyFromDevice(int device, void* target, cu::DevicePtr address, size_t length) {
  cu::Stream stream = nullptr;
  cu::Result result = CopyStream(device, &stream);
  if (result == cu::SUCCESS) result = driver.api.cuMemcpyDtoHAsync_v2(target, address, length, stream);
  if (result == cu::SUCCESS) result = driver.api.cuStreamSynchronize(stream);
  return result;
}

// One piece of a bulk copy between device-visible addresses: target, source, bytes.
struct CopyPiece {
  uint64_t target;
  uint64_t source;
  uint64_t length;
};

// Copies every piece, piece i on stream i % lanes of this thread's own (non-blocking: they
// never wait for the legacy default stream), and returns once every byte has landed: the
// pieces of different streams overlap on the copy engines, as the Python client's copies do.
cu::Result CopyPieces(int device, const std::vector<CopyPiece>& pieces, size_t lanes) {
  thread_local std::vector<std::vector<cu::Stream>> streams;
  if (streams.size() < driver.contexts.size()) streams.resize(driver.contexts.size());
  std::vector<cu::Stream>& own = streams[device];
  while (own.size() < lanes) {
    cu::Stream stream = nullptr;
    cu::Result result = driver.api.cuStreamCreate(&stream, 1);
    if (result != cu::SUCCESS) return result;
    own.push_back(stream);
  }
  cu::Result failed = cu::SUCCESS;
  for (size_t index = 0; index < pieces.size() && failed == cu::SUCCESS; index++) {
    const CopyPiece& piece = pieces[index];
    failed = Injected("cuMemcpyAsync", [&] { return driver.api.cuMemcpyAsync(piece.target, piece.source, piece.length, own[index % lanes]); });
  }
  // Every stream is waited for, also after a failure: no copy may still run when the caller unmaps.
  for (size_t lane = 0; lane < lanes; lane++) {
    cu::Result result = driver.api.cuStreamSynchronize(own[lane]);
    if (failed == cu::SUCCESS) failed = result;
  }
  return failed;
}

// A driver call on a worker thread with the device's context current there.
// `work` returns the CUresult; `make` builds the resolved value on the main thread.
class CudaWorker : public Napi::AsyncWorker {
 public:
  CudaWorker(Napi::Env env, int device, std::string call, std::function<cu::Result()> work,
             std::function<Napi::Value(Napi::Env)> make)
      : Napi::AsyncWorker(env, "vmmd:cuda"),
        deferred_(Napi::Promise::Deferred::New(env)),
        device_(device),
        call_(std::move(call)),
        work_(std::move(work)),
        make_(std::move(make)) {}

  static Napi::Promise Queue(Napi::Env env, int device, std::string call, std::function<cu::Result()> work,
                             std::function<Napi::Value(Napi::Env)> make, uint64_t address = 0) {
    auto* worker = new CudaWorker(env, device, std::move(call), std::move(work), std::move(make));
    worker->address_ = address;  // for the trace only
    Napi::Promise promise = worker->deferred_.Promise();
    worker->Napi::AsyncWorker::Queue();
    return promise;
  }

  // As Queue, or with `inline` on the calling thread, returning a settled promise: for a
  // client's own mappings, where no other session waits on this event loop and a hop to a
  // driver thread costs more than the call itself.
  static Napi::Promise Run(Napi::Env env, bool inlineCall, int device, std::string call, std::function<cu::Result()> work,
                           std::function<Napi::Value(Napi::Env)> make, uint64_t address = 0) {
    if (!inlineCall) return Queue(env, device, std::move(call), std::move(work), std::move(make), address);
    Napi::Promise::Deferred deferred = Napi::Promise::Deferred::New(env);
    uint64_t begin = traceDriver ? MonotonicNs() : 0;
    cu::Result result = UseDevice(device);
    if (result == cu::SUCCESS) result = work();
    if (traceDriver) TraceCall(call + " (inline)", address, begin, MonotonicNs(), result);
    if (result != cu::SUCCESS) {
      deferred.Reject(CudaError(env, result, call).Value());
    } else {
      deferred.Resolve(make ? make(env) : env.Undefined());
    }
    return deferred.Promise();
  }

  void Execute() override {
    uint64_t begin = traceDriver ? MonotonicNs() : 0;
    result_ = UseDevice(device_);
    if (result_ == cu::SUCCESS) result_ = work_();
    if (traceDriver) TraceCall(call_, address_, begin, MonotonicNs(), result_);
  }

  void OnOK() override {
    Napi::Env env = Env();
    Napi::HandleScope scope(env);
    if (result_ != cu::SUCCESS) {
      deferred_.Reject(CudaError(env, result_, call_).Value());
      return;
    }
    try {
      deferred_.Resolve(make_ ? make_(env) : env.Undefined());
    } catch (const Napi::Error& error) {
      deferred_.Reject(error.Value());
    }
  }

  void OnError(const Napi::Error& error) override { deferred_.Reject(error.Value()); }

 private:
  Napi::Promise::Deferred deferred_;
  int device_;
  std::string call_;
  std::function<cu::Result()> work_;
  std::function<Napi::Value(Napi::Env)> make_;
  cu::Result result_ = cu::SUCCESS;
  uint64_t address_ = 0;
};

// The optional trailing `inline` flag of a call that may run on the calling thread.
bool InlineArg(const Napi::CallbackInfo& info, size_t index) { return info.Length() > index && info[index].ToBoolean().Value(); }

Napi::BigInt Big(Napi::Env env, uint64_t value) { return Napi::BigInt::New(env, value); }

// cudaLoad() -> { loaded, reason, driverVersion, deviceCount }. Never throws.
Napi::Value CudaLoad(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string failure = LoadDriver();
  Napi::Object out = Napi::Object::New(env);
  out.Set("loaded", Napi::Boolean::New(env, failure.empty()));
  out.Set("reason", Napi::String::New(env, failure));
  out.Set("driverVersion", Napi::Number::New(env, driver.driverVersion));
  out.Set("deviceCount", Napi::Number::New(env, static_cast<double>(driver.contexts.size())));
  return out;
}

// cudaDevices() -> [{ index, name, uuid, totalBytes, computeCapability, vmm, posixFd, fabric, hostNumaId }]
Napi::Value CudaDevices(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  const cu::Api& a = driver.api;
  Napi::Array out = Napi::Array::New(env, driver.contexts.size());
  for (size_t index = 0; index < driver.contexts.size(); index++) {
    cu::Device device = 0;
    Check(env, a.cuDeviceGet(&device, static_cast<int>(index)), "cuDeviceGet");
    char name[256] = {0};
    Check(env, a.cuDeviceGetName(name, sizeof(name) - 1, device), "cuDeviceGetName");
    cu::Uuid uuid;
    Check(env, a.cuDeviceGetUuid_v2(&uuid, device), "cuDeviceGetUuid");
    char text[48];
    const unsigned char* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
    snprintf(text, sizeof(text), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    size_t total = 0;
    Check(env, a.cuDeviceTotalMem_v2(&total, device), "cuDeviceTotalMem");
    auto attribute = [&](int which) {
      int value = 0;
      if (a.cuDeviceGetAttribute(&value, which, device) != cu::SUCCESS) return -1;
      return value;
    };
    Napi::Object entry = Napi::Object::New(env);
    entry.Set("index", Napi::Number::New(env, static_cast<double>(index)));
    entry.Set("name", Napi::String::New(env, name));
    entry.Set("uuid", Napi::String::New(env, text));
    entry.Set("totalBytes", Big(env, total));
    entry.Set("computeCapability", Napi::String::New(env, std::to_string(attribute(cu::ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)) +
                                                              "." +
                                                              std::to_string(attribute(cu::ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))));
    entry.Set("vmm", Napi::Boolean::New(env, attribute(cu::ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) == 1));
    entry.Set("posixFd", Napi::Boolean::New(env, attribute(cu::ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) == 1));
    entry.Set("fabric", Napi::Boolean::New(env, attribute(cu::ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) == 1));
    entry.Set("hostNumaId", Napi::Number::New(env, attribute(cu::ATTRIBUTE_HOST_NUMA_ID)));
    out.Set(index, entry);
  }
  return out;
}

// cudaMemAlloc(device, size) -> device pointer: legacy cuMemAlloc, the benchmarks' reference.
Napi::Value CudaMemAlloc(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  DeviceArg(info, 0);
  uint64_t size = U64Arg(info, 1, "size");
  cu::DevicePtr pointer = 0;
  Check(env, driver.api.cuMemAlloc_v2(&pointer, size), Sized("cuMemAlloc", size));
  return Big(env, pointer);
}

// cudaMemFree(device, pointer)
Napi::Value CudaMemFree(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  DeviceArg(info, 0);
  Check(env, driver.api.cuMemFree_v2(U64Arg(info, 1, "pointer")), "cuMemFree");
  return env.Undefined();
}

// cudaMemGetInfo(device) -> { free, total }
Napi::Value CudaMemGetInfo(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  DeviceArg(info, 0);
  size_t free = 0, total = 0;
  Check(env, driver.api.cuMemGetInfo_v2(&free, &total), "cuMemGetInfo");
  Napi::Object out = Napi::Object::New(env);
  out.Set("free", Big(env, free));
  out.Set("total", Big(env, total));
  return out;
}

// cudaGranularity(locationType, locationId, handleTypes, recommended) -> bigint
Napi::Value CudaGranularity(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  cu::MemAllocationProp prop = Prop(info[0].As<Napi::Number>().Int32Value(), info[1].As<Napi::Number>().Int32Value(),
                                    info[2].As<Napi::Number>().Int32Value());
  bool recommended = info[3].As<Napi::Boolean>().Value();
  size_t granularity = 0;
  Check(env,
        driver.api.cuMemGetAllocationGranularity(&granularity, &prop,
                                                 recommended ? cu::GRANULARITY_RECOMMENDED : cu::GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  return Big(env, granularity);
}

// cudaReserve(size, alignment, hint) -> address
Napi::Value CudaReserve(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  uint64_t size = U64Arg(info, 0, "size");
  uint64_t alignment = U64Arg(info, 1, "alignment");
  uint64_t hint = U64Arg(info, 2, "hint");
  Check(env, UseDevice(0), "cuCtxSetCurrent");
  cu::DevicePtr address = 0;
  Check(env, Injected("cuMemAddressReserve", [&] { return driver.api.cuMemAddressReserve(&address, size, alignment, hint, 0); }), Sized("cuMemAddressReserve", size));
  return Big(env, address);
}

Napi::Value CudaFreeAddress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  uint64_t address = U64Arg(info, 0, "address");
  uint64_t size = U64Arg(info, 1, "size");
  Check(env, UseDevice(0), "cuCtxSetCurrent");
  Check(env, Injected("cuMemAddressFree", [&] { return driver.api.cuMemAddressFree(address, size); }), Sized("cuMemAddressFree", size));
  return env.Undefined();
}

// cudaCreate(device, locationType, locationId, size, handleTypes, inline = false) -> Promise<handle>,
// on a driver thread with the device's primary context current (cuMemCreate takes tens of
// microseconds, more for large sizes: too long for the event loop); `inline` is the client's.
Napi::Value CudaCreate(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  cu::MemAllocationProp prop = Prop(info[1].As<Napi::Number>().Int32Value(), info[2].As<Napi::Number>().Int32Value(),
                                    info[4].As<Napi::Number>().Int32Value());
  uint64_t size = U64Arg(info, 3, "size");
  auto handle = std::make_shared<cu::GenericHandle>(0);
  return CudaWorker::Run(
      env, InlineArg(info, 5), device, Sized("cuMemCreate", size),
      [prop, size, handle] { return Injected("cuMemCreate", [&] { return driver.api.cuMemCreate(handle.get(), size, &prop, 0); }); },
      [handle](Napi::Env env) { return Big(env, *handle).As<Napi::Value>(); });
}

// cudaCreateExported(device, locationType, locationId, size, handleTypes) -> Promise<{ handle, fd }>:
// cuMemCreate and its POSIX-fd export in one job on a driver thread (the stock's refill, off the event loop).
// On a failed export the new handle is released before the promise rejects.
Napi::Value CudaCreateExported(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  cu::MemAllocationProp prop = Prop(info[1].As<Napi::Number>().Int32Value(), info[2].As<Napi::Number>().Int32Value(),
                                    info[4].As<Napi::Number>().Int32Value());
  uint64_t size = U64Arg(info, 3, "size");
  struct Made {
    cu::GenericHandle handle = 0;
    int fd = -1;
  };
  auto made = std::make_shared<Made>();
  return CudaWorker::Queue(
      env, device, Sized("cuMemCreate+cuMemExportToShareableHandle", size),
      [prop, size, made] {
        cu::Result result = Injected("cuMemCreate", [&] { return driver.api.cuMemCreate(&made->handle, size, &prop, 0); });
        if (result != cu::SUCCESS) return result;
        result = Injected("cuMemExportToShareableHandle", [&] { return driver.api.cuMemExportToShareableHandle(&made->fd, made->handle, cu::HANDLE_POSIX_FD, 0); });
        if (result != cu::SUCCESS) driver.api.cuMemRelease(made->handle);
        return result;
      },
      [made](Napi::Env env) {
        Napi::Object out = Napi::Object::New(env);
        out.Set("handle", Big(env, made->handle));
        out.Set("fd", Napi::Number::New(env, made->fd));
        return Napi::Value(out);
      });
}

// cudaRelease(device, handle) -> Promise<void>
Napi::Value CudaRelease(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  uint64_t handle = U64Arg(info, 1, "handle");
  return CudaWorker::Queue(env, device, "cuMemRelease", [handle] { return Injected("cuMemRelease", [&] { return driver.api.cuMemRelease(handle); }); }, nullptr);
}

// cudaMap(address, size, offset, handle) -> Promise<void>, on a driver thread (a map can take
// hundreds of microseconds); address space is the process's, any device's context serves.
Napi::Value CudaMap(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  uint64_t address = U64Arg(info, 0, "address");
  uint64_t size = U64Arg(info, 1, "size");
  uint64_t offset = U64Arg(info, 2, "offset");
  uint64_t handle = U64Arg(info, 3, "handle");
  return CudaWorker::Run(
      env, InlineArg(info, 4), 0, Sized("cuMemMap", size),
      [address, size, offset, handle] { return Injected("cuMemMap", [&] { return driver.api.cuMemMap(address, size, offset, handle, 0); }); },
      nullptr, address);
}

// cudaUnmap(device, address, size, synchronize = false) -> Promise<void>
// With synchronize, the device's context is synchronized first, as cuMemFree does: kernels
// and copies this process queued on any stream may still be using the range.
Napi::Value CudaUnmap(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  uint64_t address = U64Arg(info, 1, "address");
  uint64_t size = U64Arg(info, 2, "size");
  bool synchronize = info.Length() > 3 && info[3].ToBoolean().Value();
  return CudaWorker::Queue(
      env, device, Sized(synchronize ? "cuCtxSynchronize+cuMemUnmap" : "cuMemUnmap", size),
      [address, size, synchronize] {
        if (synchronize) {
          cu::Result result = driver.api.cuCtxSynchronize();
          if (result != cu::SUCCESS) return result;
        }
        return Injected("cuMemUnmap", [&] { return driver.api.cuMemUnmap(address, size); });
      },
      nullptr, address);
}

// cudaUnmapMany(device, addresses, sizes, synchronize = false) -> Promise<Array<string | null>>
// Several unmaps as one job on the device's driver thread, after one synchronization of the
// context when asked (a client's frees gathered: one cuCtxSynchronize for all, and one stretch
// of driver work where each unmap alone would slow the next allocation). Each range's
// outcome is in the answer, null for unmapped, else the error's name: one failure stops none of
// the others. A failed synchronization rejects the whole, and nothing is unmapped.
Napi::Value CudaUnmapMany(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  if (!info[1].IsArray() || !info[2].IsArray()) ThrowArg(env, "cudaUnmapMany: addresses and sizes must be arrays");
  Napi::Array addresses = info[1].As<Napi::Array>();
  Napi::Array sizes = info[2].As<Napi::Array>();
  if (addresses.Length() != sizes.Length()) {
    ThrowArg(env, "cudaUnmapMany: " + std::to_string(addresses.Length()) + " addresses but " + std::to_string(sizes.Length()) + " sizes");
  }
  bool synchronize = info.Length() > 3 && info[3].ToBoolean().Value();
  auto ranges = std::make_shared<std::vector<std::pair<uint64_t, uint64_t>>>();
  for (uint32_t i = 0; i < addresses.Length(); i++) {
    Napi::Value address = addresses.Get(i);
    Napi::Value size = sizes.Get(i);
    if (!address.IsBigInt() || !size.IsBigInt()) ThrowArg(env, "cudaUnmapMany: range " + std::to_string(i) + " needs a bigint address and size");
    bool lossless = false;
    ranges->emplace_back(address.As<Napi::BigInt>().Uint64Value(&lossless), size.As<Napi::BigInt>().Uint64Value(&lossless));
  }
  auto results = std::make_shared<std::vector<cu::Result>>(ranges->size(), cu::SUCCESS);
  return CudaWorker::Queue(
      env, device, (synchronize ? "cuCtxSynchronize+cuMemUnmap x" : "cuMemUnmap x") + std::to_string(ranges->size()),
      [ranges, results, synchronize] {
        if (synchronize) {
          cu::Result result = driver.api.cuCtxSynchronize();
          if (result != cu::SUCCESS) return result;
        }
        for (size_t i = 0; i < ranges->size(); i++) {
          uint64_t address = (*ranges)[i].first;
          uint64_t size = (*ranges)[i].second;
          (*results)[i] = Injected("cuMemUnmap", [&] { return driver.api.cuMemUnmap(address, size); });
        }
        return cu::SUCCESS;
      },
      [results](Napi::Env env) {
        Napi::Array outcome = Napi::Array::New(env, results->size());
        for (size_t i = 0; i < results->size(); i++) {
          outcome.Set(static_cast<uint32_t>(i), (*results)[i] == cu::SUCCESS ? env.Null() : Napi::String::New(env, ResultName((*results)[i])).As<Napi::Value>());
        }
        return outcome.As<Napi::Value>();
      });
}

// cudaSynchronize(device) -> Promise<void>: cuCtxSynchronize on the device's driver thread. What
// cuMemFree waits for before memory changes hands: a client pool's freed blocks go back to the
// pool after it, so that no kernel queued before the free still uses them.
Napi::Value CudaSynchronize(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  return CudaWorker::Queue(env, device, "cuCtxSynchronize", [] { return driver.api.cuCtxSynchronize(); }, nullptr);
}

// cudaSetAccess(address, size, [{ type, id, flags }]) -> Promise<void>, on a driver thread
// (setting access can take hundreds of microseconds). The descriptors are copied here.
Napi::Value CudaSetAccess(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  uint64_t address = U64Arg(info, 0, "address");
  uint64_t size = U64Arg(info, 1, "size");
  Napi::Array list = info[2].As<Napi::Array>();
  auto descriptors = std::make_shared<std::vector<cu::MemAccessDesc>>(list.Length());
  for (uint32_t i = 0; i < list.Length(); i++) {
    Napi::Object entry = list.Get(i).As<Napi::Object>();
    (*descriptors)[i].location.type = static_cast<cu::LocationType>(entry.Get("type").As<Napi::Number>().Int32Value());
    (*descriptors)[i].location.id = entry.Get("id").As<Napi::Number>().Int32Value();
    (*descriptors)[i].flags = static_cast<cu::AccessFlags>(entry.Get("flags").As<Napi::Number>().Int32Value());
  }
  return CudaWorker::Run(
      env, InlineArg(info, 3), 0, Sized("cuMemSetAccess", size),
      [address, size, descriptors] {
        return Injected("cuMemSetAccess", [&] { return driver.api.cuMemSetAccess(address, size, descriptors->data(), descriptors->size()); });
      },
      nullptr, address);
}

// cudaGetAccess(address, type, id) -> flags
Napi::Value CudaGetAccess(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  uint64_t address = U64Arg(info, 0, "address");
  cu::MemLocation location{static_cast<cu::LocationType>(info[1].As<Napi::Number>().Int32Value()),
                           info[2].As<Napi::Number>().Int32Value()};
  unsigned long long flags = 0;
  Check(env, UseDevice(0), "cuCtxSetCurrent");
  Check(env, driver.api.cuMemGetAccess(&flags, &location, address), "cuMemGetAccess");
  return Napi::Number::New(env, static_cast<double>(flags));
}

// cudaExportFd(device, handle) -> Promise<fd>
Napi::Value CudaExportFd(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  uint64_t handle = U64Arg(info, 1, "handle");
  auto fd = std::make_shared<int>(-1);
  return CudaWorker::Queue(
      env, device, "cuMemExportToShareableHandle(POSIX_FD)",
      [handle, fd] { return Injected("cuMemExportToShareableHandle", [&] { return driver.api.cuMemExportToShareableHandle(fd.get(), handle, cu::HANDLE_POSIX_FD, 0); }); },
      [fd](Napi::Env env) { return Napi::Number::New(env, *fd); });
}

// cudaExportFabric(device, handle) -> Promise<Buffer(64)>
Napi::Value CudaExportFabric(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  uint64_t handle = U64Arg(info, 1, "handle");
  auto fabric = std::make_shared<cu::FabricHandle>();
  return CudaWorker::Queue(
      env, device, "cuMemExportToShareableHandle(FABRIC)",
      [handle, fabric] { return Injected("cuMemExportToShareableHandle", [&] { return driver.api.cuMemExportToShareableHandle(fabric.get(), handle, cu::HANDLE_FABRIC, 0); }); },
      [fabric](Napi::Env env) {
        return Napi::Buffer<uint8_t>::Copy(env, fabric->data, sizeof(fabric->data)).As<Napi::Value>();
      });
}

// cudaImportFd(fd) -> Promise<handle>, on a driver thread (an import can take hundreds of
// microseconds). The caller keeps the fd, and closes it only once the promise settled.
Napi::Value CudaImportFd(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int fd = FdArg(info, 0, "fd");
  auto handle = std::make_shared<cu::GenericHandle>(0);
  return CudaWorker::Run(
      env, InlineArg(info, 1), 0, "cuMemImportFromShareableHandle(POSIX_FD)",
      [fd, handle] {
        return Injected("cuMemImportFromShareableHandle", [&] {
          return driver.api.cuMemImportFromShareableHandle(handle.get(), reinterpret_cast<void*>(static_cast<intptr_t>(fd)), cu::HANDLE_POSIX_FD);
        });
      },
      [handle](Napi::Env env) { return Big(env, *handle).As<Napi::Value>(); });
}

// cudaImportMap(fd, address, size, device, flags, hostNuma) -> Promise<string | undefined>, settled, run on
// the calling thread: a client's whole import of a descriptor into a range it reserved. It
// imports the descriptor, maps it at [address, address + size), grants `flags` (1 read,
// 3 read-write) to `device` (and to host NUMA node hostNuma when it is >= 0), and releases
// the imported handle: the mapping holds the memory. One call where four would each cost the
// client a turn of promises and, for the release, a driver thread (the JavaScript between
// the steps would be a large part of a cold allocation). A failed step undoes the ones before
// it (unmap, release) and the error names the step; if the undoing unmap fails too, the error
// has stillMapped: true (and unmapError): the range is still mapped and must not be reused.
// A release of the imported handle that fails after the mapping worked keeps the mapping and
// resolves with that error's name (the handle reference is lost until the process ends);
// otherwise it resolves with undefined. The caller keeps the fd. Each step is a line of the
// driver trace, as the separate calls' are.
Napi::Value CudaImportMap(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int fd = FdArg(info, 0, "fd");
  uint64_t address = U64Arg(info, 1, "address");
  uint64_t size = U64Arg(info, 2, "size");
  int device = DeviceArg(info, 3);
  int flags = info[4].As<Napi::Number>().Int32Value();
  int hostNuma = info[5].As<Napi::Number>().Int32Value();
  if (flags != 1 && flags != 3) ThrowArg(env, "flags " + std::to_string(flags) + " must be 1 (read) or 3 (read-write)");
  // The device, then the peers that reach it (as cuMemAlloc memory is reachable once peer access is on), then the host.
  std::vector<cu::MemAccessDesc> descriptors;
  auto grant = [&](cu::LocationType type, int id) {
    cu::MemAccessDesc desc;
    std::memset(&desc, 0, sizeof(desc));
    desc.location.type = type;
    desc.location.id = id;
    desc.flags = static_cast<cu::AccessFlags>(flags);
    descriptors.push_back(desc);
  };
  grant(cu::LOCATION_DEVICE, device);
  if (info.Length() > 6 && info[6].IsArray()) {
    Napi::Array peers = info[6].As<Napi::Array>();
    for (uint32_t i = 0; i < peers.Length(); i++) grant(cu::LOCATION_DEVICE, peers.Get(i).As<Napi::Number>().Int32Value());
  }
  if (hostNuma >= 0) grant(cu::LOCATION_HOST_NUMA, hostNuma);
  cu::MemAccessDesc* access = descriptors.data();
  size_t grants = descriptors.size();
  // One step: the call, traced as an inline call of its own.
  auto step = [&](const std::string& call, auto&& body) {
    uint64_t begin = traceDriver ? MonotonicNs() : 0;
    cu::Result result = body();
    if (traceDriver) TraceCall(call + " (inline)", address, begin, MonotonicNs(), result);
    return result;
  };
  Napi::Promise::Deferred deferred = Napi::Promise::Deferred::New(env);
  cu::GenericHandle handle = 0;
  std::string failed = "cuMemImportFromShareableHandle(POSIX_FD)";
  // A failed undo of the map (the range stays mapped), and a failed release of the imported handle after a
  // mapping that works (its error name): each changes what the caller must do.
  cu::Result unmapFailed = cu::SUCCESS;
  std::string releaseFailed;
  cu::Result result = step(failed, [&] {
    return Injected("cuMemImportFromShareableHandle", [&] {
      return driver.api.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)), cu::HANDLE_POSIX_FD);
    });
  });
  if (result == cu::SUCCESS) {
    failed = Sized("cuMemMap", size);
    result = step(failed, [&] { return Injected("cuMemMap", [&] { return driver.api.cuMemMap(address, size, 0, handle, 0); }); });
    if (result == cu::SUCCESS) {
      failed = Sized("cuMemSetAccess", size);
      result = step(failed, [&] { return Injected("cuMemSetAccess", [&] { return driver.api.cuMemSetAccess(address, size, access, grants); }); });
      if (result != cu::SUCCESS) {
        // Undone; when even that fails the range stays mapped, and the caller must never reuse it.
        unmapFailed = step("cuMemUnmap (undoing the map)", [&] { return Injected("cuMemUnmap", [&] { return driver.api.cuMemUnmap(address, size); }); });
      }
    }
    // The mapping (if any) holds the memory: the imported handle goes either way. Its failure after a mapping
    // that works fails nothing: the mapping is kept (as the separate calls did), the handle reference is lost
    // until the process ends, and the answer says so.
    cu::Result released = step("cuMemRelease", [&] { return Injected("cuMemRelease", [&] { return driver.api.cuMemRelease(handle); }); });
    if (result == cu::SUCCESS && released != cu::SUCCESS) releaseFailed = ResultName(released);
  }
  if (result != cu::SUCCESS) {
    Napi::Error error = CudaError(env, result, failed);
    if (unmapFailed != cu::SUCCESS) {
      error.Set("stillMapped", Napi::Boolean::New(env, true));
      error.Set("unmapError", Napi::String::New(env, ResultName(unmapFailed)));
    }
    deferred.Reject(error.Value());
  } else {
    deferred.Resolve(releaseFailed.empty() ? env.Undefined() : Napi::String::New(env, releaseFailed).As<Napi::Value>());
  }
  return deferred.Promise();
}

// cudaHandleHasSize(device, handle, size) -> Promise<boolean>, on a driver thread: whether
// an imported allocation is exactly `size` bytes. The driver does not say how large an
// imported allocation is, but cuMemMap maps one only whole (offset 0, its own size) and
// answers CUDA_ERROR_NOT_SUPPORTED for any other size (as driver 580 does), so a trial map of a fresh range
// tells. The range is unmapped and freed again; no access is ever set on it.
Napi::Value CudaHandleHasSize(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  uint64_t handle = U64Arg(info, 1, "handle");
  uint64_t size = U64Arg(info, 2, "size");
  auto exact = std::make_shared<bool>(false);
  return CudaWorker::Queue(
      env, device, Sized("cuMemAddressReserve+cuMemMap (size check)", size),
      [handle, size, exact] {
        cu::DevicePtr address = 0;
        cu::Result result = Injected("cuMemAddressReserve", [&] { return driver.api.cuMemAddressReserve(&address, size, 0, 0, 0); });
        if (result != cu::SUCCESS) return result;  // no range to try in: the driver's error, not an answer
        result = Injected("cuMemMap", [&] { return driver.api.cuMemMap(address, size, 0, handle, 0); });
        if (result == cu::SUCCESS) {
          *exact = true;
          result = driver.api.cuMemUnmap(address, size);
        } else if (result == cu::ERROR_NOT_SUPPORTED || result == cu::ERROR_INVALID_VALUE) {
          result = cu::SUCCESS;  // the driver's answer for a size that is not the allocation's
        }
        cu::Result freed = driver.api.cuMemAddressFree(address, size);
        return result != cu::SUCCESS ? result : freed;
      },
      [exact](Napi::Env env) { return Napi::Boolean::New(env, *exact).As<Napi::Value>(); });
}

// cudaImportFabric(buffer) -> Promise<handle>, on a driver thread.
Napi::Value CudaImportFabric(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  if (!info[0].IsBuffer() || info[0].As<Napi::Buffer<uint8_t>>().Length() != sizeof(cu::FabricHandle)) {
    ThrowArg(env, "a fabric handle is 64 bytes");
  }
  // Copied on the main thread: the worker touches no JavaScript memory.
  auto fabric = std::make_shared<cu::FabricHandle>();
  std::memcpy(fabric->data, info[0].As<Napi::Buffer<uint8_t>>().Data(), sizeof(fabric->data));
  auto handle = std::make_shared<cu::GenericHandle>(0);
  return CudaWorker::Run(
      env, InlineArg(info, 1), 0, "cuMemImportFromShareableHandle(FABRIC)",
      [fabric, handle] {
        return Injected("cuMemImportFromShareableHandle", [&] { return driver.api.cuMemImportFromShareableHandle(handle.get(), fabric.get(), cu::HANDLE_FABRIC); });
      },
      [handle](Napi::Env env) { return Big(env, *handle).As<Napi::Value>(); });
}

// cudaAllocationProperties(handle) -> { locationType, locationId, requestedHandleTypes }
Napi::Value CudaAllocationProperties(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  uint64_t handle = U64Arg(info, 0, "handle");
  cu::MemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  Check(env, UseDevice(0), "cuCtxSetCurrent");
  Check(env, driver.api.cuMemGetAllocationPropertiesFromHandle(&prop, handle), "cuMemGetAllocationPropertiesFromHandle");
  Napi::Object out = Napi::Object::New(env);
  out.Set("locationType", Napi::Number::New(env, prop.location.type));
  out.Set("locationId", Napi::Number::New(env, prop.location.id));
  out.Set("requestedHandleTypes", Napi::Number::New(env, prop.requestedHandleTypes));
  return out;
}

// cudaRetainHandle(address) -> handle
Napi::Value CudaRetainHandle(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  uint64_t address = U64Arg(info, 0, "address");
  Check(env, UseDevice(0), "cuCtxSetCurrent");
  cu::GenericHandle handle = 0;
  Check(env,
        driver.api.cuMemRetainAllocationHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(address))),
        "cuMemRetainAllocationHandle");
  return Big(env, handle);
}

// cudaCopyToDevice(device, address, buffer) -> Promise<void>
Napi::Value CudaCopyToDevice(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  uint64_t address = U64Arg(info, 1, "address");
  if (!info[2].IsBuffer()) ThrowArg(env, "data must be a Buffer");
  Napi::Buffer<uint8_t> data = info[2].As<Napi::Buffer<uint8_t>>();
  auto keep = std::make_shared<Napi::Reference<Napi::Buffer<uint8_t>>>(Napi::Persistent(data));
  const uint8_t* source = data.Data();
  size_t length = data.Length();
  return CudaWorker::Queue(
      env, device, Sized("cuMemcpyHtoDAsync", length),
      [device, address, source, length] { return CopyToDevice(device, address, source, length); },
      [keep](Napi::Env env) {
        keep->Reset();
        return env.Undefined();
      },
      address);
}

// cudaCopyFromDevice(device, address, length) -> Promise<Buffer>
Napi::Value CudaCopyFromDevice(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  uint64_t address = U64Arg(info, 1, "address");
  uint64_t length = U64Arg(info, 2, "length");
  Napi::Buffer<uint8_t> buffer;
  if (info.Length() > 3 && !info[3].IsUndefined()) {
    if (!info[3].IsBuffer()) ThrowArg(env, "into must be a Buffer");
    buffer = info[3].As<Napi::Buffer<uint8_t>>();
    if (buffer.Length() < length) ThrowArg(env, "into is shorter than length");
  } else {
    buffer = Napi::Buffer<uint8_t>::New(env, static_cast<size_t>(length));
  }
  auto keep = std::make_shared<Napi::Reference<Napi::Buffer<uint8_t>>>(Napi::Persistent(buffer));
  uint8_t* target = buffer.Data();
  return CudaWorker::Queue(
      env, device, Sized("cuMemcpyDtoHAsync", length),
      [device, address, target, length] { return CopyFromDevice(device, target, address, length); },
      [keep](Napi::Env env) {
        Napi::Value value = keep->Value();
        keep->Reset();
        return value;
      },
      address);
}

// cudaCopyPieces(device, pieces, lanes) -> Promise<void>: `pieces` a BigUint64Array of
// (target, source, length) triples of addresses this process mapped for the device (device
// memory, host memory mapped with device access), copied on `lanes` streams; resolves once
// every byte is in place. No Buffer holds the bytes: a copy may be of any size.
Napi::Value CudaCopyPieces(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_biguint64_array) {
    ThrowArg(env, "pieces must be a BigUint64Array");
  }
  Napi::TypedArrayOf<uint64_t> flat = info[1].As<Napi::TypedArrayOf<uint64_t>>();
  if (flat.ElementLength() % 3 != 0) ThrowArg(env, "pieces holds (target, source, length) triples");
  uint32_t lanes = info[2].As<Napi::Number>().Uint32Value();
  if (lanes == 0 || lanes > 16) ThrowArg(env, "lanes must be 1 to 16");
  auto pieces = std::make_shared<std::vector<CopyPiece>>();
  uint64_t total = 0;
  for (size_t index = 0; index + 2 < flat.ElementLength(); index += 3) {
    pieces->push_back({flat[index], flat[index + 1], flat[index + 2]});
    total += flat[index + 2];
  }
  return CudaWorker::Queue(
      env, device, Sized("cuMemcpyAsync", total), [device, pieces, lanes] { return CopyPieces(device, *pieces, lanes); }, nullptr,
      pieces->empty() ? 0 : pieces->front().target);
}

// cudaCanAccessPeer(device, peer) -> boolean
Napi::Value CudaCanAccessPeer(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = info[0].As<Napi::Number>().Int32Value();
  int peer = info[1].As<Napi::Number>().Int32Value();
  if (device == peer) return Napi::Boolean::New(env, true);
  int can = 0;
  Check(env, driver.api.cuDeviceCanAccessPeer(&can, device, peer), "cuDeviceCanAccessPeer");
  return Napi::Boolean::New(env, can == 1);
}

// cudaHostRegister(device, address, size, mapped) -> device pointer (0n when not mapped).
// Page-locks client memory (mempin); `mapped` also maps it into the device's address space.
Napi::Value CudaHostRegister(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  void* address = reinterpret_cast<void*>(static_cast<uintptr_t>(U64Arg(info, 1, "address")));
  uint64_t size = U64Arg(info, 2, "size");
  bool mapped = info[3].As<Napi::Boolean>().Value();
  // A context must be current on this thread (a client that has made no other call yet has none).
  Check(env, UseDevice(device), "cuCtxSetCurrent");
  unsigned int flags = cu::HOST_REGISTER_PORTABLE | (mapped ? cu::HOST_REGISTER_DEVICEMAP : 0);
  Check(env, driver.api.cuMemHostRegister_v2(address, size, flags), Sized("cuMemHostRegister", size));
  cu::DevicePtr devicePointer = 0;
  if (mapped) {
    cu::Result result = driver.api.cuMemHostGetDevicePointer_v2(&devicePointer, address, 0);
    if (result != cu::SUCCESS) {
      driver.api.cuMemHostUnregister(address);
      throw CudaError(env, result, "cuMemHostGetDevicePointer");
    }
  }
  return Big(env, devicePointer);
}

// cudaPinHost(device, address, size) -> Promise<void>: cuMemHostRegister (portable: every
// context sees it page-locked) on a driver thread, where page-locking tens of MiB takes
// milliseconds that the daemon's event loop cannot spare. Copies between device memory and
// the range are then DMAs of the copy engine (the daemon's staging buffers).
Napi::Value CudaPinHost(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  uint64_t address = U64Arg(info, 1, "address");
  uint64_t size = U64Arg(info, 2, "size");
  return CudaWorker::Queue(
      env, device, Sized("cuMemHostRegister", size),
      [address, size] {
        return Injected("cuMemHostRegister", [&] { return driver.api.cuMemHostRegister_v2(reinterpret_cast<void*>(static_cast<uintptr_t>(address)), size, cu::HOST_REGISTER_PORTABLE); });
      },
      nullptr, address);
}

// cudaUnpinHost(device, address) -> Promise<void>: cuMemHostUnregister on a driver thread.
Napi::Value CudaUnpinHost(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  uint64_t address = U64Arg(info, 1, "address");
  return CudaWorker::Queue(
      env, device, "cuMemHostUnregister",
      [address] { return Injected("cuMemHostUnregister", [&] { return driver.api.cuMemHostUnregister(reinterpret_cast<void*>(static_cast<uintptr_t>(address))); }); },
      nullptr, address);
}

Napi::Value CudaHostUnregister(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RequireDriver(env);
  int device = DeviceArg(info, 0);
  void* address = reinterpret_cast<void*>(static_cast<uintptr_t>(U64Arg(info, 1, "address")));
  Check(env, UseDevice(device), "cuCtxSetCurrent");
  Check(env, driver.api.cuMemHostUnregister(address), "cuMemHostUnregister");
  return env.Undefined();
}

}  // namespace

void InitCudaDriver(Napi::Env env, Napi::Object exports) {
  exports.Set("cudaLoad", Napi::Function::New(env, CudaLoad, "cudaLoad"));
  exports.Set("cudaDevices", Napi::Function::New(env, CudaDevices, "cudaDevices"));
  exports.Set("cudaMemGetInfo", Napi::Function::New(env, CudaMemGetInfo, "cudaMemGetInfo"));
  exports.Set("cudaGranularity", Napi::Function::New(env, CudaGranularity, "cudaGranularity"));
  exports.Set("cudaReserve", Napi::Function::New(env, CudaReserve, "cudaReserve"));
  exports.Set("cudaFreeAddress", Napi::Function::New(env, CudaFreeAddress, "cudaFreeAddress"));
  exports.Set("cudaCreate", Napi::Function::New(env, CudaCreate, "cudaCreate"));
  exports.Set("cudaRelease", Napi::Function::New(env, CudaRelease, "cudaRelease"));
  exports.Set("cudaMap", Napi::Function::New(env, CudaMap, "cudaMap"));
  exports.Set("cudaUnmap", Napi::Function::New(env, CudaUnmap, "cudaUnmap"));
  exports.Set("cudaUnmapMany", Napi::Function::New(env, CudaUnmapMany, "cudaUnmapMany"));
  exports.Set("cudaSynchronize", Napi::Function::New(env, CudaSynchronize, "cudaSynchronize"));
  exports.Set("cudaSetAccess", Napi::Function::New(env, CudaSetAccess, "cudaSetAccess"));
  exports.Set("cudaGetAccess", Napi::Function::New(env, CudaGetAccess, "cudaGetAccess"));
  exports.Set("cudaExportFd", Napi::Function::New(env, CudaExportFd, "cudaExportFd"));
  exports.Set("cudaExportFabric", Napi::Function::New(env, CudaExportFabric, "cudaExportFabric"));
  exports.Set("cudaImportFd", Napi::Function::New(env, CudaImportFd, "cudaImportFd"));
  exports.Set("cudaImportMap", Napi::Function::New(env, CudaImportMap, "cudaImportMap"));
  exports.Set("cudaImportFabric", Napi::Function::New(env, CudaImportFabric, "cudaImportFabric"));
  exports.Set("cudaHandleHasSize", Napi::Function::New(env, CudaHandleHasSize, "cudaHandleHasSize"));
  exports.Set("cudaAllocationProperties", Napi::Function::New(env, CudaAllocationProperties, "cudaAllocationProperties"));
  exports.Set("cudaRetainHandle", Napi::Function::New(env, CudaRetainHandle, "cudaRetainHandle"));
  exports.Set("cudaCopyToDevice", Napi::Function::New(env, CudaCopyToDevice, "cudaCopyToDevice"));
  exports.Set("cudaCopyFromDevice", Napi::Function::New(env, CudaCopyFromDevice, "cudaCopyFromDevice"));
  exports.Set("cudaCopyPieces", Napi::Function::New(env, CudaCopyPieces, "cudaCopyPieces"));
  exports.Set("cudaCanAccessPeer", Napi::Function::New(env, CudaCanAccessPeer, "cudaCanAccessPeer"));
  exports.Set("cudaHostRegister", Napi::Function::New(env, CudaHostRegister, "cudaHostRegister"));
  exports.Set("cudaHostUnregister", Napi::Function::New(env, CudaHostUnregister, "cudaHostUnregister"));
  exports.Set("cudaPinHost", Napi::Function::New(env, CudaPinHost, "cudaPinHost"));
  exports.Set("cudaUnpinHost", Napi::Function::New(env, CudaUnpinHost, "cudaUnpinHost"));
  exports.Set("cudaCreateExported", Napi::Function::New(env, CudaCreateExported, "cudaCreateExported"));
  exports.Set("cudaMemAlloc", Napi::Function::New(env, CudaMemAlloc, "cudaMemAlloc"));
  exports.Set("cudaMemFree", Napi::Function::New(env, CudaMemFree, "cudaMemFree"));
}

}  // namespace vmmd
