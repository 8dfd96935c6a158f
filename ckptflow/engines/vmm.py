"""Device memory whose physical backing can leave while its addresses stay (CUDA VMM).

What vLLM's sleep mode does with its cumem allocator, for the GPU demo engines: a range of
virtual addresses is reserved once; physical memory is created and mapped into it, released
before a template checkpoint (so the CUDA checkpoint and the CRIU image never carry it) and
mapped again at the *same* addresses after the restore, so CUDA graphs and every tensor view
over it stay valid (measured across CRIU on the H200: ../notes in DESIGN, docs/engines).

Example (on a GPU node):
    >>> r = Region(16 << 30)                 # doctest: +SKIP
    >>> w = r.tensor()                       # a torch uint8 view, zero-copy   # doctest: +SKIP
    >>> r.release(); r.map()                 # same w.data_ptr(), fresh (uninitialised) memory  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from cuda.bindings import driver as cu

PIECE = 2 << 30   # mapped in pieces: one huge cuMemCreate can fail on a fragmented device


def cuda_ok(res):
    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


class _Cai:
    """Just enough of __cuda_array_interface__ for torch.as_tensor to wrap a pointer."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class Region:
    """A reserved virtual range of ``nbytes`` (rounded up to the granularity), mapped on creation."""

    def __init__(self, nbytes: int, device: int = 0):
        torch.cuda.init()
        self.device = device
        self.ctx = cuda_ok(cu.cuCtxGetCurrent())
        if not int(self.ctx):  # torch made its primary context current lazily on another thread
            dev = cuda_ok(cu.cuDeviceGet(device))
            self.ctx = cuda_ok(cu.cuDevicePrimaryCtxRetain(dev))
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device
        gran = cuda_ok(cu.cuMemGetAllocationGranularity(
            self.prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        self.gran = int(gran)
        self.nbytes = nbytes
        self.size = -(-nbytes // self.gran) * self.gran
        self._current()
        self.ptr = int(cuda_ok(cu.cuMemAddressReserve(self.size, 0, 0, 0)))
        self.handles: list[tuple[int, int, object]] = []
        self.map()

    def _current(self) -> None:
        cuda_ok(cu.cuCtxSetCurrent(self.ctx))  # HTTP handler threads start without a current context

    @property
    def mapped(self) -> bool:
        return bool(self.handles)

    def map(self) -> None:
        """Back the whole range with new physical memory (contents undefined)."""
        if self.handles:
            return
        self._current()
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        piece = max(self.gran, PIECE // self.gran * self.gran)
        for off in range(0, self.size, piece):
            n = min(piece, self.size - off)
            h = cuda_ok(cu.cuMemCreate(n, self.prop, 0))
            cuda_ok(cu.cuMemMap(self.ptr + off, n, 0, h, 0))
            self.handles.append((off, n, h))
        cuda_ok(cu.cuMemSetAccess(self.ptr, self.size, [access], 1))

    def release(self) -> None:
        """Give the physical memory back to the driver; the addresses stay reserved."""
        if not self.handles:
            return
        torch.cuda.synchronize()
        self._current()
        for off, n, h in self.handles:
            cuda_ok(cu.cuMemUnmap(self.ptr + off, n))
            cuda_ok(cu.cuMemRelease(h))
        self.handles = []

    def tensor(self) -> torch.Tensor:
        """The range as a flat torch uint8 tensor (no copy; valid while mapped)."""
        return torch.as_tensor(_Cai(self.ptr, self.nbytes), device=f"cuda:{self.device}")
