// The CUDA driver's VMM API, loaded with dlopen at run time (cuda_api.h).
#pragma once

#include <napi.h>

namespace vmmd {
void InitCudaDriver(Napi::Env env, Napi::Object exports);
}
