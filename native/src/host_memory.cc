#include "host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>
#include <string>

#include "errors.h"
#include "faults.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace vmmd {
namespace {

void* AddressArg(const Napi::CallbackInfo& info, size_t index) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(U64Arg(info, index, "address")));
}

std::string Sized(const char* call, uint64_t size) {
  return std::string(call) + "(" + std::to_string(size) + ")";
}

// hostMemfdCreate(name, size[, mode]) -> fd, sealed against resizing, with
// permission bits `mode` (the caller's choice; 0600 when not given).
Napi::Value HostMemfdCreate(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string name = info[0].As<Napi::String>().Utf8Value();
  uint64_t size = U64Arg(info, 1, "size");
  mode_t mode = info.Length() > 2 && info[2].IsNumber() ? static_cast<mode_t>(info[2].As<Napi::Number>().Uint32Value() & 07777) : 0600;
  int fd = faults::Inject("memfd_create") ? -1 : memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) ThrowErrno(env, Sized("memfd_create", size));
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    throw ErrnoError(env, err, Sized("ftruncate", size));
  }
  // Neither shrink (mapped pages turn into SIGBUS for every process that maps
  // them) nor grow (memory past what was counted) through any descriptor.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    int err = errno;
    close(fd);
    throw ErrnoError(env, err, "fcntl(F_ADD_SEALS)");
  }
  // A memfd is created mode 0777: any holder of a read-only descriptor could
  // reopen it read-write through /proc/self/fd.
  if (fchmod(fd, mode) != 0) {
    int err = errno;
    close(fd);
    throw ErrnoError(env, err, "fchmod");
  }
  return Napi::Number::New(env, fd);
}

// hostFchmod(fd, mode): fchmod as asked (which mode a client's memfd needs is
// the TypeScript layer's rule).
Napi::Value HostFchmod(const Napi::CallbackInfo& info) {
  int fd = FdArg(info, 0, "fd");
  mode_t mode = static_cast<mode_t>(info[1].As<Napi::Number>().Uint32Value() & 07777);
  if (faults::Inject("fchmod") || fchmod(fd, mode) != 0) ThrowErrno(info.Env(), "fchmod");
  return info.Env().Undefined();
}

// _memfdCreate(name, size, allowSealing) -> fd: a memfd with no seals, as any
// program may make one (tests: the descriptors a careless or hostile client sends).
Napi::Value DiagnosticMemfdCreate(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string name = info[0].As<Napi::String>().Utf8Value();
  uint64_t size = U64Arg(info, 1, "size");
  bool allowSealing = info[2].ToBoolean().Value();
  int fd = memfd_create(name.c_str(), MFD_CLOEXEC | (allowSealing ? MFD_ALLOW_SEALING : 0));
  if (fd < 0) ThrowErrno(env, Sized("memfd_create", size));
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    throw ErrnoError(env, err, Sized("ftruncate", size));
  }
  return Napi::Number::New(env, fd);
}

// hostMemfdSealReadOnly(fd): no new writable mappings and no write(2) through
// any descriptor of this file; existing writable mappings keep working.
Napi::Value HostMemfdSealReadOnly(const Napi::CallbackInfo& info) {
  int fd = FdArg(info, 0, "fd");
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE) != 0) {
    ThrowErrno(info.Env(), "fcntl(F_ADD_SEALS)");
  }
  return info.Env().Undefined();
}

// hostMemfdAddSeals(fd, seals): F_ADD_SEALS as asked. Which seals a client's
// memfd needs is the TypeScript layer's rule (server/client-memfd.ts).
Napi::Value HostMemfdAddSeals(const Napi::CallbackInfo& info) {
  int fd = FdArg(info, 0, "fd");
  int seals = info[1].As<Napi::Number>().Int32Value();
  if (faults::Inject("fcntl:seal") || fcntl(fd, F_ADD_SEALS, seals) != 0) ThrowErrno(info.Env(), "fcntl(F_ADD_SEALS)");
  return info.Env().Undefined();
}

