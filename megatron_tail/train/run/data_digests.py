"""What the run's prompt files held, so that a resume tells a file changed under the same path from the file
the checkpoint was trained on: the config names the files (`data.train_path`, `data.eval_path`), not what
is in them, and the prompt stream (`data.PromptStream`: shuffled by seed and epoch, read at the
checkpoint's `data_cursor`) is a function of the file's rows. A file edited, regenerated or replaced in
place would silently change what the rest of the run trains on.

Every checkpoint holds `data_digests.json`, the SHA-256 of each file's bytes when the run read it (rank 0,
as it reads the prompts: `session.RunSession`); a resume compares them with the files now (`changes`,
`loop.check_resume_config`):
- the training file's content changed: a change of what is trained, refused as a changed key is
  (`config_change.resume_notes`) unless `train.allow_config_change`;
- the evaluation file's: accepted and logged, as `data.eval_path` is;
- a path changed with the content the same (the data moved, e.g. to another cluster's file system): the
  path's change is accepted and logged instead of refused.

The model directory (`model.hf_path`) is read again at every start for the tokenizer and its chat
template (what each prompt's tokens are) and, with a KL term, the reference policy's weights. Its small
files that define the tokenization and the architecture are digested too (`model_files_digest`): a
directory re-downloaded or replaced under the same path with another tokenizer, template or config is a
change of what is trained. Its weights are not hashed (hundreds of GB at 1 GB/s on every start), so a
moved model directory is never taken as the same content: its path's change stays refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_tail.config import RunConfig
from megatron_tail.utils.errors import UserError
from megatron_tail.utils.file_digest import file_digest

DIGESTS_NAME = "data_digests.json"
KEYS = ("data.train_path", "data.eval_path", "model.hf_path")
WHOLE_CONTENT_KEYS = ("data.train_path", "data.eval_path")
"""The keys whose digest covers everything the run reads there: a moved path of the same digest holds the
same content."""
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
)
"""The files of a HF model directory that define its tokenization, chat template and architecture."""


def model_files_digest(model_dir: str | Path) -> str | None:
    """SHA-256 over the `MODEL_FILES` present in `model_dir` (each file's name and digest), or None if it is
    not a directory."""
    import hashlib

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return None
    digest = hashlib.sha256()
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            digest.update(f"{name}\0{file_digest(model_dir / name)}\n".encode())
    return digest.hexdigest()


def current(cfg: RunConfig) -> dict[str, str | None]:
    """`KEYS` → the digest of what each names now (None: nothing configured)."""
    paths = {"data.train_path": cfg.data.train_path, "data.eval_path": cfg.data.eval_path}
    now = {key: file_digest(path) if path else None for key, path in paths.items()}
    now["model.hf_path"] = model_files_digest(cfg.model.hf_path) if cfg.model.hf_path else None
    return now


def digests_text(cfg: RunConfig) -> str:
    """What a checkpoint stores (`DIGESTS_NAME`)."""
    return json.dumps(current(cfg), indent=2) + "\n"


def read_checkpoint_digests(checkpoint: Path) -> dict[str, Any] | None:
    """The digests `checkpoint` stored, or None (saved before checkpoints stored them). UserError naming the
    file if it is not a JSON object."""
    file = checkpoint / DIGESTS_NAME
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"checkpoint file {file} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise UserError(f"checkpoint file {file} is not a JSON object; got {type(data).__name__}")
    return data


def changes(saved: dict[str, Any] | None, cfg: RunConfig) -> tuple[dict[str, tuple[str, str]], set[str]]:
    """(`KEYS` whose file's content changed → (old, new) digest prefixes; `KEYS` whose file holds what the
    checkpoint's did), against `saved`, a checkpoint's digests (None: nothing to compare)."""
    if saved is None:
        return {}, set()
    now = current(cfg)
    changed, same = {}, set()
    for key in KEYS:
        old, new = saved.get(key), now[key]
        if old is None or new is None:  # a file added or removed: the config's own change says so
            continue
        if old != new:
            changed[key] = (old[:12], new[:12])
        elif key in WHOLE_CONTENT_KEYS:
            same.add(key)
    return changed, same
