"""Host buffers for adapter snapshots, reused once nothing holds them.

Each new adapter version leaves the learner as a snapshot of its flat buffer in host memory
(``MultiAdapterLearner.export_adapter``), and an engine serves a version from that buffer while
the next one is made. A fresh allocation of that size is, more often than not, fresh pages from
the kernel (the allocator maps and unmaps chunks this large): for a 20 MB adapter the page faults
took 10 times as long as the copy itself. Here a snapshot's memory is a numpy array this pool
keeps, handed out through ``torch.from_numpy``, whose storage holds a reference to the array for
as long as any tensor, view or exported buffer of it lives. An array whose only holder is the pool
(``sys.getrefcount``) is free: the next snapshot of its size is copied into it, into pages already
mapped. Nothing else can take a new reference to an array the pool keeps private, so an array seen
free stays free until the pool hands it out again.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

# sys.getrefcount of an array held by the pool's list alone: that reference and the call's argument.
_FREE_REFCOUNT = 2
_ALIGN = 64  # bytes: what torch's own allocator gives; a copy into a less aligned buffer is slower


class SnapshotBuffers:
    """Reusable host buffers: ``take(numel, dtype)`` is an uninitialised 1-D CPU tensor whose
    memory the pool gets back when every tensor of it is gone. Keeps at most ``keep`` arrays:
    free ones beyond that are dropped, oldest first; an array in use is never dropped or reused."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            free = [i for i in self._free_indexes() if self._arrays[i].nbytes == nbytes]
            if free:  # moved to the end: most recently used last, so _trim drops the oldest free ones
                self._arrays.append(self._arrays.pop(free[0]))
            else:
                self._trim(room_for=1)  # before the append: a new array is free until handed out
                self._arrays.append(_aligned(nbytes))
            return torch.from_numpy(self._arrays[-1]).view(dtype)

    def in_use(self) -> int:
        """How many of the pool's buffers some tensor still holds."""
        with self._lock:
            return len(self._arrays) - len(self._free_indexes())

    def _free_indexes(self) -> list[int]:
        # Indexing hands getrefcount the list's reference as its argument: no local name adds one.
        return [i for i in range(len(self._arrays)) if sys.getrefcount(self._arrays[i]) <= _FREE_REFCOUNT]

    def _trim(self, room_for: int) -> None:
        excess = len(self._arrays) + room_for - self.keep
        for i in reversed(self._free_indexes()[: max(excess, 0)]):
            del self._arrays[i]


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of uint8 starting on an ``_ALIGN`` boundary (a slice of a slightly larger array,
    which it keeps alive as its base)."""
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes]


__all__ = ["SnapshotBuffers"]
