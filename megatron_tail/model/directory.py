"""Check a HF model directory before anything loads from it: one `UserError` naming the path and the problem.

    arch = check_model_dir("ckpts/Qwen3-8B")     # config.json, tokenizer files, whole safetensors, tensor set

Without it, a missing directory surfaced as a Hugging Face "Repo id must be ..." message, a directory
without a tokenizer as a sentencepiece/tiktoken error, a truncated safetensors file as an error without a
path, and a `config.json` that declares fewer layers than the weights hold trained silently on the first
layers only. Reads only the safetensors headers (a few KB per file).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from megatron_tail.utils.errors import UserError
from megatron_tail.utils.paths import tilde_hint

from .hf_config import HFArch, json_type, load_hf_config
from .naming import hf_tensor_shapes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""At least one of these holds the vocabulary (fast tokenizer, sentencepiece, BPE)."""
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
"""Buffers some exporters save; the model recomputes them."""


INDEX_FILE = "model.safetensors.index.json"
"""HF's index of a sharded checkpoint (tensor name → file); `safetensors_io` writes and reads it."""


def load_model_config(path: str | Path, key: str = "model.hf_path") -> HFArch:
    """`load_hf_config(path)` of a HF checkpoint directory, reading only its config.json; UserError naming
    `key`, the path and the culprit (no such directory, a file, no config.json, not JSON, JSON but not an
    object, a missing field, an unsupported architecture)."""
    where = Path(path)
    if not where.exists():
        raise UserError(f"{key}: model directory {str(where)!r} not found{tilde_hint(where)}")
    if not where.is_dir():
        raise UserError(f"{key}: {str(where)!r} is not a directory (expected a HF checkpoint directory)")
    config = where / "config.json"
    if not config.is_file():
        raise UserError(f"{key}: {where} has no config.json (expected a HF checkpoint directory)")
    try:
        settings = json.loads(config.read_bytes())
    except UnicodeDecodeError as e:
        raise UserError(f"{key}: {config} is not JSON text ({e})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{key}: {config} is not valid JSON: {e}") from None
    if not isinstance(settings, dict):
        raise UserError(
            f"{key}: {config} holds a JSON {json_type(settings)}; expected a JSON object (the model's "
            "config: architectures, hidden_size, ...)"
        )
    try:
        return load_hf_config(settings)
    except KeyError as e:  # a field the architecture needs (`num_attention_heads`, `hidden_size`, ...)
        raise UserError(f"{key}: {config} has no {e.args[0]!r}, a field its architecture needs") from None
    except (ValueError, TypeError) as e:
        raise UserError(f"{key}: {config}: {e}") from None
    except ZeroDivisionError:  # a size of 0 the others are divided by (num_attention_heads: 0, no head_dim)
        raise UserError(
            f"{key}: {config}: a size field is 0 (num_attention_heads, head counts, ...)"
        ) from None


def check_model_dir(
    path: str | Path, key: str = "model.hf_path", *, tokenizer: bool = True, weights: bool = True
) -> HFArch:
    """`load_model_config(path)` once `path` is a readable HF checkpoint of that architecture: config.json,
    (with `tokenizer`) tokenizer files, (with `weights`) every safetensors file whole, and exactly the
    expected tensors with the expected shapes. UserError naming `key`, the path and the culprit otherwise."""
    where = Path(path)
    arch = load_model_config(where, key)
    if tokenizer and not any((where / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"{key}: {where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the tokenizer "
            "files from the base model into it"
        )
    if not weights:  # the architecture and tokenizer alone (a base model whose weights come from elsewhere)
        return arch
    stored = _stored_shapes(where, key)
    expected = hf_tensor_shapes(arch)
    missing = [n for n in expected if n not in stored]
    unexpected = [
        n
        for n in stored
        if n not in expected
        and not n.endswith(IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and arch.tie_word_embeddings)
    ]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({_few(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({_few(unexpected)})")
        raise UserError(
            f"{key}: the safetensors in {where} do not match its config.json ({arch.architecture}, "
            f"{arch.num_layers} layers): tensors {'; '.join(parts)}"
        )
    wrong = [(n, stored[n], s) for n, s in expected.items() if tuple(stored[n]) != s]
    if wrong:
        name, got, want = wrong[0]
        raise UserError(
            f"{key}: tensor {name} in {where} has shape {tuple(got)}, config.json implies {want}"
            + (f" ({len(wrong) - 1} more differ)" if len(wrong) > 1 else "")
        )
    return arch


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (", …" if len(names) > n else "")


def _stored_shapes(where: Path, key: str) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from every safetensors file's header, checking each file holds all its data."""
    index = where / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{key}: {index} is not a safetensors index ({e})") from None
    else:
        files = sorted(p.name for p in where.glob("*.safetensors"))
    if not files:
        raise UserError(f"{key}: {where} has no *.safetensors weights")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        shapes.update(read_safetensors_header(where / name, key))
    return shapes


def read_safetensors_header(file: Path, key: str = "model.hf_path") -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of one safetensors file; UserError naming the file if it is missing, not
    safetensors, or shorter than its header says (truncated)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, 100 * 2**20):
                raise ValueError(f"header length {length} does not fit the file ({size} bytes)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise UserError(f"{key}: {file} not found (named in {INDEX_FILE})") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{key}: {file} is not a readable safetensors file: {e}") from None
    end, shapes = 0, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shapes[name] = tuple(info["shape"])
        end = max(end, info["data_offsets"][1])
    if size < 8 + length + end:
        raise UserError(
            f"{key}: {file} is truncated: its header describes {8 + length + end} bytes, the file has {size}"
        )
    return shapes
