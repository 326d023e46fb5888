// Errors thrown by the native layer. Every error carries a string `code`
// (an errno name such as "EBADF" or a CUresult name) and the raw number in a
// separate property (`errno` or `result`). `.code` is never a number: grpc-js
// would send a numeric `code` as the gRPC status unchanged.
#pragma once

#include <napi.h>
#include <string>

namespace vmmd {

// The symbolic name of an errno value ("ENOMEM"), or "E<number>" when unknown.
std::string ErrnoName(int err);

// "ENOMEM: mmap(2097152): Cannot allocate memory" with code "ENOMEM", errno 12.
Napi::Error ErrnoError(Napi::Env env, int err, const std::string& call);

// Throws ErrnoError for the current errno.
[[noreturn]] void ThrowErrno(Napi::Env env, const std::string& call);

// Throws a TypeError with code "ERR_INVALID_ARG" (programming errors in the
// TypeScript layer, never user input: that is validated before it gets here).
[[noreturn]] void ThrowArg(Napi::Env env, const std::string& message);

// Argument readers shared by every area. Integers may be passed as number or
// bigint; sizes and addresses are 64-bit and must be exact.
uint64_t U64Arg(const Napi::CallbackInfo& info, size_t index, const char* name);
int FdArg(const Napi::CallbackInfo& info, size_t index, const char* name);

}  // namespace vmmd
