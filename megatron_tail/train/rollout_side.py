"""The trainer's rank 0 side of rollout: engines (a local CPU engine it starts, or remote SGLang servers),
sampling a step's prompts, rewards, greedy eval, and pushing new weights to the engines.

Only global rank 0 makes a `RolloutSide`; the other ranks receive the `RolloutBatch` by broadcast
(`step_runner.on_rank0`). All HTTP work runs on one private asyncio event loop, so the RL loop stays
synchronous.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_tail.config import RunConfig
from megatron_tail.rewards import compute_rewards, load_reward_fn
from megatron_tail.rollout import (
    ClientConfig,
    DiskWeightSync,
    LocalEngineConfig,
    RolloutClient,
    SamplingConfig,
    build_local_engine_command,
    wait_until_healthy,
)
from megatron_tail.rollout.processor import DVPLogitProcessor

EVAL_SEED = 987_654_321
"""`base_seed` of every sampled evaluation: the same seeds each time, so evaluations differ by the weights."""


@dataclass
class RolloutBatch:
    """One step's samples, groups of `group_size` contiguous (prompt-major), identical on every rank.

    Per sample: `prompt_ids`, `response_ids`, `rollout_logprobs` (the engine's log π_infer^mp of each
    response token), `reward`, `truncated` (hit `max_new_tokens`), `weight_version` the engine reported.
    `stats`: rollout time and token counts.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    rewards: list[float]
    correct: list[bool]
    truncated: list[bool]
    weight_versions: list[str | None]
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.response_ids)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEngineProcess:
    """`megatron-tail serve-local` as a child process in its own session (so a Ctrl-C or a signal sent to the
    trainer's process group does not kill it mid-step); stopped by `stop()`."""

    def __init__(self, cfg: RunConfig, port: int, log_path: Path):
        engine = LocalEngineConfig(
            model_path=cfg.model.hf_path,
            port=port,
            dtype=cfg.rollout.local_dtype,
            num_threads=cfg.rollout.local_num_threads,
        )
        self.url = engine.url
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "a")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)  # the engine is not a member of the trainer's process group
        if cfg.rollout.local_num_threads is not None:
            env["OMP_NUM_THREADS"] = str(cfg.rollout.local_num_threads)
        self.proc = subprocess.Popen(
            build_local_engine_command(engine, python=sys.executable),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"the local engine exited with code {self.proc.returncode}; log tail:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


class RolloutSide:
    """Engines, client and rewards on global rank 0. Made early (a local engine loads meanwhile),
    then `wait_ready()`, `generate(...)`, `evaluate(...)`, `sync_weights(...)`, and `close()`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.reward_fn = load_reward_fn(cfg.data.reward)
        self.engine: LocalEngineProcess | None = None
        if cfg.rollout.engine == "local":
            port = cfg.rollout.local_port or free_port()
            self.urls = [LocalEngineConfig(model_path=cfg.model.hf_path, port=port).url]
        else:
            self.urls = list(cfg.rollout.server_urls)
        self.weight_sync = DiskWeightSync(self.urls, timeout_s=cfg.rollout.request_timeout_s)
        client_cfg = ClientConfig(
            max_concurrency=cfg.rollout.max_concurrency, request_timeout_s=cfg.rollout.request_timeout_s
        )
        dvp = cfg.algorithm.log_rho is not None and cfg.algorithm.log_rho != float("-inf")
        self.on_result: Callable[[object], None] | None = None
        self.client = RolloutClient(
            self.urls,
            client_cfg,
            processor=DVPLogitProcessor.to_str() if dvp else None,
            on_result=self._on_result,
        )
        self.eval_client = RolloutClient(self.urls, client_cfg, processor=None)
        self.loop = asyncio.new_event_loop()
        if cfg.rollout.engine == "local":  # last: nothing after it can fail and leave the process behind
            self.engine = LocalEngineProcess(cfg, port, run_dir / "logs" / "local_engine.log")

    def _on_result(self, result) -> None:
        if self.on_result is not None:
            self.on_result(result)

    def wait_ready(self) -> None:
        """Block until every engine answers `/health` (raises with the engine log if the local one died)."""
        timeout = self.cfg.rollout.startup_timeout_s
        if self.engine is not None:
            deadline = time.monotonic() + timeout
            while True:
                self.engine.check_alive()
                try:
                    self._run(wait_until_healthy(self.urls, timeout_s=2.0, interval_s=0.2))
                    return
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
        self._run(wait_until_healthy(self.urls, timeout_s=timeout))

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], answers: Sequence[str], *, base_seed: int
    ) -> RolloutBatch:
        """`group_size` samples per prompt, scored by the reward; groups contiguous in prompt order."""
        r, n = self.cfg.rollout, self.cfg.algorithm.group_size
        sampling = SamplingConfig(
            n_samples=n,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            log_rho=self.cfg.algorithm.log_rho if self.client.processor is not None else None,
            base_seed=base_seed,
        )
        started = time.perf_counter()
        grouped = self._run(self.client.generate(prompt_ids, sampling))
        elapsed = time.perf_counter() - started
        samples = [s for group in grouped for s in group]
        completions = [self._decode(s.output_ids) for s in samples]
        sample_answers = [answers[i] for i in range(len(grouped)) for _ in range(n)]
        rewards = compute_rewards(self.reward_fn, completions, sample_answers)
        generated = sum(len(s.output_ids) for s in samples)
        return RolloutBatch(
            prompt_ids=[list(s.prompt_ids) for s in samples],
            response_ids=[list(s.output_ids) for s in samples],
            rollout_logprobs=[list(s.output_logprobs) for s in samples],
            rewards=rewards,
            correct=[x >= self.cfg.data.correct_reward for x in rewards],
            truncated=[s.finish_reason.get("type") == "length" for s in samples],
            weight_versions=[s.weight_version for s in samples],
            stats={"rollout_time_s": elapsed, "generated_tokens": float(generated)},
        )

    def evaluate(self, prompt_ids: Sequence[Sequence[int]], answers: Sequence[str]) -> dict[str, float]:
        """Accuracy of one sample per prompt at the training temperature (with DVP if on: the policy being
        trained; fixed seeds, so evaluations differ only by the weights) and of greedy decoding."""
        r = self.cfg.rollout
        sampled = SamplingConfig(
            n_samples=1,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            log_rho=self.cfg.algorithm.log_rho if self.client.processor is not None else None,
            base_seed=EVAL_SEED,
        )
        # greedy: no pruning needed (the argmax is always in the safe set)
        greedy = SamplingConfig(n_samples=1, max_new_tokens=r.max_new_tokens, temperature=0.0, log_rho=None)
        out = {}
        for name, client, sampling in (
            ("sampled", self.client, sampled),
            ("greedy", self.eval_client, greedy),
        ):
            grouped = self._run(client.generate(prompt_ids, sampling))
            completions = [self._decode(g[0].output_ids) for g in grouped]
            rewards = compute_rewards(self.reward_fn, completions, list(answers))
            correct = [x >= self.cfg.data.correct_reward for x in rewards]
            out[f"eval/{name}_accuracy"] = sum(correct) / len(correct)
            out[f"eval/{name}_reward"] = sum(rewards) / len(rewards)
        return out

    def sync_weights(self, hf_dir: Path, version: int) -> float:
        """Load the exported HF checkpoint `hf_dir` on every engine as `weight_version=str(version)`."""
        started = time.perf_counter()
        self._run(self.weight_sync.update(str(hf_dir), weight_version=str(version)))
        return time.perf_counter() - started

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        try:
            for client in (self.client, self.eval_client):
                self._run(client.close())
        finally:
            self.loop.close()
            if self.engine is not None:
                self.engine.stop()
