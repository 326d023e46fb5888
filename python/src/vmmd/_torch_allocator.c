/*
 * The allocation functions that torch.cuda.memory.CUDAPluggableAllocator
 * loads, calling back into the Python client (vmmd.torch) for every segment
 * PyTorch asks of a MemPool: the Python side carves vmmd memory, PyTorch's
 * caching allocator does the rest. The callbacks are ctypes functions, which
 * take the GIL themselves; a NULL return is PyTorch's out of memory.
 * Built on install (setup.py, optional), or by vmmd.torch with the host's cc.
 */
#include <stddef.h>
#include <sys/types.h>

typedef void *(*vmmd_malloc_fn)(ssize_t size, int device, void *stream);
typedef void (*vmmd_free_fn)(void *ptr, ssize_t size, int device, void *stream);

static vmmd_malloc_fn malloc_callback;
static vmmd_free_fn free_callback;

void vmmd_set_callbacks(vmmd_malloc_fn allocate, vmmd_free_fn release) {
  malloc_callback = allocate;
  free_callback = release;
}

void *vmmd_torch_malloc(ssize_t size, int device, void *stream) {
  return malloc_callback != NULL ? malloc_callback(size, device, stream) : NULL;
}

void vmmd_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  if (free_callback != NULL) free_callback(ptr, size, device, stream);
}

/* Importable as a module too, so that setuptools can build it as an extension. */
#ifdef VMMD_PYTHON_MODULE
#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_torch_allocator", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__torch_allocator(void) { return PyModule_Create(&module); }
#endif
