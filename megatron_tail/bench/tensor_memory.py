"""The peak of live tensor storage in a region, on any device: a CPU's stand-in for CUDA's allocator
statistics (`torch.cuda.max_memory_allocated`), which `bench.op_peers.measure` reports off CUDA."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Counts, while active, the bytes of the tensor storages aten ops create that are still referenced
    (`now`), and their maximum (`peak`). Storage sizes, not allocator blocks; a temporary that lives and
    dies inside one aten op is not seen; storages that existed before (the inputs) are not counted: so
    `peak` is the region's peak extra memory, as `max_memory_allocated` less what was allocated before."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # frees are seen at the next op: sweep first, so that a freed storage's address can be reused
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.now -= nbytes
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._live:
                    self._live[key] = (StorageWeakRef(storage), nbytes)
                    self.now += nbytes
        self.peak = max(self.peak, self.now)
        return out