// hostFdInfo(fd) -> { size, memfd, seals, mode, inode, device }. `memfd` is true when the
// descriptor accepts F_GET_SEALS, which only memfds (and shmem files) do.
Napi::Value HostFdInfo(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int fd = FdArg(info, 0, "fd");
  struct stat st;
  if (faults::Inject("fstat") || fstat(fd, &st) != 0) ThrowErrno(env, "fstat");
  int seals = fcntl(fd, F_GET_SEALS);
  int flags = fcntl(fd, F_GETFL);
  Napi::Object out = Napi::Object::New(env);
  out.Set("size", Napi::BigInt::New(env, static_cast<uint64_t>(st.st_size)));
  out.Set("regular", Napi::Boolean::New(env, S_ISREG(st.st_mode)));
  out.Set("memfd", Napi::Boolean::New(env, seals >= 0 && S_ISREG(st.st_mode)));
  out.Set("seals", Napi::Number::New(env, seals < 0 ? 0 : seals));
  out.Set("readOnlySealed", Napi::Boolean::New(env, seals >= 0 && (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0));
  out.Set("accessMode", Napi::Number::New(env, flags < 0 ? -1 : (flags & O_ACCMODE)));
  out.Set("mode", Napi::Number::New(env, st.st_mode & 07777));
  out.Set("uid", Napi::Number::New(env, st.st_uid));
  out.Set("inode", Napi::BigInt::New(env, static_cast<uint64_t>(st.st_ino)));
  // With the inode, the file's identity: what the quotas count physical memory by.
  out.Set("device", Napi::BigInt::New(env, static_cast<uint64_t>(st.st_dev)));
  return out;
}

// hostReserve(size, alignment, hint) -> address. PROT_NONE and MAP_NORESERVE:
// address space only, like cuMemAddressReserve. Over-reserves to align, then
// trims both ends.
Napi::Value HostReserve(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  uint64_t size = U64Arg(info, 0, "size");
  uint64_t alignment = U64Arg(info, 1, "alignment");
  uint64_t hint = U64Arg(info, 2, "hint");
  if (size == 0 || alignment == 0 || (alignment & (alignment - 1)) != 0) ThrowArg(env, "bad size or alignment");
  uint64_t span = size + alignment;
  if (span < size) throw ErrnoError(env, ENOMEM, Sized("mmap", size));
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  if (hint != 0 && hint % alignment == 0) {
    void* fixed = mmap(reinterpret_cast<void*>(hint), size, PROT_NONE, flags | MAP_FIXED_NOREPLACE, -1, 0);
    if (fixed == reinterpret_cast<void*>(hint)) return Napi::BigInt::New(env, static_cast<uint64_t>(hint));
    if (fixed != MAP_FAILED) munmap(fixed, size);  // old kernels treat the flag as a hint
  }
  void* base = faults::Inject("mmap:reserve") ? MAP_FAILED : mmap(nullptr, span, PROT_NONE, flags, -1, 0);
  if (base == MAP_FAILED) ThrowErrno(env, Sized("mmap", size));
  uintptr_t start = reinterpret_cast<uintptr_t>(base);
  uintptr_t aligned = (start + alignment - 1) & ~(static_cast<uintptr_t>(alignment) - 1);
  if (aligned > start) munmap(base, aligned - start);
  uintptr_t end = start + span;
  if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - (aligned + size));
  return Napi::BigInt::New(env, static_cast<uint64_t>(aligned));
}

Napi::Value HostFreeAddress(const Napi::CallbackInfo& info) {
  void* address = AddressArg(info, 0);
  uint64_t size = U64Arg(info, 1, "size");
  if (faults::Inject("munmap") || munmap(address, size) != 0) ThrowErrno(info.Env(), Sized("munmap", size));
  return info.Env().Undefined();
}

// hostMap(address, size, fd, offset): the memfd's pages replace the reserved
// range, with no access until hostProtect, as after cuMemMap.
Napi::Value HostMap(const Napi::CallbackInfo& info) {
  void* address = AddressArg(info, 0);
  uint64_t size = U64Arg(info, 1, "size");
  int fd = FdArg(info, 2, "fd");
  uint64_t offset = U64Arg(info, 3, "offset");
  void* mapped = faults::Inject("mmap:map") ? MAP_FAILED : mmap(address, size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, static_cast<off_t>(offset));
  if (mapped == MAP_FAILED) ThrowErrno(info.Env(), Sized("mmap", size));
  return info.Env().Undefined();
}

