"""The upstream warnings a megatron-tail run is expected to raise, silenced in one place (`megatron-tail`'s
`main`, before any sub-command imports megatron-core), so that a user's one-line error, or the first step
line, is not buried under a dozen lines nobody can act on. Each entry says why it is expected; a warning
not listed here still shows.

    silence_expected_warnings()        # first thing in a process that will import megatron-core
"""

from __future__ import annotations

import warnings

EXPECTED: tuple[tuple[type[Warning], str, str], ...] = (
    # megatron-core 0.16.1 says this at import in five modules (fsdp mixed_precision, optimizer, optimizer's
    # __init__, clip_grads, models/backends, gpt_layer_specs) when TE or apex is absent: on CPU always,
    # on GPU nodes without apex too; both are optional extras and the fallbacks are what we test
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed", "megatron"),
    # megatron-core's TransformerConfig.__post_init__ warns of its own default cuda_graph_scope "full"
    (UserWarning, r"full scope is deprecated", "megatron"),
    # megatron-core's optimizer reads `.grad` of every parameter it holds (optimizer.py,
    # `_get_param_groups`'s grad check); torch warns on the non-leaf views of the distributed buffers
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor", "megatron"),
    # torch 2.13 deprecates the collectives megatron-core's distributed optimizer and DDP call
    (
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        "",
    ),
)
"""(category, message regex, module regex: where the warning is raised, "" for anywhere); both regexes
must match at the start (`warnings.filterwarnings`)."""

CPU_ONLY: tuple[tuple[type[Warning], str, str], ...] = (
    # a CUDA stream setting: on GPU it is advice worth reading (set it in the launch script), on CPU moot
    (UserWarning, r".*set the environment variable CUDA_DEVICE_MAX_CONNECTIONS", "megatron"),
)
"""Expected only where no CUDA device is visible."""


def silence_expected_warnings(*, cuda: bool | None = None) -> None:
    """Ignore `EXPECTED` (and `CPU_ONLY` when `cuda` is False; None: ask torch whether CUDA is available)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    for category, message, module in (*EXPECTED, *(() if cuda else CPU_ONLY)):
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
