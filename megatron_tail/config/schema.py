"""The run configuration: one typed dataclass per YAML section, each field with a doc line.

    run_dir, seed                      top level
    model:      ModelSection           the HF checkpoint to start from and how to build it
    parallel:   ParallelSection        TP × PP × CP of the trainer (DP is what is left of the world)
    rollout:    RolloutSection         engine (local CPU or remote SGLang), sampling, weight sync
    algorithm:  AlgorithmConfig        the RL objective (advantages, DVP, IS/veto, STAPO, AR, Lopti, PPO)
    optimizer:  OptimizerSettings      the trainer's optimizer (megatron's distributed optimizer by default)
    data:       DataSection            prompts, their order, the reward
    train:      TrainSection           steps, micro-batches, checkpoints
    logging:    LoggingSection         TensorBoard, progress bars, the mismatch diagnostics' buckets

Settings are defined once, near their owners, in modules that import no megatron: `algorithm` is the
algorithms' `AlgorithmConfig`, `optimizer` the engine's `OptimizerSettings`, and `model` / `data` extend the
model's `ModelSettings` and the data's `PromptFormat` with what only a run needs (paths, batch sizes), so the
trainer and the data loader take these sections as they are. Every section validates on construction
(ValueError naming the field and the value); `RunConfig.__post_init__` checks what spans sections and
refuses what the loop cannot run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_tail.algorithms.config import AlgorithmConfig
from megatron_tail.data.prompts import PromptFormat
from megatron_tail.model.settings import ModelSettings
from megatron_tail.train.engine.settings import OptimizerSettings
from megatron_tail.utils.errors import UserError
from megatron_tail.utils.net import base_url_problem

RolloutEngine = Literal["local", "remote"]
WeightSyncMode = Literal["disk", "distributed"]
EngineDtype = Literal["bfloat16", "float16", "float32"]
RolloutQuantization = Literal["none", "fp8", "fp8_tensor", "nvfp4_a16"]
KvCacheDtype = Literal["auto", "fp8_e4m3"]
ProgressMode = Literal["auto", "always", "never"]
PauseMode = Literal["abort", "in_place", "retract"]
ROLLOUT_ENGINES: tuple[str, ...] = get_args(RolloutEngine)
WEIGHT_SYNC_MODES: tuple[str, ...] = get_args(WeightSyncMode)
LOCAL_DTYPES: tuple[str, ...] = get_args(EngineDtype)
ROLLOUT_QUANTIZATIONS: tuple[str, ...] = get_args(RolloutQuantization)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
LOCAL_ONLY_QUANTIZATIONS = ("fp8_tensor", "nvfp4_a16")
TOP_K_HEADROOM = 2
"""`rollout.sampling_mask_max_tokens` ≥ this × `rollout.top_k` (without `rollout.deterministic`). SGLang's
flashinfer top-k keeps every probability ≥ the k-th largest, and bf16 logits tie often: on rows of 151,936
bf16 logits (N(μ, σ²), σ 1–4, μ 0–20; 20 rows each) the ties past rank k added 2–10 % of k at μ = 0 and up
to 60 % at μ = 20, σ = 1 (bf16 steps 1/8 there). Twice top_k covers all of it; the cap costs SGLang an
`[batch, cap]` int32 buffer per step, little."""
PROGRESS_MODES: tuple[str, ...] = get_args(ProgressMode)


def _bad(section: str, name: str, value: object, why: str) -> None:
    raise UserError(f"{section}.{name} {why}; got {value!r}")


def _positive_int(section: str, name: str, value: int, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _bad(section, name, value, f"must be an int ≥ {minimum}")


def _choice(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _bad(section, name, value, f"must be one of {choices}")


@dataclass(frozen=True)
class ModelSection(ModelSettings):
    """The policy: a HF checkpoint directory (Qwen3 / Qwen2.5 / Llama-3) and how the trainer builds it (the
    `ModelSettings` fields: bf16, use_te, vocab_pad_multiple, use_cpu_initialization, max_sequence_length)."""

    hf_path: str = ""
    """HF checkpoint dir (config.json, *.safetensors, tokenizer files); required."""
    reference_offload: bool = False
    """With `algorithm.kl_coef` > 0: keep the frozen reference policy's weights in pinned host memory and
    copy them to the GPU only for the reference pass (saves 2 B/param per TP×PP shard in bf16)."""

    def __post_init__(self) -> None:
        _positive_int("model", "vocab_pad_multiple", self.vocab_pad_multiple)
        if self.max_sequence_length is not None:
            _positive_int("model", "max_sequence_length", self.max_sequence_length)
        super().__post_init__()


@dataclass(frozen=True)
class ParallelSection:
    """Trainer layout; world size = tensor_parallel × pipeline_parallel × context_parallel × data parallel."""

    tensor_parallel: int = 1
    """TP size (heads, FFN and vocab are split)."""
    pipeline_parallel: int = 1
    """PP size (layers are split into stages)."""
    context_parallel: int = 1
    """CP size: every packed sequence is padded to a multiple of 2·CP and split into 2·CP chunks, CP rank r
    computing chunks r and 2·CP−1−r, so activations and logits per GPU shrink by CP (long responses).
    Needs packed micro-batches (`train.max_tokens_per_micro_batch`). Gradients reduce over DP × CP."""
    expert_parallel: int = 1
    """EP size, mixture-of-experts models only: each rank of an EP group holds num_experts / EP experts of
    every MoE layer (megatron's `expert_model_parallel_size`); must divide the model's num_experts."""
    expert_tensor_parallel: int | None = None
    """Expert-TP size, MoE models only: splits each expert's FFN (megatron's `expert_tensor_parallel_size`).
    None: tensor_parallel. The world must be a multiple of expert_tensor_parallel × expert_parallel ×
    pipeline_parallel; expert data parallel is what is left."""
    distributed_timeout_minutes: float = 120.0
    """Timeout of every trainer process group: the world group (`init_process_group`; without one NCCL
    kills a collective after 10 minutes) and megatron's TP/PP/DP groups. 120: ranks no longer wait for rank
    0's rollout inside a collective (they wait in a CPU barrier, `rank0_wait_timeout_minutes`), but rank 0
    still writes the HF export (16 GB for 8B) and its share of a checkpoint (~115 GB per node) while the
    others wait in the next collective; 120 minutes covers those at a slow 0.1 GB/s with room to spare and
    still ends a real hang the same day."""
    rank0_wait_timeout_minutes: float | None = None
    """How long the other ranks wait (in a gloo barrier, on CPU) for one of rank 0's phases: a rollout with
    its dynamic-sampling rounds, scoring, eval, the disk weight sync. None: `distributed_timeout_minutes`.
    A Qwen3-8B step (1024 samples of up to 4096 tokens, up to 3 rounds, 8 SGLang servers) is ~10-30 minutes
    of rollout (projected)."""

    @property
    def wait_timeout_minutes(self) -> float:
        return self.rank0_wait_timeout_minutes or self.distributed_timeout_minutes

    @property
    def min_world_size(self) -> int:
        """The fewest ranks this layout runs on: a multiple of TP × PP × CP (`check_world`) and of
        ETP × EP × PP (`check_expert_world`), their least common multiple."""
        etp = self.expert_tensor_parallel or self.tensor_parallel
        dense = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        return math.lcm(dense, etp * self.expert_parallel * self.pipeline_parallel)

    def check_expert_world(self, world_size: int) -> None:
        """UserError naming the values unless `world_size` is a multiple of ETP × EP × PP (megatron's expert
        layout, `initialize_model_parallel`); nothing to check without expert options."""
        etp = self.expert_tensor_parallel or self.tensor_parallel
        experts = etp * self.expert_parallel * self.pipeline_parallel
        if world_size % experts:
            raise UserError(
                f"parallel.expert_tensor_parallel × parallel.expert_parallel × parallel.pipeline_parallel = "
                f"{etp} × {self.expert_parallel} × {self.pipeline_parallel} = {experts} does not divide the "
                f"world size {world_size}"
            )

    def __post_init__(self) -> None:
        _positive_int("parallel", "tensor_parallel", self.tensor_parallel)
        _positive_int("parallel", "pipeline_parallel", self.pipeline_parallel)
        _positive_int("parallel", "context_parallel", self.context_parallel)
        _positive_int("parallel", "expert_parallel", self.expert_parallel)
        if self.expert_tensor_parallel is not None:
            _positive_int("parallel", "expert_tensor_parallel", self.expert_tensor_parallel)
        for name in ("distributed_timeout_minutes", "rank0_wait_timeout_minutes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                _bad("parallel", name, value, "must be a number of minutes > 0")


@dataclass(frozen=True)
class RolloutSection:
    """Where samples come from and how the engines get the trainer's weights."""

    engine: RolloutEngine = "local"
    """"local": the trainer's rank 0 starts `megatron-tail serve-local` (CPU, HF transformers);
    "remote": SGLang servers (or one router) already running at `server_urls`."""
    server_urls: tuple[str, ...] = ()
    """Base URLs (`http://host:port`) of the engines; required with engine="remote"."""
    dtype: EngineDtype | None = None
    """dtype of the rollout engines: the local engine's, and under `slurm/rl.sbatch` the servers' `--dtype`
    (an explicit `MT_SGLANG_DTYPE` / `MT_LOCAL_DTYPE` still wins there). "float16" with
    `model.precision: fp16` is the fp16 remedy. None: `local_dtype` for the local engine the trainer
    starts, bfloat16 for servers that `rl.sbatch` starts."""
    local_dtype: EngineDtype = "bfloat16"
    """dtype of the local engine when `dtype` is None (bf16: its log-probs differ from an fp32 trainer's,
    as on GPUs)."""
    quantization: RolloutQuantization = "none"
    """"fp8": the engines generate with FP8 (e4m3) linear layers from the bf16 weights, quantized at load and
    after every weight sync: per-output-channel weight scales (SGLang's choice on cutlass-capable GPUs such as
    H100), per-token dynamic activation scales; embeddings, LM head, norms and attention stay in `dtype`.
    The local engine emulates it on CPU; `slurm/rl.sbatch` starts SGLang with `--quantization fp8
    --load-format flash_rl` (SGLang's FP8 RL loader, which re-quantizes synced bf16 weights; Qwen2/Qwen3
    dense models only; servers you start yourself for engine="remote" need the same two flags). Use it with
    an IS correction (`algorithm.is_mode`), DVP and the veto: the mismatch is much larger than bf16's.
    "fp8_tensor" (one e4m3 scale per weight and per activation tensor, SGLang's path without cutlass FP8)
    and "nvfp4_a16" (NVFP4 weights, bf16 activations, as SGLang serves a ModelOpt NVFP4A16 checkpoint;
    SGLang has no online 4-bit path for dense layers) are local-engine emulations for experiments
    (`local_engine/fp4.py`)."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """"fp8_e4m3": the local engine keeps keys and values in e4m3 at scale 1, as SGLang's `--kv-cache-dtype
    fp8_e4m3` does with a bf16 checkpoint (`local_engine/kv_cache.py`); local engine only (pass the flag to
    SGLang servers yourself). "auto": the engine's dtype."""
    local_logit_noise: float = 0.0
    """SYNTHETIC mismatch for experiments, local engine only: σ of Gaussian noise σ·(1 − p)·g on the engine's
    logits (Prop. 4.2's shape: largest in the tail; `local_engine/logit_noise.py`). 0 = off."""
    local_port: int | None = None
    """Port of the local engine; None picks a free one."""
    local_num_threads: int | None = 1
    """torch threads of the local engine (None: torch's default)."""
    local_device: str = "cpu"
    """torch device of the local engine's model, e.g. "cuda" or "cuda:0" (its sampling stays on the host, so
    a seed draws the same tokens as on CPU). On one GPU beside the trainer, sync weights by disk
    (`weight_sync: disk`): NCCL refuses a second rank on the same device."""
    max_new_tokens: int = 128
    """Longest response, in tokens (with `env`: longest model turn)."""
    env: str | None = None
    """Multi-turn episodes with an environment (`megatron_tail.rollout.envs`): the built-in "calculator" or a
    class "package.module:Class"; None: single-turn samples. Each model turn is one `/generate` call with the
    token ids of everything before it; the environment's observations are context (no loss, no log-prob).
    Runs step-wise and under the rollout manager (η ≥ 2, partial rollouts), with or without truncation."""
    max_turns: int = 1
    """Model turns per episode at most (with `env`)."""
    max_observation_tokens: int = 512
    """Longest observation (environment reply), in tokens; a longer one ends the episode before it."""
    env_workers: int = 4
    """With `env`: worker processes that run the environments (`rollout/envs/pool.py`); each runs one call at
    a time, so this many tool calls run at once, and a call past the time limit stops its own worker only
    (its episodes are generated again). 4: environment calls are short or wait on something outside, and a
    few processes keep one stuck call from stalling the rest at little memory on rank 0; raise it (up to
    `max_concurrency`) for slow tools."""
    env_timeout_s: float | None = None
    """With `env`: seconds one environment call (reset, step) may take in its worker before the worker is
    stopped and the episode fails; None: `data.reward_timeout_s`."""
    max_env_failure_fraction: float = 0.5
    """With `env`: the fraction of a step's episodes whose environment may fail (raise, or exceed
    `env_timeout_s`); each failure regenerates its group with fresh seeds (`rollout/env_failures`);
    past the fraction the run stops with one error naming the environment and its last exception."""
    temperature: float = 1.0
    """Sampling temperature T (> 0); the trainer scores log-probs at the same T."""
    max_concurrency: int = 64
    """Requests (one prompt's n samples each) in flight at once; under the rollout manager, the groups
    generating at once (AReaL's `max_concurrent_rollouts`, `rollout/manager.py`). With `env`: episodes in
    flight at once (under the manager, ⌈max_concurrency / group_size⌉ groups)."""
    request_timeout_s: float = 600.0
    """Time one request (one prompt's n samples) may take before it is retried; a request may time out twice
    (`ClientConfig.timeout_attempts`), so an engine that accepts and never answers fails the step after
    20 min. 600 s: long-CoT responses (16k–32k tokens at 30–50 tokens/s per sequence under load) need
    minutes; a shorter limit would retry healthy requests."""
    wait_report_s: float = 60.0
    """While waiting for the engines (samples, weight sync, startup), say what for and how long every this
    many seconds on rank 0's console."""
    startup_timeout_s: float = 300.0
    """How long to wait for the engines' `/health` at start."""
    weight_sync: WeightSyncMode = "disk"
    """How new weights reach the engines: "disk" (export a HF checkpoint, `/update_weights_from_disk`) or
    "distributed" (in memory: rank 0 broadcasts the HF tensors bucket by bucket over a process group it
    shares with the engines, SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`;
    NCCL on GPU, gloo on CPU)."""
    sync_bucket_mb: float = 512.0
    """"distributed": the bucket size; the sender holds one bucket plus one full parameter at a time."""
    sync_timeout_s: float = 600.0
    """"distributed": the weight group's timeout; a server that dies mid-sync fails the step after it."""
    sync_master_address: str | None = None
    """"distributed": the address at which the engines reach the trainer's rank 0 (it hosts the group's
    rendezvous); None: 127.0.0.1 for the local engine, else rank 0's Slurm node name (`SLURMD_NODENAME`),
    else its host name."""
    sync_master_port: int | None = None
    """"distributed": the port of that rendezvous on rank 0's host; None: a free one. `slurm/rl.sbatch`
    sets it from the job's port block."""
    weight_sync_dir: str | None = None
    """Where the exported weights go; None: `<run_dir>/rollout_weights`. Must be visible to remote engines."""
    deterministic: bool = False
    """SGLang servers that `slurm/rl.sbatch` starts get `--enable-deterministic-inference`: batch-invariant
    kernels and per-request `sampling_seed` (rollouts reproducible across runs), but SGLang then forces its
    slow PyTorch sampling backend. The local engine is deterministic either way; it follows the sampler SGLang
    would use (PyTorch here, flashinfer otherwise), whose truncation differs (see `top_p`)."""
    top_k: int = -1
    """SGLang's top_k (-1 off). With any of top_k / top_p / min_p on, every sample carries each token's
    sampling support as the engine returned it (`return_sampling_mask`), the behaviour log-prob is the
    engine's log-prob under that truncated distribution, and the trainer normalises θ_old, the update and the
    reference over the same support (the op's `sampling_support`), so the importance weights stay exact.
    SGLang returns a mask only for a finite top_k ≤ `sampling_mask_max_tokens`, so top_p / min_p need one."""
    top_p: float = 1.0
    """SGLang's top_p in (0, 1] (1 off): keep the most probable tokens until their mass reaches top_p. On
    SGLang's default (flashinfer) sampler, the mass is of the top-k tokens renormalised when any request of
    the engine's batch has min_p > 0, which DVP's min-p always is: so DVP on/off also moves top-p (README)."""
    min_p: float = 0.0
    """SGLang's min_p in [0, 1] (0 off): drop tokens below min_p × the top probability. With DVP on and
    truncation, the engine gets max(min_p, ρ): DVP's safe set is min-p at ρ (see the README)."""
    sampling_mask_max_tokens: int = 4096
    """The engines' `--sampling-mask-max-tokens` (SGLang's default): the most ids in one token's support.
    SGLang's flashinfer sampler keeps every tie at the top-k cutoff, so a support can exceed top_k, and SGLang
    rejects the request when it exceeds this cap: it must be ≥ `TOP_K_HEADROOM` × `top_k`, or ≥ `top_k` with
    `deterministic` (the PyTorch sampler keeps exactly top_k ranks). A rejected group is generated again and
    counted (`rollout.client.SupportOverflowError`); one rejected on every attempt is a user error naming
    both keys (`rollout.client.SupportOverflowsExhausted`)."""
    max_staleness: int = 0
    """η, how many weight versions a step's samples may lag the policy they train. The rollout manager
    (`rollout/manager.py`) makes every batch and admits a group only while at most η + 1 steps of groups
    are ahead of the trainer (AReaL's capacity rule): 0, each step samples with the weights it trains
    (rollout and training alternate); 1, step k+1's groups generate while step k trains, with the weights
    step k started from (one version behind; the IS corrections weigh by π_old/π_infer, the decoupled PPO
    objective; see the README); at η ≤ 1 a batch is the step's own groups, in prompt order. η ≥ 2: a
    batch is the first groups completed, oldest first; a straggler trains at its true staleness, logged in
    `rollout/staleness_max` (see `stale_groups`)."""
    stale_groups: str = "train"
    """Under the rollout manager, a completed group whose oldest token is more than `max_staleness`
    versions behind the step: "train" (the default, AReaL's rule) trains it at its true staleness, the IS
    weights correcting it; "drop" drops it (counted in `rollout/dropped_stale`) and regenerates its prompt
    with fresh seeds, at most twice per prompt, which biases training against long responses."""
    partial_rollouts: bool = False
    """At a weight update, requests in flight are paused (`pause_mode`) and continued from their tokens
    under the new weights, each token keeping the log-prob and version of the weights that sampled it
    (AReaL's interruptible rollouts), at any `max_staleness`. False: the manager lets the requests in
    flight finish before a weight update."""
    pause_mode: PauseMode = "retract"
    """How a weight update pauses the engines (SGLang's `/pause_generation` modes, `PauseGenerationReqInput`
    in `srt/managers/io_struct.py`): "abort" ends the requests in flight, the client continues each from its
    tokens (one re-prefill under the new weights, AReaL); "retract" puts them back in the engine's queue
    without their KV, recomputed under the new weights when they resume (abort's re-prefill without the
    round trip through the client); "in_place" holds them with their KV cache, computed by the older
    weights, and they go on decoding under the new ones on top of it (PipelineRL, verl v1 async), with no
    cache flush. Each token keeps the version and log-prob of the weights that sampled it in every mode (see
    the README). It matters only with `partial_rollouts`: without them the manager drains the requests in
    flight before an update. Default "retract": in the loop benchmark (`bench.loop`, η = 2 with partial
    rollouts, two runs on a shared 2-core machine) it ran 2.27× / 2.33× the synchronous loop against
    abort's 1.42× / 1.81× (its update waits for no aborted request to come back: weight sync 0.02–0.03 s
    against 0.14–0.15 s), with abort's exactness: every token after an update is the new weights' on a
    recomputed cache. in_place was as fast or faster (2.22× / 2.96×) but samples on the older weights' KV."""

    @property
    def truncates(self) -> bool:
        """Any of top_k / top_p / min_p is on: samples carry their per-token sampling support."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0

    def _check_truncation(self) -> None:
        """SGLang's ranges (`SamplingParams.verify`) and its mask rule: a finite top_k ≤ the mask cap."""
        _positive_int("rollout", "sampling_mask_max_tokens", self.sampling_mask_max_tokens)
        if self.top_k != -1:
            _positive_int("rollout", "top_k", self.top_k)
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, (int, float))
            or not 0 < self.top_p <= 1
        ):
            _bad("rollout", "top_p", self.top_p, "must be in (0, 1] (1: off)")
        if (
            isinstance(self.min_p, bool)
            or not isinstance(self.min_p, (int, float))
            or not 0 <= self.min_p <= 1
        ):
            _bad("rollout", "min_p", self.min_p, "must be in [0, 1] (0: off)")
        if self.truncates and self.top_k == -1:
            _bad(
                "rollout",
                "top_k",
                self.top_k,
                f"must be set with rollout.top_p={self.top_p} / rollout.min_p={self.min_p}: the engine "
                "returns each token's sampling support, which SGLang bounds by --sampling-mask-max-tokens "
                f"(rollout.sampling_mask_max_tokens={self.sampling_mask_max_tokens}) and refuses without "
                "a finite top_k; set rollout.top_k (prime-rl bounds masks with 512)",
            )
        cap = self.sampling_mask_max_tokens
        if self.top_k > cap:
            _bad(
                "rollout",
                "top_k",
                self.top_k,
                f"must be ≤ rollout.sampling_mask_max_tokens={cap} (SGLang refuses a sampling mask request "
                "above it)",
            )
        if not self.deterministic and self.top_k * TOP_K_HEADROOM > cap:
            _bad(
                "rollout",
                "top_k",
                self.top_k,
                f"must be ≤ {cap // TOP_K_HEADROOM} with rollout.sampling_mask_max_tokens={cap} (headroom "
                f"×{TOP_K_HEADROOM}): SGLang's flashinfer sampler keeps every tie at the top-k cutoff and "
                "rejects a request whose support exceeds the cap; raise rollout.sampling_mask_max_tokens to "
                f"{self.top_k * TOP_K_HEADROOM}, lower top_k, or set rollout.deterministic (no ties kept)",
            )

    def _check_server_urls(self) -> None:
        """Each a base URL aiohttp can use (`utils.net.base_url_problem`), none twice: a typo is refused here,
        by name, instead of surfacing as engines that never answer."""
        seen = set()
        for url in self.server_urls:
            if (why := base_url_problem(url)) is not None:
                _bad(
                    "rollout",
                    "server_urls",
                    url,
                    f"must hold the engines' base URLs, http(s)://HOST[:PORT]: {why}",
                )
            if url.rstrip("/") in seen:
                _bad("rollout", "server_urls", list(self.server_urls), f"names {url.rstrip('/')} twice")
            seen.add(url.rstrip("/"))

    @property
    def max_response_tokens(self) -> int:
        """Longest response of a sample: `max_new_tokens`, or with `env` every turn and the observations
        between them, `max_turns × max_new_tokens + (max_turns − 1) × max_observation_tokens`."""
        if self.env is None:
            return self.max_new_tokens
        return self.max_turns * self.max_new_tokens + (self.max_turns - 1) * self.max_observation_tokens

    @property
    def max_policy_tokens(self) -> int:
        """Most tokens the policy samples in one response: `max_turns × max_new_tokens` (T of DVP's bias
        bound)."""
        return self.max_turns * self.max_new_tokens

    @property
    def local_engine_dtype(self) -> str:
        """The local engine's dtype: `dtype`, else `local_dtype`."""
        return self.dtype or self.local_dtype

    def __post_init__(self) -> None:
        _choice("rollout", "engine", self.engine, ROLLOUT_ENGINES)
        _choice("rollout", "local_dtype", self.local_dtype, LOCAL_DTYPES)
        if self.dtype is not None:
            _choice("rollout", "dtype", self.dtype, LOCAL_DTYPES)
        _choice("rollout", "weight_sync", self.weight_sync, WEIGHT_SYNC_MODES)
        _choice("rollout", "quantization", self.quantization, ROLLOUT_QUANTIZATIONS)
        _choice("rollout", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if isinstance(self.local_logit_noise, bool) or not self.local_logit_noise >= 0:
            _bad("rollout", "local_logit_noise", self.local_logit_noise, "must be a number ≥ 0 (0 = off)")
        if self.engine == "remote":
            if self.quantization in LOCAL_ONLY_QUANTIZATIONS:
                _bad(
                    "rollout",
                    "quantization",
                    self.quantization,
                    'is a local-engine emulation (engine: "local")',
                )
            if self.kv_cache_dtype != "auto" or self.local_logit_noise:
                _bad(
                    "rollout",
                    "kv_cache_dtype/local_logit_noise",
                    (self.kv_cache_dtype, self.local_logit_noise),
                    'apply to the local engine only (engine: "local")',
                )
        if (
            isinstance(self.max_staleness, bool)
            or not isinstance(self.max_staleness, int)
            or self.max_staleness < 0
        ):
            _bad(
                "rollout",
                "max_staleness",
                self.max_staleness,
                "must be an int ≥ 0 (0 synchronous, 1 one step ahead, η ≥ 2 up to η versions in flight)",
            )
        if not isinstance(self.partial_rollouts, bool):
            _bad("rollout", "partial_rollouts", self.partial_rollouts, "must be true or false")
        _choice("rollout", "pause_mode", self.pause_mode, PAUSE_MODES)
        if self.stale_groups not in ("train", "drop"):
            _bad("rollout", "stale_groups", self.stale_groups, 'must be "train" or "drop"')
        if self.engine == "remote" and not self.server_urls:
            _bad(
                "rollout", "server_urls", self.server_urls, 'must name at least one URL with engine="remote"'
            )
        self._check_server_urls()
        for name in ("local_port", "sync_master_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                _bad("rollout", name, port, "must be in 1..65535")
        if self.local_num_threads is not None:
            _positive_int("rollout", "local_num_threads", self.local_num_threads)
        if not isinstance(self.local_device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.local_device):
            _bad("rollout", "local_device", self.local_device, 'must be "cpu", "cuda" or "cuda:N"')
        _positive_int("rollout", "max_new_tokens", self.max_new_tokens)
        self._check_truncation()
        _positive_int("rollout", "max_turns", self.max_turns)
        _positive_int("rollout", "max_observation_tokens", self.max_observation_tokens)
        _positive_int("rollout", "env_workers", self.env_workers)
        t = self.env_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            _bad("rollout", "env_timeout_s", t, "must be > 0 (seconds per environment call) or null")
        f = self.max_env_failure_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            _bad("rollout", "max_env_failure_fraction", f, "must be a number in [0, 1]")
        if self.env is not None and (not isinstance(self.env, str) or not self.env.strip()):
            _bad("rollout", "env", self.env, "must be 'calculator', 'package.module:Class' or null")
        if self.env is None and self.max_turns > 1:
            _bad("rollout", "max_turns", self.max_turns, "needs an environment (rollout.env) when > 1")
        _positive_int("rollout", "max_concurrency", self.max_concurrency)
        if not self.temperature > 0:
            _bad(
                "rollout",
                "temperature",
                self.temperature,
                "must be > 0 (training samples; greedy is eval only)",
            )
        if self.engine == "local" and self.server_urls:
            _bad(
                "rollout",
                "server_urls",
                list(self.server_urls),
                "is for engine: remote; with engine: local the trainer starts its own engine (remove "
                "server_urls, or set rollout.engine: remote)",
            )
        for name in (
            "request_timeout_s",
            "startup_timeout_s",
            "sync_bucket_mb",
            "sync_timeout_s",
            "wait_report_s",
        ):
            if not getattr(self, name) > 0:
                _bad("rollout", name, getattr(self, name), "must be > 0")


@dataclass(frozen=True)
class DataSection(PromptFormat):
    """Prompts (local jsonl / json / parquet, read by `megatron_tail.data` with the `PromptFormat` fields:
    prompt_key, answer_key, apply_chat_template, prompt_template, system_prompt, max_prompt_tokens), their
    order, and the reward."""

    train_path: str = ""
    """File of training prompts, one record per prompt with `prompt_key` and `answer_key`; required."""
    eval_path: str | None = None
    """Held-out prompts for greedy accuracy every `train.eval_every` steps; None: no eval."""
    prompts_per_step: int = 16
    """Prompts per RL step; each gets `algorithm.group_size` samples."""
    eval_prompts: int = 64
    """At most this many eval prompts (the first ones of `eval_path`)."""
    shuffle: bool = True
    """Shuffle per epoch, seeded by `seed` and the epoch (a resumed run sees the same order)."""
    reward: str = "math"
    """Reward: a built-in ("math", "arithmetic") or a dotted path "package.module:function"."""
    reward_timeout_s: float = 600.0
    """Longest time the reward may take to score one batch (a step's or an eval's completions, in the reward
    worker process); after it the worker is killed and the step fails naming the reward and this limit.
    600 s: a built-in scores thousands of completions in seconds and math-verify bounds each answer at a
    few seconds, so only a hung reward gets near it, while a slow verifier on a large batch (8k
    completions × 50 ms) still fits; it is well inside a job's preemption notice."""
    correct_reward: float = 1.0
    """A sample counts as correct (for accuracy) when its reward is at least this."""
    reward_max_abs: float | None = None
    """R_max, the largest |reward|, for DVP's bias bound R_max·T·(1 − Z_min) (Prop. 5.5); None: the range
    the reward function declares (`fn.reward_range`; the built-ins declare [0, 1]); without either, the
    bound is not logged."""

    filter_zero_variance_groups: bool = False
    """DAPO's dynamic sampling, a filter on finished groups: the rollout manager drops a group whose rewards
    are all equal (zero advantages; `rollout/filtered_groups`) and admits the next prompt of the stream in
    its place at once, until the step has `prompts_per_step` groups. `reward/mean` is over the trained
    groups, `reward/generated_mean` over every group completed."""
    max_sampling_rounds: int = 4
    """With `filter_zero_variance_groups` (1..64): after `max_sampling_rounds × prompts_per_step` groups
    filtered for one batch (as many as that many rounds of a full step would draw) the step trains on the
    groups it has, cut to what the trainer splits (`rollout/batch_fill` < 1; none: a skipped step)."""

    def __post_init__(self) -> None:
        _positive_int("data", "prompts_per_step", self.prompts_per_step)
        _positive_int("data", "max_sampling_rounds", self.max_sampling_rounds)
        if self.max_sampling_rounds > 64:
            _bad("data", "max_sampling_rounds", self.max_sampling_rounds, "must be ≤ 64")
        _positive_int("data", "eval_prompts", self.eval_prompts)
        if not self.reward_timeout_s > 0:
            _bad("data", "reward_timeout_s", self.reward_timeout_s, "must be > 0 (seconds per batch)")
        if self.max_prompt_tokens is not None:
            _positive_int("data", "max_prompt_tokens", self.max_prompt_tokens)
        if "{prompt}" not in self.prompt_template:
            _bad("data", "prompt_template", self.prompt_template, "must contain '{prompt}'")
        if self.reward_max_abs is not None and not 0 <= self.reward_max_abs < float("inf"):
            _bad("data", "reward_max_abs", self.reward_max_abs, "must be a finite number ≥ 0 or null")
        super().__post_init__()


@dataclass(frozen=True)
class TrainSection:
    """The step loop."""

    steps: int = 100
    """RL steps to run in total (a resumed run continues up to this number)."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of a packed micro-batch: the samples of a mini-batch are packed back to back (THD,
    megatron's `PackedSeqParams`) into micro-batches of at most this many tokens, first-fit decreasing,
    balanced over DP ranks by tokens. Must hold the longest sample (`data.max_prompt_tokens` +
    `rollout.max_response_tokens`); the activation memory of a micro-batch scales with it."""
    packed: bool | None = None
    """Packed (THD) micro-batches by `max_tokens_per_micro_batch` (true), or padded micro-batches of
    `micro_batch_size` samples (false; this overrides a token budget set elsewhere, so one `--set
    train.packed=false` compares the layouts). None: packed exactly when a token budget is set."""
    micro_batch_size: int = 8
    """Padded micro-batches only: samples (rows) per micro-batch."""
    seq_len: int | None = None
    """Padded micro-batches only: row length; None: the longest sample of the step."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch (contiguous shares of whole groups)."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many steps (and always at the last step and on SIGTERM/SIGUSR1)."""
    keep_checkpoints: int = 2
    """Keep only the newest this many checkpoints."""
    resume: bool = True
    """Resume from the newest checkpoint in `<run_dir>/checkpoints` if there is one."""
    eval_every: int = 0
    """Evaluate on the eval prompts every this many steps (and before the first); 0: never."""
    eval_samples_per_prompt: int = 1
    """n samples per eval prompt at the rollout temperature (plus one greedy): logs `eval/pass@k` (the
    unbiased estimator, k = 1, 2, 4, …, n) and `eval/mean@n`; `eval/sampled_accuracy` is mean@n."""

    def __post_init__(self) -> None:
        _positive_int("train", "steps", self.steps)
        _positive_int("train", "micro_batch_size", self.micro_batch_size)
        _positive_int("train", "mini_batches", self.mini_batches)
        _positive_int("train", "checkpoint_every", self.checkpoint_every)
        _positive_int("train", "keep_checkpoints", self.keep_checkpoints)
        _positive_int("train", "eval_every", self.eval_every, minimum=0)
        _positive_int("train", "eval_samples_per_prompt", self.eval_samples_per_prompt)
        if self.seq_len is not None:
            _positive_int("train", "seq_len", self.seq_len, minimum=2)
        if self.max_tokens_per_micro_batch is not None:
            _positive_int("train", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, minimum=2)
        if self.packed is not None and not isinstance(self.packed, bool):
            _bad("train", "packed", self.packed, "must be true, false or null")
        if self.packed and self.max_tokens_per_micro_batch is None:
            _bad("train", "max_tokens_per_micro_batch", None, "is required when train.packed is true")
        if self.is_packed and self.seq_len is not None:
            _bad(
                "train",
                "seq_len",
                self.seq_len,
                "applies to padded micro-batches only; packed ones are sized by "
                "train.max_tokens_per_micro_batch (or set train.packed: false)",
            )

    @property
    def is_packed(self) -> bool:
        """Packed (THD) micro-batches: `packed`, else whether a token budget is set."""
        return self.max_tokens_per_micro_batch is not None if self.packed is None else self.packed


@dataclass(frozen=True)
class LoggingSection:
    """TensorBoard, console and the training–inference mismatch diagnostics."""

    tensorboard: bool = True
    """Write TensorBoard events to `<run_dir>/tensorboard`."""
    progress: ProgressMode = "auto"
    """Progress bars: "auto" (only when stdout is a terminal), "always" or "never"."""
    prob_buckets: tuple[float, ...] = (0.5, 1e-2, 1e-4)
    """Descending π_train edges of the |Δ| buckets: [0.5, 1], [1e-2, 0.5), [1e-4, 1e-2), [0, 1e-4)."""
    tail_prob: float = 1e-2
    """Sampled tokens with π_train below this are 'tail' for the signed-Δ metric (DVP Prop. 4.3)."""

    def __post_init__(self) -> None:
        _choice("logging", "progress", self.progress, PROGRESS_MODES)
        edges = tuple(self.prob_buckets)
        if not edges or any(not 0 < e < 1 for e in edges) or list(edges) != sorted(set(edges), reverse=True):
            _bad("logging", "prob_buckets", edges, "must be strictly descending probabilities in (0, 1)")
        if not 0 < self.tail_prob <= 1:
            _bad("logging", "tail_prob", self.tail_prob, "must be in (0, 1]")


@dataclass(frozen=True)
class RunConfig:
    """One RL run. Load with `megatron_tail.config.load_config(path, overrides)`."""

    run_dir: str = "runs/default"
    """Checkpoints, TensorBoard events, the resolved config and the rollout weights go here."""
    seed: int = 1234
    """Seeds the data order, the rollout seeds and the trainer's RNGs."""
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        if not self.run_dir:
            _bad("run", "run_dir", self.run_dir, "must be a directory path")
        if self.algorithm.loss_aggregation == "seq_mean_token_sum" and self.algorithm.loss_max_len is None:
            _bad("algorithm", "loss_max_len", None, "is required with seq_mean_token_sum")
        if self.model.vocab_pad_multiple % self.parallel.tensor_parallel:
            _bad(
                "model",
                "vocab_pad_multiple",
                self.model.vocab_pad_multiple,
                f"must be divisible by parallel.tensor_parallel={self.parallel.tensor_parallel}",
            )
        if self.algorithm.overlong_buffer > self.rollout.max_new_tokens:
            _bad(
                "algorithm",
                "overlong_buffer",
                self.algorithm.overlong_buffer,
                f"must be ≤ rollout.max_new_tokens={self.rollout.max_new_tokens} (it ends at the limit)",
            )
        if self.rollout.env is not None and self.algorithm.overlong_buffer > 0:
            _bad(
                "algorithm",
                "overlong_buffer",
                self.algorithm.overlong_buffer,
                "must be 0 with rollout.env (the overlong penalty is for single-turn lengths)",
            )
        self._check_token_budget()
        dvp = self.algorithm.log_rho is not None and self.algorithm.log_rho != float("-inf")
        if self.rollout.deterministic and self.rollout.truncates and (dvp or self.rollout.min_p > 0):
            _bad(
                "rollout",
                "deterministic",
                True,
                f"cannot combine with min-p (rollout.min_p={self.rollout.min_p}, or DVP's log_rho="
                f"{self.algorithm.log_rho} sent as min-p with rollout.top_k/top_p): SGLang's seeded PyTorch "
                "sampler asserts against min-p (top_k_top_p_min_p_sampling_from_probs_torch)",
            )
        if self.algorithm.sampling_support == "ignore" and dvp:
            _bad(
                "algorithm",
                "sampling_support",
                "ignore",
                f"cannot combine with DVP (algorithm.log_rho={self.algorithm.log_rho}): DVP prunes both "
                "sides with one rule, while ignore is the one-sided ablation; set algorithm.log_rho=null, "
                "or sampling_support=replay",
            )
        if self.data.prompts_per_step % self.train.mini_batches:
            _bad(
                "train",
                "mini_batches",
                self.train.mini_batches,
                f"must divide data.prompts_per_step={self.data.prompts_per_step}",
            )

    def _check_token_budget(self) -> None:
        """A packed micro-batch must hold the longest sample (padded to 2·CP under context parallelism), and
        split evenly over CP chunks and under sequence parallelism."""
        budget = self.train.max_tokens_per_micro_batch
        cp = self.parallel.context_parallel
        if not self.train.is_packed:
            if cp > 1:
                _bad(
                    "parallel",
                    "context_parallel",
                    cp,
                    "needs packed micro-batches (train.max_tokens_per_micro_batch; train.packed not false)",
                )
            return
        response = self.rollout.max_response_tokens
        longest = None if self.data.max_prompt_tokens is None else self.data.max_prompt_tokens + response
        padded = None if longest is None else -(-longest // self.sequence_multiple) * self.sequence_multiple
        if padded is not None and budget < padded:
            what = (
                f"rollout.max_new_tokens={response}"
                if self.rollout.env is None
                else f"the longest episode's response ({response}: rollout.max_turns × max_new_tokens + "
                "(max_turns − 1) × max_observation_tokens)"
            )
            _bad(
                "train",
                "max_tokens_per_micro_batch",
                budget,
                f"must hold the longest sample: data.max_prompt_tokens={self.data.max_prompt_tokens} + "
                f"{what} = {longest}"
                + (f", padded to a multiple of 2·context_parallel = {padded}" if padded != longest else ""),
            )
        if budget % self.micro_batch_multiple:
            tp = self.parallel.tensor_parallel
            sp = f"parallel.tensor_parallel={tp} with model.sequence_parallel"
            why = (
                f"must be a multiple of {self.micro_batch_multiple} (2·parallel.context_parallel = {2 * cp} "
                "chunks per sequence" + (f" × {sp}" if self.micro_batch_multiple > 2 * cp else "") + ")"
                if cp > 1
                else f"must be a multiple of {sp}"
            )
            _bad("train", "max_tokens_per_micro_batch", budget, why)

    @property
    def sequence_multiple(self) -> int:
        """Each packed sequence's length multiple: 2·CP under context parallelism (its chunks), else 1."""
        cp = self.parallel.context_parallel
        return 2 * cp if cp > 1 else 1

    @property
    def micro_batch_multiple(self) -> int:
        """Sequence-length multiple of a micro-batch: 2·CP under context parallelism, times TP with sequence
        parallelism (megatron splits each CP rank's tokens over TP ranks), else 1."""
        tp = self.parallel.tensor_parallel
        return self.sequence_multiple * (tp if self.model.sequence_parallel and tp > 1 else 1)

    def check_world(self, world_size: int) -> None:
        """Before any process group: `world_size` must be TP × PP × CP × DP. UserError naming the values."""
        p = self.parallel
        model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
        if world_size % model_parallel:
            raise UserError(
                f"parallel.tensor_parallel × parallel.pipeline_parallel × parallel.context_parallel = "
                f"{p.tensor_parallel} × {p.pipeline_parallel} × {p.context_parallel} = {model_parallel} "
                f"does not divide the world size {world_size}; launch with `torchrun --nproc-per-node "
                f"{model_parallel} -m megatron_tail.cli train CONFIG.yaml` (or a multiple of it)"
            )
        p.check_expert_world(world_size)

    def warnings(self) -> list[str]:
        """Valid settings a user should still be told about at the start of a run, one line each."""
        out = []
        if self.algorithm.sampling_support == "ignore":
            out.append(
                "algorithm.sampling_support=ignore: samples drawn with rollout.top_k/top_p/min_p are scored "
                "over the full vocabulary, so every importance weight is biased by the mass the sampler cut "
                "(mismatch/outside_support_mass); an ablation that reproduces stacks without replay, not a "
                "setting to train with"
                + ("" if self.rollout.truncates else " (no truncation is on: it changes nothing here)")
            )
        if self.algorithm.old_logprobs == "engine":
            out.append(
                "algorithm.old_logprobs=engine: θ_old is the engine's log-probs, so PPO's ratio starts at "
                "π_train/π_infer and the importance weights are 1; an ablation"
            )
        return out

    def check_runnable(self) -> None:
        """What a run needs beyond a valid config: the required paths. ValueError naming the key."""
        if not self.model.hf_path:
            _bad("model", "hf_path", self.model.hf_path, "is required (a HF checkpoint directory)")
        if not self.data.train_path:
            _bad("data", "train_path", self.data.train_path, "is required (a jsonl/json/parquet file)")

    def check_inputs(self) -> None:
        """`check_runnable`, and what the run reads on this machine, as far as it can be told without
        megatron-core (`train` calls this before importing it, so a user's mistake is one line, not one
        after megatron's start-up): the environment and the reward, imported by name; the prompt files; the
        model directory (config.json, tokenizer, safetensors headers). UserError naming the key and the
        culprit."""
        self.check_runnable()
        from megatron_tail.data.prompts import check_prompt_file
        from megatron_tail.model.directory import check_model_dir
        from megatron_tail.rewards.registry import load_reward_fn
        from megatron_tail.rollout.envs.registry import load_env_class

        if self.rollout.env is not None:
            load_env_class(self.rollout.env)
        load_reward_fn(self.data.reward)
        check_prompt_file(self.data.train_path, "data.train_path")
        if self.data.eval_path:
            check_prompt_file(self.data.eval_path, "data.eval_path")
        check_model_dir(self.model.hf_path)
