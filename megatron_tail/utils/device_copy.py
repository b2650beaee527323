"""Host-to-device copies that do not wait for the device.

`tensor.to(cuda)` from host memory blocks until the GPU has run everything queued before it: torch copies
with `c10::cuda::memcpy_and_sync` unless asked `non_blocking` (c10/cuda/CUDAFunctions.h: the copy, then a
sync of the current stream; `torch.cuda.set_sync_debug_mode` reports it as a sync). Once per micro-batch,
that drains the GPU's queue and leaves it idle while the host queues the next forward. With
`non_blocking=True` from pageable memory, torch makes no sync of its own, and CUDA stages the host buffer
before returning (CUDA Runtime API, "API synchronization behavior", asynchronous memcpy), so the source may
be freed or changed at once; the kernels that read the copy run after it in stream order. The driver may
still wait on the stream while it stages pageable memory (same page), which torch's sync debug mode cannot
see: pinned staging buffers would remove that too (measure with nsys first). A device-to-host copy stays
blocking: the host reads it next.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`; from the host without waiting for the device (the module's docstring), any
    other way as `Tensor.to` does it (a no-op where it is already there)."""
    return tensor.to(device, non_blocking=tensor.device.type == "cpu")
