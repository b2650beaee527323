"""The DVP custom logit processor for SGLang (and the local engine), and its wire format.

SGLang (0.5.x, `--enable-custom-logit-processor`) runs a request's custom logit processor on the raw
next-token logits *before* temperature scaling, top-k/p and the log-softmax whose values it returns as
`meta_info.output_token_logprobs`. A processor that sets every logit below `max z + T·log ρ` to -inf
therefore makes SGLang sample from, and return log-probs of, exactly the pruned policy π^mp that the
trainer scores with `vocab_parallel_masked_logprobs`. Both sides call `megatron_tail.ops.safe_vocab`,
so one definition of the safe set serves both.

Wire format (identical to `sglang.srt.sampling.custom_logit_processor.CustomLogitProcessor.to_str`):
the request field `custom_logit_processor` holds `json.dumps({"callable": dill.dumps(cls).hex()})`,
and each sample's `sampling_params.custom_params` holds `{"log_rho": float | None, "temperature": T}`.
dill pickles an importable class by reference, so the SGLang server's Python environment must be able
to `import megatron_tail` (install the package there with `pip install --no-deps -e .`).
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import pickle
from functools import lru_cache
from pathlib import Path
from typing import Any

import dill
import torch

from megatron_tail.ops.log_rho import check_log_rho, check_temperature
from megatron_tail.ops.safe_vocab import apply_safe_vocab_

LOG_RHO_KEY = "log_rho"
TEMPERATURE_KEY = "temperature"
REQ_KEY = "__req__"
"""SGLang adds a weak proxy of the scheduler's `Req` under this key; its `sampling_params.temperature`
is the temperature SGLang itself divides by (1.0 for greedy requests)."""

_TEMPERATURE_TOLERANCE = 1e-6


class DVPLogitProcessor:
    """SGLang `CustomLogitProcessor`: keep only the DVP safe set, V_S = {a : z_a ≥ max z + T·log ρ}.

    Call signature is SGLang's: `processor(logits, custom_param_list) -> logits`.
        logits: `[B, V]` raw next-token logits of the rows that use this processor (any float dtype);
            modified in place and returned (SGLang writes the result back row for row).
        custom_param_list: one dict per row: `{"log_rho": float ≤ 0 | None, "temperature": T}`,
            plus SGLang's `"__req__"`. `log_rho` None (or -inf) disables pruning for that row.
    The temperature is taken from `__req__.sampling_params.temperature` when SGLang provides it (the value
    it really scales by), else from the `temperature` entry; if both are given they must agree.
    """

    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any] | None] | None = None):
        if logits.dim() != 2:
            raise ValueError(f"DVPLogitProcessor expects logits [B, V]; got shape {tuple(logits.shape)}")
        if custom_param_list is None or len(custom_param_list) != logits.shape[0]:
            got = None if custom_param_list is None else len(custom_param_list)
            raise ValueError(
                f"DVPLogitProcessor needs one custom_params dict per row: {logits.shape[0]} rows, got {got}"
            )
        rows_by_setting: dict[tuple[float | None, float], list[int]] = {}
        for row, params in enumerate(custom_param_list):
            rows_by_setting.setdefault(row_setting(params), []).append(row)
        if len(rows_by_setting) == 1:
            ((log_rho, temperature),) = rows_by_setting
            return apply_safe_vocab_(logits, log_rho, temperature)
        for (log_rho, temperature), rows in rows_by_setting.items():
            index = torch.tensor(rows, device=logits.device)
            logits[index] = apply_safe_vocab_(logits[index], log_rho, temperature)
        return logits

    @classmethod
    def to_str(cls) -> str:
        """Serialize like SGLang's `CustomLogitProcessor.to_str` (JSON with the dill-pickled class in hex)."""
        return json.dumps({"callable": dill.dumps(cls).hex()})


def row_setting(params: dict[str, Any] | None) -> tuple[float | None, float]:
    """`(log_rho or None, temperature)` for one row's custom_params; ValueError naming what is wrong."""
    if not isinstance(params, dict) or LOG_RHO_KEY not in params:
        raise ValueError(
            "DVPLogitProcessor needs sampling_params.custom_params = {'log_rho': <float ≤ 0 or null>, "
            f"'temperature': <T>}} on every request that uses it; got {_printable(params)!r}"
        )
    log_rho = check_log_rho(params[LOG_RHO_KEY])
    req = params.get(REQ_KEY)
    engine_t = None if req is None else float(req.sampling_params.temperature)
    given_t = params.get(TEMPERATURE_KEY)
    if given_t is not None:
        given_t = check_temperature(given_t)
    if engine_t is not None and given_t is not None and abs(engine_t - given_t) > _TEMPERATURE_TOLERANCE:
        raise ValueError(
            f"custom_params temperature {given_t} differs from the engine's sampling temperature {engine_t}; "
            "the safe-set threshold must use the temperature the engine samples at"
        )
    temperature = engine_t if engine_t is not None else given_t
    if temperature is None:
        raise ValueError(
            "DVPLogitProcessor: custom_params has no 'temperature' and the engine gave no request"
        )
    return log_rho, check_temperature(temperature)


