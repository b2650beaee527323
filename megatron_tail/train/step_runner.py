"""`StepRunner`: the pieces of one RL run (trainer, rollout side, data) and one method per phase of a step.

Collective methods (every rank calls them): `resume`, `sync_weights`, `evaluate`, `step`, `checkpoint`.
Rank 0 alone owns the engines, the tokenizer and the prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from megatron_tail.config import RunConfig

from . import run_dir as R
from .checkpoint import load_checkpoint, save_checkpoint
from .loop import Console, progress_enabled
from .parallel import ParallelConfig, init_parallel
from .rl_step import train_on_batch
from .rollout_side import RolloutBatch, RolloutSide
from .setup import build_trainer

T = TypeVar("T")


def on_rank0(fn: Callable[[], T]) -> T:
    """Run `fn()` on global rank 0 only and hand its result to every rank. Collective (one broadcast).

    If `fn` raises on rank 0, every rank raises (rank 0 its own exception, the others a RuntimeError that
    quotes it) instead of the other ranks waiting in the next collective until the process-group timeout.
    """
    result, error, raised = None, None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:
            raised, error = e, f"{type(e).__name__}: {e}"
    box = [(result, error)]
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if raised is not None:
        raise raised
    if error is not None:
        raise RuntimeError(f"global rank 0 failed: {error}")
    return result


def rollout_seed(seed: int, step: int) -> int:
    """`SamplingConfig.base_seed` of a step: a function of (seed, step) only (resumed runs resample alike)."""
    return seed * 1_000_003 + step


class StepRunner:
    def __init__(self, cfg: RunConfig):
        from megatron_tail.model import ModelSettings, load_hf_config

        self.cfg = cfg
        self.rank = dist.get_rank()
        self.run_dir = Path(cfg.run_dir)
        self.console = Console(enabled=self.rank == 0, bars=progress_enabled(cfg.logging.progress))
        self.rollout: RolloutSide | None = None
        self.batches = None
        self.eval_examples: list = []

        def start_rollout_side() -> None:
            tokenizer = _load_tokenizer(cfg.model.hf_path)
            self._load_data(tokenizer)
            self.rollout = RolloutSide(cfg, self.run_dir, tokenizer)  # the local engine starts loading now

        on_rank0(start_rollout_side)
        try:
            self.groups = init_parallel(
                ParallelConfig(
                    tensor_parallel=cfg.parallel.tensor_parallel,
                    pipeline_parallel=cfg.parallel.pipeline_parallel,
                    seed=cfg.seed,
                )
            )
            m = cfg.model
            self.trainer = build_trainer(
                load_hf_config(m.hf_path),
                hf_dir=m.hf_path,
                model_settings=ModelSettings(
                    bf16=m.bf16,
                    use_te=m.use_te,
                    vocab_pad_multiple=m.vocab_pad_multiple,
                    max_sequence_length=m.max_sequence_length,
                ),
                optim=cfg.optimizer.to_settings(),
            )
        except BaseException:
            self.close()  # never leave a local engine process behind
            raise

    def _load_data(self, tokenizer) -> None:
        from megatron_tail.data import PromptBatches, PromptDataConfig, load_prompts

        d = self.cfg.data

        def read(path: str):
            return load_prompts(
                PromptDataConfig(
                    path=path,
                    prompt_key=d.prompt_key,
                    answer_key=d.answer_key,
                    apply_chat_template=d.apply_chat_template,
                    prompt_template=d.prompt_template,
                    system_prompt=d.system_prompt,
                    max_prompt_tokens=d.max_prompt_tokens,
                ),
                tokenizer,
            )

        self.batches = PromptBatches(
            read(d.train_path), d.prompts_per_step, seed=self.cfg.seed, shuffle=d.shuffle
        )
        if d.eval_path is not None and self.cfg.train.eval_every:
            self.eval_examples = read(d.eval_path)[: d.eval_prompts]

    # --- collective phases -------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the newest complete checkpoint if `train.resume`; return the completed steps (0 if none)."""
        box = [None]
        if self.rank == 0 and self.cfg.train.resume:
            latest = R.latest_checkpoint(self.run_dir)
            box = [None if latest is None else str(latest[1])]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return 0
        rl_state = load_checkpoint(box[0], self.trainer)
        self.console.note(f"resumed from {box[0]} (step {rl_state['step']})")
        return int(rl_state["step"])

    def wait_ready(self) -> None:
        on_rank0(lambda: self.rollout.wait_ready())

    def sync_weights(self, version: int) -> float:
        """Export the trainer's weights as a HF checkpoint and load it on every engine. Returns seconds."""
        from megatron_tail.model import export_hf

        started = time.perf_counter()
        out = Path(self.cfg.rollout.weight_sync_dir or self.run_dir / "rollout_weights")
        export_hf(self.trainer.chunks, out, self.trainer.arch, copy_files_from=self.cfg.model.hf_path)
        on_rank0(lambda: self.rollout.sync_weights(out, version))
        return time.perf_counter() - started

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the eval prompts (rank 0 asks the engines; every rank gets the result)."""

        def evaluate() -> dict[str, float]:
            ex = self.eval_examples
            return self.rollout.evaluate([e.prompt_ids for e in ex], [e.answer for e in ex]) if ex else {}

        return on_rank0(evaluate)

    def step(self, step: int) -> dict[str, float]:
        """One RL step (0-based index `step`): rollout → train → weight sync (→ eval). Returns the metrics."""
        started = time.perf_counter()
        batch = on_rank0(lambda: self._rollout(step))
        outcome = train_on_batch(self.trainer, self.cfg, batch)
        sync_s = self.sync_weights(version=step + 1)
        metrics = rollout_metrics(batch, expected_version=str(step))
        metrics.update(outcome.metrics)
        every = self.cfg.train.eval_every
        if every and (step + 1) % every == 0:
            metrics.update(self.evaluate())
        rollout_s = batch.stats["rollout_time_s"]
        metrics.update(
            {
                "perf/rollout_time_s": rollout_s,
                "perf/train_time_s": outcome.train_time_s,
                "perf/weight_sync_time_s": sync_s,
                "perf/rollout_tokens_per_s": batch.stats["generated_tokens"] / max(rollout_s, 1e-9),
                "perf/train_tokens_per_s": outcome.tokens / max(outcome.train_time_s, 1e-9),
                "perf/step_time_s": time.perf_counter() - started,
            }
        )
        return metrics

    def checkpoint(self, done: int) -> float:
        """Save after `done` completed steps; keep the newest `train.keep_checkpoints`. Returns seconds."""
        started = time.perf_counter()
        path = R.checkpoint_path(self.run_dir, done)
        save_checkpoint(path, self.trainer, {"step": done, "seed": self.cfg.seed}, overwrite=True)
        if self.rank == 0:
            R.prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints)
        dist.barrier()
        return time.perf_counter() - started

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.close()

    # --- rank 0 ---------------------------------------------------------------------------------------

    def _rollout(self, step: int) -> RolloutBatch:
        chosen = self.batches.batch(step)
        bar = self.console.rollout_bar(len(chosen) * self.cfg.algorithm.group_size)
        self.rollout.on_result = None if bar is None else (lambda _result: bar.update(1))
        try:
            return self.rollout.generate(
                [e.prompt_ids for e in chosen],
                [e.answer for e in chosen],
                base_seed=rollout_seed(self.cfg.seed, step),
            )
        finally:
            self.rollout.on_result = None
            if bar is not None:
                bar.close()


def rollout_metrics(batch: RolloutBatch, *, expected_version: str) -> dict[str, float]:
    """Reward, accuracy and response-length statistics of a step's samples."""
    n = len(batch)
    lengths = [len(r) for r in batch.response_ids]
    mean_reward = sum(batch.rewards) / n
    return {
        "reward/mean": mean_reward,
        "reward/std": (sum((r - mean_reward) ** 2 for r in batch.rewards) / n) ** 0.5,
        "reward/accuracy": sum(batch.correct) / n,
        "response/length_mean": sum(lengths) / n,
        "response/length_max": float(max(lengths)),
        "response/truncated_fraction": sum(batch.truncated) / n,
        "rollout/stale_fraction": sum(v != expected_version for v in batch.weight_versions) / n,
    }


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
