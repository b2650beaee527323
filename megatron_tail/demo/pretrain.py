"""Reproducible supervised pretraining of the demo's tiny Qwen3 on the toy addition task (CPU, fp32).

    python -m megatron_tail.demo.pretrain --out runs/demo_cache/tiny_qwen3_arith

Same seed + same thread count → the same checkpoint. Prompts are raw `"12+34="` strings (no chat template);
the loss is on the answer and what follows it. In a fraction `ramble_prob` of the examples the answer is
followed by a stray digit before the EOS ("12+34=46" + "7"), so the pretrained model often rambles past its
answer. The exact-match reward scores "467" as wrong: RL has to teach the model to stop right after the
answer, which it learns fast and visibly (as RL teaches LLMs format and termination), while the arithmetic
itself improves slowly. Accuracy therefore starts well above zero and has room to rise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_tail.demo.model import new_tiny_qwen3, save_hf


@dataclass(frozen=True)
class FitSettings:
    """What `fit_causal_lm` needs; the pretraining recipes extend it with their data's settings."""

    seed: int = 0
    """Seeds the model init, the data stream and the batch order."""
    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 128
    lr: float = 3e-3
    """Peak learning rate (AdamW), cosine-decayed to 10% after a short warm-up."""
    warmup: int = 50
    weight_decay: float = 0.01
    threads: int = 2
    """torch threads (the result depends on it; keep it fixed for reproducibility)."""


@dataclass(frozen=True)
class PretrainSettings(FitSettings):
    """The demo's toy-addition pretraining."""

    max_digits: int = 2
    """Operands have 1..max_digits digits (as the demo's RL prompts)."""
    ramble_prob: float = 0.5
    """Fraction of examples whose answer is followed by one stray digit before the EOS."""
    num_examples: int = 50_000
    """Problems generated for pretraining (a seed disjoint from the RL files')."""
    tool_prob: float = 0.0
    """Fraction of examples that call the calculator instead of answering directly (`tool_transcripts`);
    > 0 builds the model with Qwen3's tool tags as tokens and 128 positions (the calculator demo)."""

    @property
    def model_overrides(self) -> dict:
        return {"tool_tokens": True, "max_position_embeddings": 128} if self.tool_prob > 0 else {}

    def new_model(self):
        """The freshly initialised model and its tokenizer (the MoE demo's settings override this)."""
        return new_tiny_qwen3(self.seed, **self.model_overrides)