def dvp_custom_params(log_rho: float | None, temperature: float) -> dict[str, float | None]:
    """Per-sample `custom_params` of the DVP processor; greedy (T = 0) is scored at T = 1, like SGLang."""
    log_rho = check_log_rho(log_rho)
    t = float(temperature)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be finite and ≥ 0; got {temperature!r}")
    return {LOG_RHO_KEY: log_rho, TEMPERATURE_KEY: 1.0 if t < 1e-6 else t}


@lru_cache(maxsize=64)
def _load_class(serialized: str):
    try:
        payload = json.loads(serialized)
        return dill.loads(bytes.fromhex(payload["callable"]))
    except (ValueError, KeyError, TypeError, EOFError, RecursionError, pickle.UnpicklingError) as e:
        raise ValueError(
            "custom_logit_processor must be the string CustomLogitProcessor.to_str() returns "
            f"(JSON with a dill-pickled class under 'callable'); could not load it: {e}"
        ) from e


class _DVPOnlyUnpickler(pickle.Unpickler):
    """Resolves the one global the DVP processor's pickle names and refuses any other, so that nothing else
    a request sends is imported or run (Python's documented way of restricting globals, `pickle`'s
    "Restricting Globals"). dill pickles an importable class by reference: its module and name, then
    STACK_GLOBAL, which calls `find_class`."""

    def find_class(self, module: str, name: str):
        if (module, name) == (DVPLogitProcessor.__module__, DVPLogitProcessor.__qualname__):
            return DVPLogitProcessor
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def load_dvp_processor(serialized: str) -> DVPLogitProcessor:
    """The DVP processor from its `to_str()` string (whatever pickle protocol the sender's dill used),
    unpickled without resolving any other class or function (`_DVPOnlyUnpickler`); ValueError for any
    other payload, naming what it is."""
    if not isinstance(serialized, str):
        raise ValueError(f"custom_logit_processor must be a string; got {type(serialized).__name__}")
    return _dvp_processor(serialized)


@lru_cache(maxsize=64)
def _dvp_processor(serialized: str) -> DVPLogitProcessor:
    """`load_dvp_processor`'s unpickling, once per payload (the batcher loads its rows' processor at every
    decoding step; a DVPLogitProcessor holds no state, so one instance serves them all)."""
    try:
        loaded = _DVPOnlyUnpickler(io.BytesIO(bytes.fromhex(json.loads(serialized)["callable"]))).load()
    except (ValueError, KeyError, TypeError, EOFError, RecursionError, pickle.UnpicklingError) as e:
        raise ValueError(
            "custom_logit_processor: this engine runs megatron_tail's DVPLogitProcessor only "
            f"(DVPLogitProcessor.to_str()); not this payload ({e}). Start it with "
            "--enable-custom-logit-processor to run any (as SGLang's flag: the engine then runs code that "
            "requests send)"
        ) from e
    if loaded is not DVPLogitProcessor:
        raise ValueError(f"custom_logit_processor: the payload is {loaded!r}, not DVPLogitProcessor")
    return DVPLogitProcessor()


def load_custom_logit_processor(serialized: str):
    """Instantiate a processor from its `to_str()` string with SGLang's own `CustomLogitProcessor.from_str`:
    any class the payload names is imported and run, so only where the engine opted in
    (`--enable-custom-logit-processor`; `load_dvp_processor` otherwise).

    SGLang's module is loaded from its file on its own: importing the `sglang` package would run its
    `__init__`, which patches transformers and takes seconds. Without sglang installed, an identical
    loader (JSON → hex → `dill.loads` → instantiate) is used.
    """
    if not isinstance(serialized, str):
        raise ValueError(f"custom_logit_processor must be a string; got {type(serialized).__name__}")
    sglang_module = _sglang_custom_logit_processor_module()
    if sglang_module is None:
        return _load_class(serialized)()
    try:
        return sglang_module.CustomLogitProcessor.from_str(serialized)
    except Exception as e:
        raise ValueError(
            "custom_logit_processor must be the string CustomLogitProcessor.to_str() returns "
            f"(JSON with a dill-pickled class under 'callable'); SGLang's from_str failed: {e!r}"
        ) from e


@lru_cache(maxsize=1)
def _sglang_custom_logit_processor_module():
    """SGLang's `srt/sampling/custom_logit_processor.py`, loaded without the `sglang` package, or None."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = (
        Path(next(iter(spec.submodule_search_locations))) / "srt" / "sampling" / "custom_logit_processor.py"
    )
    if not path.is_file():
        return None
    module_spec = importlib.util.spec_from_file_location("_megatron_tail_sglang_custom_logit_processor", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _printable(params: Any) -> Any:
    if isinstance(params, dict):
        return {k: v for k, v in params.items() if k != REQ_KEY}
    return params
