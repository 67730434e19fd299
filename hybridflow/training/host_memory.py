"""Host memory a GPU copies to and from asynchronously, page-locked in place.

torch's pinned allocator rounds each block up to a power of two: a 7B model's 22016 x 4096 bf16
fc1 weight takes 256 MiB for its 172, and its whole reference ~17.5 GiB for 12.55. One large
buffer registered with ``cudaHostRegister`` is locked at its own size; its users take views."""

from __future__ import annotations

import weakref

import torch

_locked: dict[int, weakref.finalize] = {}
"""Address of each locked buffer -> what unlocks it (once: when its owner is collected, or at
``unlock``)."""


def locked_buffer(numel: int, dtype: torch.dtype, owner: object, lock: bool) -> torch.Tensor:
    """A flat host tensor of ``numel`` elements of ``dtype``; with ``lock``, page-locked until
    ``owner`` is collected or ``unlock`` is called (the memory itself lives as long as its
    tensors; it must stay locked no shorter than any copy from it runs)."""
    buf = torch.empty(numel, dtype=dtype)
    if lock and numel:
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(),
                                                      numel * buf.element_size(), 0))
        if err:
            raise RuntimeError(f"cudaHostRegister of {numel * buf.element_size() / 2**30:.2f} GiB "
                               f"failed (CUDA error {err}): is locked memory limited (ulimit -l)?")
        _locked[buf.data_ptr()] = weakref.finalize(owner, _unregister, buf.data_ptr())
    return buf


def locked_copies(tensors: list[torch.Tensor], owner: object) -> list[torch.Tensor]:
    """Copies of device ``tensors`` in page-locked host memory, taken on the current stream
    without waiting for it: views of one ``locked_buffer`` per dtype, locked until ``owner`` is
    collected (module docstring: not one pinned block per tensor)."""
    copies: list = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = locked_buffer(sum(tensors[i].numel() for i in group), dtype, owner, lock=True)
        offset = 0
        for i in group:
            t = tensors[i]
            copies[i] = flat[offset:offset + t.numel()].view(t.shape).copy_(t, non_blocking=True)
            offset += t.numel()
    return copies


def unlock(buf: torch.Tensor) -> None:
    """Unlock a ``locked_buffer`` before its memory is freed (a no-op for one never locked)."""
    finalizer = _locked.get(buf.data_ptr())
    if finalizer is not None:
        finalizer()


def _unregister(address: int) -> None:
    _locked.pop(address, None)
    torch.cuda.cudart().cudaHostUnregister(address)