def encode(tokenizer, prompt: str, target: str) -> tuple[list[int], int]:
    """Token ids of prompt + target + EOS, and the prompt length."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a = tokenizer(target, add_special_tokens=False)["input_ids"]
    return [*p, *a, tokenizer.eos_token_id], len(p)


def make_batches(tokenizer, settings: PretrainSettings):
    """Padded `ids [N, L]`, `loss mask [N, L-1]` (answer + EOS targets; a tool transcript's model turns),
    `attention mask [N, L]`."""
    from megatron_tail.data.toy_arithmetic import make_arithmetic_examples
    from megatron_tail.demo.tool_transcripts import calculator_transcript

    rows = make_arithmetic_examples(
        settings.num_examples, max_digits=settings.max_digits, seed=10_000 + settings.seed
    )
    gen = torch.Generator().manual_seed(20_000 + settings.seed)
    ramble = (torch.rand(len(rows), generator=gen) < settings.ramble_prob).tolist()
    stray = torch.randint(0, 10, (len(rows),), generator=gen).tolist()
    targets = [r["answer"] + (str(d) if x else "") for r, x, d in zip(rows, ramble, stray, strict=True)]
    tool = (torch.rand(len(rows), generator=gen) < settings.tool_prob).tolist()
    encoded = []
    for r, t, use_tool in zip(rows, targets, tool, strict=True):
        if use_tool:
            encoded.append(calculator_transcript(tokenizer, r["prompt"], r["answer"]))
        else:
            seq, p = encode(tokenizer, r["prompt"], t)
            encoded.append((seq, [k >= p for k in range(len(seq))]))
    length = max(len(seq) for seq, _ in encoded)
    ids = torch.full((len(encoded), length), tokenizer.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(encoded), length - 1), dtype=torch.bool)
    attention = torch.zeros((len(encoded), length), dtype=torch.long)
    for i, (seq, learned) in enumerate(encoded):
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        loss_mask[i, : len(seq) - 1] = torch.tensor(learned[1:])
    return ids, loss_mask, attention


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 6) -> float:
    """Exact-match accuracy of greedy completions (batched, left-padded), using the RL reward."""
    from megatron_tail.rewards import arithmetic_reward

    model.eval()
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train()
    return sum(arithmetic_reward(t, r["answer"]) for t, r in zip(texts, rows, strict=True)) / len(rows)


class PretrainStopped(Exception):
    """A stop signal ended pretraining after a step; its progress is saved and the next run continues."""

    def __init__(self, sig: signal.Signals, step: int, steps: int, progress: Path):
        self.sig, self.step, self.steps, self.progress = sig, step, steps, progress
        super().__init__(
            f"{sig.name}: pretraining stopped after step {step}/{steps}; its progress is saved in {progress} "
            "and the next run continues from there"
        )


def progress_file(out_dir: str | Path) -> Path:
    """Where an interrupted pretraining of `out_dir` keeps its progress (beside it, not in it: `out_dir` holds
    only a finished model)."""
    out = Path(out_dir)
    return out.parent / f".{out.name}.pretrain_progress.pt"


def pretrain(
    out_dir: str | Path, settings: PretrainSettings | None = None, *, eval_rows=None, log=print
) -> dict:
    """Train and save the HF checkpoint to `out_dir`; return (and save as `pretrain.json`) its summary.

    A stop signal (`train.run.signals.STOP_SIGNALS`) ends it after the current step with `PretrainStopped`,
    its progress saved (`progress_file`); the next call with the same settings continues from there and
    ends with the same model as an uninterrupted one."""
    settings = settings or PretrainSettings()
    torch.set_num_threads(settings.threads)
    progress = progress_file(out_dir)
    with StopRequests() as stop:  # from the start: a signal while the data is made ends after step 1
        model, tokenizer = settings.new_model()
        started = time.perf_counter()
        data = make_batches(tokenizer, settings)
        fit_causal_lm(model, data, settings, log=log, progress=progress, stop=stop)
    summary = {"settings": asdict(settings), "train_time_s": time.perf_counter() - started}
    if eval_rows:
        summary["greedy_accuracy"] = greedy_accuracy(model, tokenizer, eval_rows)
    save_hf(model, tokenizer, out_dir)
    (Path(out_dir) / "pretrain.json").write_text(json.dumps(summary, indent=2))
    progress.unlink(missing_ok=True)
    return summary


def fit_causal_lm(
    model,
    data,
    settings: FitSettings,
    *,
    log=print,
    log_every: int = 200,
    progress: Path | None = None,
    stop: StopRequests | None = None,
) -> float:
    """AdamW on the masked next-token NLL, in place; returns the last batch's loss.

    `data`: (`ids [N, L]`, `loss mask [N, L−1]` of the targets to learn, `attention mask [N, L]`).
    `settings`: `steps`, `batch_size`, `lr` (peak; linear warm-up over `warmup` steps, then cosine to
    10%), `weight_decay`, `seed` (batch order). Gradients are clipped to norm 1. A mixture of experts
    (`config.num_experts`) adds HF's load-balancing loss × `config.router_aux_loss_coef`, as Qwen3-MoE
    was pretrained: balanced routers, whose top-k is a real decision between experts.
    `progress`: a file to continue from (if it holds these settings' progress) and, on a stop signal, to
    save to before raising `PretrainStopped` (the model, AdamW's state and the batch order's generator);
    `stop`: the caller's `StopRequests` (default: installed here when `progress` is given).
    """
    ids, loss_mask, attention = data
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    first = 0 if progress is None else _resume(progress, settings, model, optimizer, gen, log)
    model.train()
    loss = torch.zeros(())
    moe = bool(getattr(model.config, "num_experts", 0))
    with contextlib.nullcontext(stop) if stop is not None else StopRequests(progress is not None) as stop:
        for step in range(first, settings.steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr(step, settings)
            rows = torch.randint(0, ids.shape[0], (settings.batch_size,), generator=gen)
            x, m, a = ids[rows], loss_mask[rows], attention[rows]
            out = model(input_ids=x, attention_mask=a, **({"output_router_logits": True} if moe else {}))
            logits = out.logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
            loss = (nll * m).sum() / m.sum()
            if moe:
                loss = loss + model.config.router_aux_loss_coef * out.aux_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if log is not None and (step + 1) % log_every == 0:
                log(f"  pretrain step {step + 1}/{settings.steps}  loss {loss.item():.3f}")
            if stop.received is not None and progress is not None and step + 1 < settings.steps:
                _save_progress(progress, settings, step + 1, model, optimizer, gen)
                raise PretrainStopped(stop.received, step + 1, settings.steps, progress)
    return float(loss.detach())


def _resume(progress: Path, settings, model, optimizer, gen, log) -> int:
    """The step to start from: the saved one if `progress` holds these settings' progress, else 0."""
    if not progress.is_file():
        return 0
    state = torch.load(progress, weights_only=False)
    if state.get("settings") != asdict(settings):
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
    if log is not None:
        log(f"  pretraining continues from step {state['step']}/{settings.steps} ({progress})")
    return int(state["step"])


def _save_progress(progress: Path, settings, step: int, model, optimizer, gen) -> None:
    state = {
        "settings": asdict(settings),
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "generator": gen.get_state(),
    }
    progress.parent.mkdir(parents=True, exist_ok=True)
    tmp = progress.with_name(progress.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, progress)  # a kill during the save leaves the previous progress whole


class StopRequests:
    """Flag-setting handlers for the stop signals around a loop (main thread only; elsewhere, and when not
    `enabled`, a no-op): the loop ends after its step instead of dying mid-step without a word. Nested, the
    outermost one stands (`with` gives it), so a caller can hold the signals from before it announces the
    work: a signal between the announcement and the loop's own handlers would otherwise kill the process."""

    _outermost: StopRequests | None = None

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: signal.Signals | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopRequests:
        if StopRequests._outermost is not None:
            return StopRequests._outermost
        if self.enabled:
            from megatron_tail.train.run.signals import STOP_SIGNALS

            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            StopRequests._outermost = self
        return self

    def __exit__(self, *exc) -> None:
        if StopRequests._outermost is self:
            StopRequests._outermost = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)


def _lr(step: int, s) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output HF checkpoint directory")
    parser.add_argument("--steps", type=int, default=PretrainSettings.steps)
    parser.add_argument("--seed", type=int, default=PretrainSettings.seed)
    parser.add_argument("--eval-file", default=None, help="jsonl of {prompt, answer} for greedy accuracy")
    args = parser.parse_args(argv)
    rows = None
    if args.eval_file:
        rows = [json.loads(line) for line in Path(args.eval_file).read_text().splitlines() if line.strip()]
    summary = pretrain(args.out, PretrainSettings(steps=args.steps, seed=args.seed), eval_rows=rows)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
