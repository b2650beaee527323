"""`moe_utils.te_general_gemm = None` where Transformer Engine is absent (megatron-core 0.16.x).

megatron-core 0.16.1 imports `te_general_gemm` in `transformer/moe/moe_utils.py` only inside its
`try: import transformer_engine` block, but `RouterGatingLinearFunction.forward`/`backward` (the router's
gating GEMM, used by every `TopKRouter`) read it unconditionally (`if te_general_gemm is not None and ...`),
so without TE every MoE forward raises `NameError: name 'te_general_gemm' is not defined`. With the name
bound to None the function takes its own torch branch (`torch.mm` in `router_dtype`), which is what the
code intends without TE. Where TE is installed the name exists and nothing is changed.
"""

from __future__ import annotations

import importlib

from .pinning import check_pinned

_NAME = "te_general_gemm"
_MODULE = "megatron.core.transformer.moe.moe_utils"
_installed = False


def moe_te_gemm_shim_applied() -> bool:
    """True while this shim has bound the name."""
    return _installed


def apply_moe_te_gemm_shim() -> bool:
    """Bind `moe_utils.te_general_gemm = None` if the module lacks it. Idempotent. True if the shim is (now)
    in place, False where the module defines the name itself (TE installed)."""
    global _installed
    if _installed:
        return True
    module = importlib.import_module(_MODULE)
    if hasattr(module, _NAME):
        return False
    check_pinned()
    setattr(module, _NAME, None)
    _installed = True
    return True


def remove_moe_te_gemm_shim() -> None:
    """Unbind the name again (for the test that shows the shim is needed)."""
    global _installed
    if _installed:
        delattr(importlib.import_module(_MODULE), _NAME)
        _installed = False
