/* Lines of cuda.h (CUDA 13.0, CUDA_VERSION 13000), copied as they stand by scripts/vendor-cuda-h.js
 * for test/unit/cuda-abi.test.ts: the prototypes of every function native/src/cuda_api.h
 * declares, the defines that map versioned names to them, and the typedefs of their types.
 * Not compiled. Copyright NVIDIA Corporation; see the CUDA toolkit EULA for cuda.h. */
#define CUDA_VERSION 13000
CUresult CUDAAPI cuInit(unsigned int Flags);
CUresult CUDAAPI cuDriverGetVersion(int *driverVersion);
CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr);
CUresult CUDAAPI cuDeviceGetCount(int *count);
CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal);
CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev);
#define cuDeviceGetUuid                     cuDeviceGetUuid_v2
CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
#define cuDeviceTotalMem                    cuDeviceTotalMem_v2
CUresult CUDAAPI cuDeviceTotalMem(size_t *bytes, CUdevice dev);
CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);
CUresult CUDAAPI cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx);
CUresult CUDAAPI cuCtxSynchronize(void);
CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult CUDAAPI cuStreamSynchronize(CUstream hStream);
#define cuMemGetInfo                        cuMemGetInfo_v2
CUresult CUDAAPI cuMemGetInfo(size_t *free, size_t *total);
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags);
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags);
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags);
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult CUDAAPI cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr);
CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle, CUmemAllocationHandleType handleType, unsigned long long flags);
CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, CUmemAllocationHandleType shHandleType);
CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, CUmemAllocationGranularity_flags option);
CUresult CUDAAPI cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle);
CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
#define cuMemcpyHtoDAsync                   __CUDA_API_PTSZ(cuMemcpyHtoDAsync_v2)
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream);
#define cuMemcpyDtoHAsync                   __CUDA_API_PTSZ(cuMemcpyDtoHAsync_v2)
CUresult CUDAAPI cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
#define cuMemHostRegister                   cuMemHostRegister_v2
CUresult CUDAAPI cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags);
CUresult CUDAAPI cuMemHostUnregister(void *p);
#define cuMemHostGetDevicePointer           cuMemHostGetDevicePointer_v2
CUresult CUDAAPI cuMemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned int Flags);
#define cuMemAlloc                          cuMemAlloc_v2
CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize);
#define cuMemFree                           cuMemFree_v2
CUresult CUDAAPI cuMemFree(CUdeviceptr dptr);
typedef CUdevice_v1 CUdevice;
typedef CUdeviceptr_v2 CUdeviceptr;
typedef CUmemAccessDesc_v1 CUmemAccessDesc;
typedef CUmemAllocationProp_v1 CUmemAllocationProp;
typedef CUmemGenericAllocationHandle_v1 CUmemGenericAllocationHandle;
typedef CUmemLocation_v1 CUmemLocation;
typedef enum CUdevice_attribute_enum CUdevice_attribute;
typedef enum CUmemAllocationGranularity_flags_enum CUmemAllocationGranularity_flags;
typedef enum CUmemAllocationHandleType_enum CUmemAllocationHandleType;
typedef enum cudaError_enum CUresult;
typedef int CUdevice_v1;
typedef struct CUctx_st *CUcontext;
typedef struct CUmemAccessDesc_st CUmemAccessDesc_v1;
typedef struct CUmemAllocationProp_st CUmemAllocationProp_v1;
typedef struct CUmemLocation_st CUmemLocation_v1;
typedef struct CUstream_st *CUstream;
typedef struct CUuuid_st CUuuid;
typedef unsigned long long CUdeviceptr_v2;
typedef unsigned long long CUmemGenericAllocationHandle_v1;