// hostUnmap(address, size): back to reserved, inaccessible address space.
Napi::Value HostUnmap(const Napi::CallbackInfo& info) {
  void* address = AddressArg(info, 0);
  uint64_t size = U64Arg(info, 1, "size");
  void* reserved = faults::Inject("mmap:unmap") ? MAP_FAILED : mmap(address, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (reserved == MAP_FAILED) ThrowErrno(info.Env(), Sized("mmap", size));
  return info.Env().Undefined();
}

// hostProtect(address, size, access): 0 none, 1 read, 3 read-write.
Napi::Value HostProtect(const Napi::CallbackInfo& info) {
  void* address = AddressArg(info, 0);
  uint64_t size = U64Arg(info, 1, "size");
  uint32_t access = info[2].As<Napi::Number>().Uint32Value();
  int prot = PROT_NONE;
  if (access & 1) prot |= PROT_READ;
  if (access & 2) prot |= PROT_WRITE;
  if (faults::Inject("mprotect") || mprotect(address, size, prot) != 0) ThrowErrno(info.Env(), Sized("mprotect", size));
  return info.Env().Undefined();
}

// Copies run on a worker thread: a large copy must never stall the event loop.
class CopyWorker : public Napi::AsyncWorker {
 public:
  CopyWorker(Napi::Env env, void* dst, const void* src, size_t size, Napi::Reference<Napi::Buffer<uint8_t>> keep,
             bool resolveWithBuffer)
      : Napi::AsyncWorker(env, "vmmd:copy"),
        deferred_(Napi::Promise::Deferred::New(env)),
        dst_(dst),
        src_(src),
        size_(size),
        keep_(std::move(keep)),
        resolveWithBuffer_(resolveWithBuffer) {}

  Napi::Promise Promise() { return deferred_.Promise(); }

  void Execute() override { std::memcpy(dst_, src_, size_); }

  void OnOK() override {
    Napi::Env env = Env();
    if (resolveWithBuffer_) {
      deferred_.Resolve(keep_.Value());
    } else {
      deferred_.Resolve(env.Undefined());
    }
  }

  void OnError(const Napi::Error& error) override { deferred_.Reject(error.Value()); }

 private:
  Napi::Promise::Deferred deferred_;
  void* dst_;
  const void* src_;
  size_t size_;
  Napi::Reference<Napi::Buffer<uint8_t>> keep_;
  bool resolveWithBuffer_;
};

// hostCopyFromAddress(address, length[, into]) -> Promise<Buffer>: a new Buffer, or `into` (at least length bytes) filled.
Napi::Value HostCopyFromAddress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  void* address = AddressArg(info, 0);
  uint64_t length = U64Arg(info, 1, "length");
  Napi::Buffer<uint8_t> buffer;
  if (info.Length() > 2 && !info[2].IsUndefined()) {
    if (!info[2].IsBuffer()) ThrowArg(env, "into must be a Buffer");
    buffer = info[2].As<Napi::Buffer<uint8_t>>();
    if (buffer.Length() < length) ThrowArg(env, "into is shorter than length");
  } else {
    buffer = Napi::Buffer<uint8_t>::New(env, static_cast<size_t>(length));
  }
  auto* worker = new CopyWorker(env, buffer.Data(), address, static_cast<size_t>(length),
                                Napi::Persistent(buffer), true);
  Napi::Promise promise = worker->Promise();
  worker->Queue();
  return promise;
}

// hostCopyToAddress(address, buffer) -> Promise<void>
Napi::Value HostCopyToAddress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  void* address = AddressArg(info, 0);
  if (!info[1].IsBuffer()) ThrowArg(env, "data must be a Buffer");
  Napi::Buffer<uint8_t> buffer = info[1].As<Napi::Buffer<uint8_t>>();
  auto* worker = new CopyWorker(env, address, buffer.Data(), buffer.Length(), Napi::Persistent(buffer), false);
  Napi::Promise promise = worker->Promise();
  worker->Queue();
  return promise;
}

// Copies (target, source, length) pieces of mapped memory on a worker thread, in order.
class PiecesWorker : public Napi::AsyncWorker {
 public:
  PiecesWorker(Napi::Env env, std::vector<uint64_t> pieces)
      : Napi::AsyncWorker(env, "vmmd:copy"), deferred_(Napi::Promise::Deferred::New(env)), pieces_(std::move(pieces)) {}

  Napi::Promise Promise() { return deferred_.Promise(); }

