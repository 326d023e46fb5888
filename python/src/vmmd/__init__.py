"""vmmd for Python: the client of the vmmd GPU memory daemon.

    import vmmd
    with vmmd.connect() as client:               # VMMD_SOCKET_DIR or the daemon's default
        memory = client.vmm.allocate(2 << 20)    # one round trip; mapped here
        memory.write(0, b"hello")

Integrations load lazily: vmmd.numba (NUMBA_CUDA_MEMORY_MANAGER=vmmd.numba),
vmmd.cupy (vmmd.cupy.use()), vmmd.torch (a MemPool), vmmd.weights (a file
loaded once into a named store, opened as arrays by many processes).
"""
from .client import (
    DEFAULT_STAGING_BYTES,
    AdminApi,
    DevicesApi,
    OpenedStore,
    StoresApi,
    VirtualMemoryApi,
    VmmdClient,
    connect,
    sealed_memfd,
    shared_client,
)
from .errors import OutOfMemoryError, VmmdConnectionError, VmmdError, VmmdTimeoutError
from .memory import ArrayView, CudaImportedMemory, HostImportedMemory, ImportedMemory
from .paths import default_socket_dir
from .session import ClientSession

__version__ = "0.3.0"  # = package.json's version
__all__ = [
    "AdminApi",
    "ArrayView",
    "ClientSession",
    "CudaImportedMemory",
    "DEFAULT_STAGING_BYTES",
    "DevicesApi",
    "HostImportedMemory",
    "ImportedMemory",
    "OpenedStore",
    "OutOfMemoryError",
    "StoresApi",
    "VirtualMemoryApi",
    "VmmdClient",
    "VmmdConnectionError",
    "VmmdError",
    "VmmdTimeoutError",
    "connect",
    "default_socket_dir",
    "sealed_memfd",
    "shared_client",
]
