"""Bytes autograd saves for backward in a training forward, by region (run inside a rank).

A `saved_tensors_hooks` pack hook sees every tensor an autograd node saves (`save_for_backward` in custom
Functions included). Storages are counted once (views of one output count once, as in memory), parameters
and integer tensors (token ids, indices) are left out, and each storage goes to the region that saved it
first: "core" while a core-attention module runs (forward pre/post hooks), else "rest".
"""

from __future__ import annotations

import contextlib

import torch


class SavedBytes:
    """Context manager: `.bytes["core"]`, `.bytes["rest"]` after the block."""

    def __init__(self, model: torch.nn.Module, core_modules: list[torch.nn.Module]):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._cores = core_modules
        self._region = "rest"
        self._seen: dict[int, str] = {}
        self.bytes = {"core": 0, "rest": 0}
        self._stack = contextlib.ExitStack()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if t.is_floating_point() and ptr not in self._params and ptr not in self._seen:
            self._seen[ptr] = self._region
            self.bytes[self._region] += storage.nbytes()
        return t

    def _enter_core(self, *_):
        self._region = "core"

    def _leave_core(self, *_):
        self._region = "rest"

    def __enter__(self) -> SavedBytes:
        for module in self._cores:
            handle_pre = module.register_forward_pre_hook(self._enter_core)
            handle_post = module.register_forward_hook(self._leave_core)
            self._stack.callback(handle_pre.remove)
            self._stack.callback(handle_post.remove)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