  void Execute() override {
    for (size_t index = 0; index + 2 < pieces_.size(); index += 3) {
      std::memmove(reinterpret_cast<void*>(static_cast<uintptr_t>(pieces_[index])),
                   reinterpret_cast<const void*>(static_cast<uintptr_t>(pieces_[index + 1])), static_cast<size_t>(pieces_[index + 2]));
    }
  }

  void OnOK() override { deferred_.Resolve(Env().Undefined()); }
  void OnError(const Napi::Error& error) override { deferred_.Reject(error.Value()); }

 private:
  Napi::Promise::Deferred deferred_;
  std::vector<uint64_t> pieces_;
};

// hostCopyPieces(pieces) -> Promise<void>: `pieces` a BigUint64Array of (target, source,
// length) triples of memory this process mapped, copied by pointer on a worker thread: no
// Buffer holds the bytes, so a copy may be of any size.
Napi::Value HostCopyPieces(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsTypedArray() || info[0].As<Napi::TypedArray>().TypedArrayType() != napi_biguint64_array) {
    ThrowArg(env, "pieces must be a BigUint64Array");
  }
  Napi::TypedArrayOf<uint64_t> flat = info[0].As<Napi::TypedArrayOf<uint64_t>>();
  if (flat.ElementLength() % 3 != 0) ThrowArg(env, "pieces holds (target, source, length) triples");
  std::vector<uint64_t> pieces(flat.Data(), flat.Data() + flat.ElementLength());
  auto* worker = new PiecesWorker(env, std::move(pieces));
  Napi::Promise promise = worker->Promise();
  worker->Queue();
  return promise;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Faults every page of a shared mapping in, writable, on a worker thread (the copy that
// follows then takes no page fault): MADV_POPULATE_WRITE. A kernel that predates it (EINVAL)
// or a range not mapped writable is refused with the errno; nothing is ever written.
class PopulateWorker : public Napi::AsyncWorker {
 public:
  PopulateWorker(Napi::Env env, uint8_t* address, size_t size)
      : Napi::AsyncWorker(env, "vmmd:populate"), deferred_(Napi::Promise::Deferred::New(env)), address_(address), size_(size) {}

  Napi::Promise Promise() { return deferred_.Promise(); }

  void Execute() override {
    if (madvise(address_, size_, MADV_POPULATE_WRITE) != 0) {
      SetError(std::string(strerror(errno)) + ": madvise(MADV_POPULATE_WRITE, " + std::to_string(size_) + ")");
    }
  }

  void OnOK() override { deferred_.Resolve(Env().Undefined()); }
  void OnError(const Napi::Error& error) override { deferred_.Reject(error.Value()); }

 private:
  Napi::Promise::Deferred deferred_;
  uint8_t* address_;
  size_t size_;
};

// hostPopulate(address, size) -> Promise<void>: every page of mapped memory faulted in, writable.
Napi::Value HostPopulate(const Napi::CallbackInfo& info) {
  auto* address = static_cast<uint8_t*>(AddressArg(info, 0));
  uint64_t size = U64Arg(info, 1, "size");
  auto* worker = new PopulateWorker(info.Env(), address, static_cast<size_t>(size));
  Napi::Promise promise = worker->Promise();
  worker->Queue();
  return promise;
}

// hostArrayBuffer(address, size) -> ArrayBuffer over mapped pages. The caller
// must detach it (hostDetachArrayBuffer) before unmapping.
Napi::Value HostArrayBuffer(const Napi::CallbackInfo& info) {
  void* address = AddressArg(info, 0);
  uint64_t size = U64Arg(info, 1, "size");
  return Napi::ArrayBuffer::New(info.Env(), address, static_cast<size_t>(size));
}

Napi::Value HostDetachArrayBuffer(const Napi::CallbackInfo& info) {
  Napi::ArrayBuffer buffer = info[0].As<Napi::ArrayBuffer>();
  if (!buffer.IsDetached()) buffer.Detach();
  return info.Env().Undefined();
}

// hostLock(address, size) / hostUnlock(address, size): mlock, the host
// backend's page-locking for mempin.
Napi::Value HostLock(const Napi::CallbackInfo& info) {
  void* address = AddressArg(info, 0);
  uint64_t size = U64Arg(info, 1, "size");
  if (mlock(address, size) != 0) ThrowErrno(info.Env(), Sized("mlock", size));
  return info.Env().Undefined();
}

Napi::Value HostUnlock(const Napi::CallbackInfo& info) {
  void* address = AddressArg(info, 0);
  uint64_t size = U64Arg(info, 1, "size");
  if (munlock(address, size) != 0) ThrowErrno(info.Env(), Sized("munlock", size));
  return info.Env().Undefined();
}

// addressOf(arrayBufferOrView) -> the address of its first byte.
Napi::Value AddressOf(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info[0].IsArrayBuffer()) {
    return Napi::BigInt::New(env, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(info[0].As<Napi::ArrayBuffer>().Data())));
  }
  if (info[0].IsTypedArray() || info[0].IsDataView()) {
    Napi::Object view = info[0].As<Napi::Object>();
    Napi::ArrayBuffer buffer = view.Get("buffer").As<Napi::ArrayBuffer>();
    uint64_t offset = static_cast<uint64_t>(view.Get("byteOffset").As<Napi::Number>().Int64Value());
    return Napi::BigInt::New(env, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(buffer.Data())) + offset);
  }
  ThrowArg(env, "addressOf takes an ArrayBuffer or a view of one");
}

