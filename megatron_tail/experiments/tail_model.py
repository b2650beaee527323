"""The tail experiment's model and prompts: a tiny Qwen3 over the 8192-id Zipf language, pretrained on it
(CPU, fp32, reproducible), and the RL prompt files.

    model_dir = ensure_tail_model(cache_dir)      # cache_dir/tiny_qwen3_zipf (trained once)
    model_dir = ensure_tail_model(cache_dir, size="small")  # cache_dir/qwen3_zipf_h256_l4
    train, test = ensure_tail_prompts(cache_dir)  # cache_dir/data/zipf_{train,test}.jsonl
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_tail.data.toy_arithmetic import write_jsonl
from megatron_tail.demo.model import save_hf, tiny_qwen3_config
from megatron_tail.demo.pretrain import FitSettings, fit_causal_lm

from .zipf_language import ZipfLanguage

MODEL_DIR_NAME = "tiny_qwen3_zipf"
PROMPT_WORDS = 6
PROMPT_FILES = {"train": (4000, 101), "test": (256, 202)}
"""name → (prompts, seed)."""


@dataclass(frozen=True)
class TailPretrainSettings(FitSettings):
    """`FitSettings` (batch 64 here) and the tail model's data and size."""

    batch_size: int = 64
    seq_len: int = 24
    num_sequences: int = 40_000
    hidden_size: int = 64
    num_hidden_layers: int = 2


def tail_model_config(language: ZipfLanguage, s: TailPretrainSettings):
    """Qwen3 architecture; heads, FFN and vocabulary divisible by TP = 2."""
    return tiny_qwen3_config(
        vocab_size=language.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=3 * s.hidden_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=s.hidden_size // 4,
        max_position_embeddings=64,
    )


def pretrain_tail_model(out_dir: str | Path, settings: TailPretrainSettings | None = None, log=print) -> dict:
    """Fit the tiny Qwen3 to the Zipf language (every next word is a target); save HF dir + summary.

    The summary has the held-out next-word cross-entropy and the language's own entropy rate (the best
    achievable), so one sees how much of each distribution, tail included, the model learned.
    """
    from transformers import Qwen3ForCausalLM

    s = settings or TailPretrainSettings()
    language = ZipfLanguage()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    model = Qwen3ForCausalLM(tail_model_config(language, s))
    ids = language.sample(s.num_sequences, s.seq_len, seed=1000 + s.seed) + 2
    data = (ids, torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool), torch.ones_like(ids))
    started = time.perf_counter()
    fit_causal_lm(model, data, s, log=log, log_every=200)
    summary = {
        "settings": asdict(s),
        "train_time_s": time.perf_counter() - started,
        **heldout_cross_entropy(model, language, seed=2000 + s.seed),
    }
    tokenizer = language.tokenizer()
    save_hf(model, tokenizer, out_dir)
    (Path(out_dir) / "pretrain.json").write_text(json.dumps(summary, indent=2))
    return summary


@torch.no_grad()
def heldout_cross_entropy(model, language: ZipfLanguage, *, seed: int, sequences: int = 256) -> dict:
    """Model NLL on fresh sequences vs the language's entropy (its best achievable NLL), nats per word."""
    model.eval()
    words = language.sample(sequences, 24, seed=seed)
    logits = model(input_ids=words + 2).logits[:, :-1, 2:].float()  # over words only
    nll = -torch.log_softmax(logits, dim=-1).gather(-1, words[:, 1:].unsqueeze(-1)).mean()
    model.train()
    return {"heldout_nll": float(nll), "language_entropy": language.entropy()}


MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"hidden_size": 256, "num_hidden_layers": 4},
    "ci": {"hidden_size": 32, "num_hidden_layers": 1, "steps": 20, "num_sequences": 1280, "threads": 1},
}
"""Tail models: "tiny" (hidden 64, 2 layers: the experiment's default) and "small" (hidden 256, 4 layers;
16x the non-embedding parameters, pretrained the same way), for mismatches that grow with width and depth;
"ci" (hidden 32, 1 layer, 20 pretraining steps: seconds) for the tests' fast slices only, it learns little."""


def tail_model_dir(cache: Path, size: str = "tiny") -> Path:
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; the sizes are {list(MODEL_SIZES)}")
    if size == "tiny":
        return Path(cache) / MODEL_DIR_NAME
    s = TailPretrainSettings(**MODEL_SIZES[size])
    return Path(cache) / f"qwen3_zipf_h{s.hidden_size}_l{s.num_hidden_layers}"


def ensure_tail_model(cache: Path, log=print, size: str = "tiny") -> Path:
    """The pretrained model of `size` (`MODEL_SIZES`) in `cache` (trained now if absent or made with other
    settings)."""
    model_dir = tail_model_dir(cache, size)
    summary_file = model_dir / "pretrain.json"
    settings = TailPretrainSettings(**MODEL_SIZES[size])
    if summary_file.is_file() and json.loads(summary_file.read_text()).get("settings") == asdict(settings):
        return model_dir
    log(f"pretraining the tail model ({settings.steps} steps, one-off) → {model_dir}")
    summary = pretrain_tail_model(model_dir, settings, log=log)
    log(
        f"  held-out NLL {summary['heldout_nll']:.3f} nats/word (the language's entropy: "
        f"{summary['language_entropy']:.3f}; uniform: {math.log(ZipfLanguage().num_words):.3f})"
    )
    return model_dir


def ensure_tail_prompts(cache: Path) -> tuple[Path, Path]:
    """Prompt files (`{"prompt": "w12 w7 …", "answer": "<num_words>"}` per line): train and test."""
    language = ZipfLanguage()
    paths = []
    for name, (n, seed) in PROMPT_FILES.items():
        path = Path(cache) / "data" / f"zipf_{name}.jsonl"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = [
                {"prompt": language.text(words), "answer": str(language.num_words)}
                for words in language.sample(n, PROMPT_WORDS, seed=seed)
            ]
            write_jsonl(rows, path)
        paths.append(path)
    return paths[0], paths[1]