Napi::Value PageSize(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), static_cast<double>(sysconf(_SC_PAGESIZE)));
}

Napi::Value Dup(const Napi::CallbackInfo& info) {
  int fd = FdArg(info, 0, "fd");
  int copy = faults::Inject("dup") ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) ThrowErrno(info.Env(), "dup(" + std::to_string(fd) + ")");
  return Napi::Number::New(info.Env(), copy);
}

Napi::Value Close(const Napi::CallbackInfo& info) {
  int fd = FdArg(info, 0, "fd");
  if (close(fd) != 0 && errno != EINTR) ThrowErrno(info.Env(), "close(" + std::to_string(fd) + ")");
  return info.Env().Undefined();
}

}  // namespace

void InitHostMemory(Napi::Env env, Napi::Object exports) {
  exports.Set("hostMemfdCreate", Napi::Function::New(env, HostMemfdCreate, "hostMemfdCreate"));
  exports.Set("hostMemfdSealReadOnly", Napi::Function::New(env, HostMemfdSealReadOnly, "hostMemfdSealReadOnly"));
  exports.Set("hostFchmod", Napi::Function::New(env, HostFchmod, "hostFchmod"));
  exports.Set("hostMemfdAddSeals", Napi::Function::New(env, HostMemfdAddSeals, "hostMemfdAddSeals"));
  exports.Set("_memfdCreate", Napi::Function::New(env, DiagnosticMemfdCreate, "_memfdCreate"));
  exports.Set("hostFdInfo", Napi::Function::New(env, HostFdInfo, "hostFdInfo"));
  exports.Set("hostReserve", Napi::Function::New(env, HostReserve, "hostReserve"));
  exports.Set("hostFreeAddress", Napi::Function::New(env, HostFreeAddress, "hostFreeAddress"));
  exports.Set("hostMap", Napi::Function::New(env, HostMap, "hostMap"));
  exports.Set("hostUnmap", Napi::Function::New(env, HostUnmap, "hostUnmap"));
  exports.Set("hostProtect", Napi::Function::New(env, HostProtect, "hostProtect"));
  exports.Set("hostCopyFromAddress", Napi::Function::New(env, HostCopyFromAddress, "hostCopyFromAddress"));
  exports.Set("hostCopyToAddress", Napi::Function::New(env, HostCopyToAddress, "hostCopyToAddress"));
  exports.Set("hostPopulate", Napi::Function::New(env, HostPopulate, "hostPopulate"));
  exports.Set("hostCopyPieces", Napi::Function::New(env, HostCopyPieces, "hostCopyPieces"));
  exports.Set("hostArrayBuffer", Napi::Function::New(env, HostArrayBuffer, "hostArrayBuffer"));
  exports.Set("hostDetachArrayBuffer", Napi::Function::New(env, HostDetachArrayBuffer, "hostDetachArrayBuffer"));
  exports.Set("pageSize", Napi::Function::New(env, PageSize, "pageSize"));
  exports.Set("hostLock", Napi::Function::New(env, HostLock, "hostLock"));
  exports.Set("hostUnlock", Napi::Function::New(env, HostUnlock, "hostUnlock"));
  exports.Set("addressOf", Napi::Function::New(env, AddressOf, "addressOf"));
  exports.Set("dup", Napi::Function::New(env, Dup, "dup"));
  exports.Set("close", Napi::Function::New(env, Close, "close"));
}

}  // namespace vmmd
