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
    cluster:    ClusterSection         the Slurm layout `slurm/rl.sbatch` starts and `plan` checks

Settings are defined once, near their owners, in modules that import no megatron: `algorithm` is the
algorithms' `AlgorithmConfig`, `rollout` the rollout's `RolloutSection`, and `model` / `data` extend the
model's `ModelSettings` and the data's `PromptFormat` with what only a run needs (paths, batch sizes), so the
trainer and the data loader take these sections as they are. The trainer's own sections, `parallel`
(`config.parallel`) and `optimizer` (`config.optimizer`), live in this package, below the trainer
(`train.engine` takes them as they are), with the job's Slurm layout (`cluster`, `config.cluster`). Every
section validates on construction
(ValueError naming the field and the value); `RunConfig.__post_init__` checks what spans sections and
refuses what the loop cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, get_args

from megatron_tail.algorithms.config import AlgorithmConfig
from megatron_tail.data.prompts import PromptDataConfig, PromptFormat, prompt_template_problem
from megatron_tail.model.settings import ModelSettings
from megatron_tail.rollout.settings import RolloutSection
from megatron_tail.utils.errors import UserError
from megatron_tail.utils.settings_checks import bad as _bad
from megatron_tail.utils.settings_checks import choice as _choice
from megatron_tail.utils.settings_checks import positive_int as _positive_int
from megatron_tail.utils.settings_checks import wait_limit

from .cluster import ClusterSection
from .optimizer import OptimizerSettings
from .parallel import ParallelSection

if TYPE_CHECKING:
    from megatron_tail.algorithms.overlong import OverlongShaping

ProgressMode = Literal["auto", "always", "never"]
PROGRESS_MODES: tuple[str, ...] = get_args(ProgressMode)
FilterReward = Literal["task", "shaped"]
FILTER_REWARDS: tuple[str, ...] = get_args(FilterReward)


@dataclass(frozen=True)
class ModelSection(ModelSettings):
    """The policy: a HF checkpoint directory (Qwen3 / Qwen2.5 / Llama-3) and how the trainer builds it (the
    `ModelSettings` fields: precision, use_te, vocab_pad_multiple, use_cpu_initialization,
    max_sequence_length, gradient_accumulation_fusion, …)."""

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
class DataSection(PromptFormat):
    """Prompts (local jsonl / json / parquet, read by `megatron_tail.data` with the `PromptFormat` fields:
    prompt_key, answer_key, apply_chat_template, prompt_template, system_prompt, enable_thinking,
    max_prompt_tokens), their
    order, and the reward."""

    train_path: str = ""
    """File of training prompts, one record per prompt with `prompt_key` and `answer_key`; required."""
    eval_path: str | None = None
    """Held-out prompts for greedy accuracy every `train.eval_every` steps; None: no eval."""
    prompts_per_step: int = 16
    """Prompts per RL step; each gets `algorithm.group_size` samples."""
    eval_prompts: int = 64
    """At most this many eval prompts (the first ones of `eval_path`)."""
    eval_prompt_key: str | None = None
    """Field (dotted path) of `eval_path`'s prompts; None: `prompt_key` (the eval file read like the
    training file). E.g. train on DAPO-Math-17k's chat messages (`prompt`) and evaluate on MATH-500's
    `problem`."""
    eval_answer_key: str | None = None
    """Field (dotted path) of `eval_path`'s answers; None: `answer_key`."""
    eval_prompt_template: str | None = None
    """`prompt_template` for `eval_path`'s prompts; None: `prompt_template`."""
    shuffle: bool = True
    """Shuffle per epoch, seeded by `seed` and the epoch (a resumed run sees the same order)."""
    reward: str = "math"
    """Reward: a built-in ("math", "arithmetic") or a dotted path "package.module:function". It reads the
    last model turn's reply, with the `<think>` a chat template opened put back in front (DeepSeek-R1's and
    Qwen3's *-Thinking-2507 templates end the prompt inside it), so "math" scores a reply cut off while
    thinking 0."""
    reward_timeout_s: float = 600.0
    """Longest time the reward may take on one completion (in the reward worker process, which scores a
    prompt's group of completions as one batch, in training and in evaluation): after this long without a
    completion scored, the worker is killed and the step fails naming the reward, this limit and how much of
    the batch was scored. Per completion, not per batch: a group of slow but bounded answers (math-verify
    stops each parse at 5 s, and a policy that writes pathological LaTeX writes it in every sample) is not a
    hang, however large the group.
    600 s: a built-in scores an answer within seconds, so only a hung reward gets near it, while a slow
    verifier (a sandboxed test suite) still fits; it is well inside a job's preemption notice."""
    correct_reward: float = 1.0
    """A sample counts as correct (for accuracy and pass@k) when its final answer's reward is at least this
    (an environment's step rewards are in the trained reward, not in this test)."""
    reward_max_abs: float | None = None
    """R_max, the largest |reward|, for DVP's bias bound R_max·T·(1 − Z_min) (Prop. 5.5); None: the range
    the reward function declares (`fn.reward_range`; the built-ins declare [0, 1]); without either, the
    bound is not logged."""

    filter_zero_variance_groups: bool = False
    """DAPO's dynamic sampling, a filter on finished groups: the rollout manager drops a group whose rewards
    (`filter_reward`) are all equal (`rollout/filtered_groups`) and admits the next prompt of the stream in
    its place at once, until the step has `prompts_per_step` groups. `reward/mean` is over the trained
    groups, `reward/generated_mean` over every group completed."""
    filter_reward: FilterReward = "task"
    """Which rewards the filter compares (`FILTER_REWARDS`). "task": the reward function's (DAPO: a group
    whose accuracy is 0 or 1, verl's `filter_groups.metric=acc`). "shaped": the rewards the advantages are
    computed from, the task reward plus the overlong penalty (`algorithm.overlong_buffer`): a group is
    dropped exactly when its advantages are all zero. The two differ only with overlong shaping: there
    "task" drops a group whose answers are all right but some ran long (non-zero advantages from the
    penalty alone) and keeps one whose penalty evens out its task rewards (all advantages zero). Default
    "task", as DAPO, which uses both its filter and its overlong shaping."""
    max_sampling_rounds: int = 4
    """With `filter_zero_variance_groups` (1..64): after `max_sampling_rounds × prompts_per_step` groups
    filtered for one batch (as many as that many rounds of a full step would draw) the step trains on the
    groups it has, cut to what the trainer splits (`rollout/batch_fill` < 1; none: a skipped step); at
    rollout.max_staleness ≤ 1 it first waits for its own groups still generating. The places it left unused
    are not handed to the next steps' groups, which would then run at older weights than max_staleness
    allows."""

    def __post_init__(self) -> None:
        _positive_int("data", "prompts_per_step", self.prompts_per_step)
        _positive_int("data", "max_sampling_rounds", self.max_sampling_rounds)
        _choice("data", "filter_reward", self.filter_reward, FILTER_REWARDS)
        if self.filter_reward != "task" and not self.filter_zero_variance_groups:
            _bad("data", "filter_reward", self.filter_reward, "needs data.filter_zero_variance_groups=true")
        if self.max_sampling_rounds > 64:
            _bad("data", "max_sampling_rounds", self.max_sampling_rounds, "must be ≤ 64")
        _positive_int("data", "eval_prompts", self.eval_prompts)
        wait_limit("data", "reward_timeout_s", self.reward_timeout_s, unit="seconds per completion")
        if self.max_prompt_tokens is not None:
            _positive_int("data", "max_prompt_tokens", self.max_prompt_tokens)
        for name in ("prompt_template", "eval_prompt_template"):
            if (template := getattr(self, name)) is not None and (
                problem := prompt_template_problem(template)
            ):
                _bad("data", name, template, problem)
        if self.reward_max_abs is not None and not 0 <= self.reward_max_abs < float("inf"):
            _bad("data", "reward_max_abs", self.reward_max_abs, "must be a finite number ≥ 0 or null")
        super().__post_init__()

    def eval_prompt_data(self) -> PromptDataConfig:
        """`eval_path` as a prompt set: the training file's format with the `eval_*` fields over it."""
        fmt = replace(
            self,
            prompt_key=self.eval_prompt_key or self.prompt_key,
            answer_key=self.eval_answer_key or self.answer_key,
            prompt_template=self.eval_prompt_template or self.prompt_template,
        )
        return PromptDataConfig.of(self.eval_path, fmt)


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
    """Padded micro-batches only: row length; None: the longest sample of each DP rank's share of each
    mini-batch."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch (contiguous shares of whole groups)."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many steps (and always at the last step and on SIGTERM/SIGUSR1)."""
    keep_checkpoints: int = 2
    """Keep only the newest this many checkpoints."""
    resume: bool = True
    """Resume from the newest checkpoint in `<run_dir>/checkpoints` if there is one."""
    allow_config_change: bool = False
    """Resume even where the config changes what the checkpoint was trained with (the model, algorithm,
    optimizer, data, sampling); each changed key is logged with both values. False: such a resume is
    refused, naming them. Steps, cadence, logging, timeouts and the layout may change either way
    (`megatron_tail.train.run.config_change.CHANGEABLE_KEYS`, `RESHARDABLE_KEYS`)."""
    eval_every: int = 0
    """Evaluate on the eval prompts every this many steps (and before the first); 0: never."""
    eval_samples_per_prompt: int = 1
    """n samples per eval prompt at the rollout temperature (plus one greedy): logs `eval/pass@k` (the
    unbiased estimator, k = 1, 2, 4, …, n) and `eval/mean@n`; `eval/sampled_accuracy` is mean@n."""
    max_nonfinite_updates_in_a_row: int = 3
    """An optimizer update whose global gradient norm is NaN or ±inf is skipped (the weights and optimizer
    state stay as they were; said on the console, counted in `train/nonfinite_grad_updates`); the run stops
    (exit 2) when more than this many follow one another, since its gradients no longer recover, after
    logging and checkpointing that step. 0: stop at the first. Default 3: one batch whose backward
    overflows costs its update, not the run, while a run that diverged stops within a step or two, with
    its checkpoints' weights finite. Not checkpointed: a resume counts afresh. fp16 runs: megatron's loss
    scaler skips an overflowing update and lowers the scale; an overflow at its floor
    (`min_loss_scale`, 1) counts here."""

    def __post_init__(self) -> None:
        _positive_int("train", "steps", self.steps)
        _positive_int("train", "micro_batch_size", self.micro_batch_size)
        _positive_int("train", "mini_batches", self.mini_batches)
        _positive_int("train", "checkpoint_every", self.checkpoint_every)
        _positive_int("train", "keep_checkpoints", self.keep_checkpoints)
        _positive_int("train", "eval_every", self.eval_every, minimum=0)
        _positive_int("train", "eval_samples_per_prompt", self.eval_samples_per_prompt)
        _positive_int(
            "train", "max_nonfinite_updates_in_a_row", self.max_nonfinite_updates_in_a_row, minimum=0
        )
        if self.seq_len is not None:
            _positive_int("train", "seq_len", self.seq_len, minimum=2)
        if self.max_tokens_per_micro_batch is not None:
            _positive_int("train", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, minimum=2)
        if self.packed is not None and not isinstance(self.packed, bool):
            _bad("train", "packed", self.packed, "must be true, false or null")
        if not isinstance(self.allow_config_change, bool):
            _bad("train", "allow_config_change", self.allow_config_change, "must be true or false")
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
    """Seeds the data order, the rollout seeds and the trainer's RNGs; an integer in [0, 2^63)."""
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)

    def __post_init__(self) -> None:
        if not self.run_dir:
            _bad("run", "run_dir", self.run_dir, "must be a directory path")
        created = (("run_dir", self.run_dir), ("rollout.weight_sync.dir", self.rollout.weight_sync.dir))
        for key, path in created:
            # a path the run creates: before, `~/runs/x` made `./~/runs/x` without a word
            if path is not None and str(path).startswith("~"):
                raise UserError(
                    f"{key} {path!r} starts with `~`, which is not expanded here (a YAML value reaches the "
                    "run as written): write the full path"
                )
        # numpy refuses a negative seed; torch.manual_seed one of 2^64 or more (megatron adds offsets to it)
        if not 0 <= self.seed < 2**63:
            raise UserError(f"seed must be an integer in [0, 2^63); got {self.seed!r}")
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
        if self.rollout.env.name is not None and self.algorithm.overlong_buffer > 0:
            _bad(
                "algorithm",
                "overlong_buffer",
                self.algorithm.overlong_buffer,
                "must be 0 with rollout.env.name (the overlong penalty is for single-turn lengths)",
            )
        self._check_token_budget()
        dvp = self.algorithm.dvp
        if (
            self.rollout.deterministic
            and self.rollout.sampling.truncates
            and (dvp or self.rollout.sampling.min_p > 0)
        ):
            _bad(
                "rollout",
                "deterministic",
                True,
                f"cannot combine with min-p (rollout.sampling.min_p={self.rollout.sampling.min_p}, or DVP's "
                f"log_rho={self.algorithm.log_rho} sent as min-p with rollout.sampling.top_k/top_p): "
                "SGLang's seeded PyTorch sampler asserts against min-p "
                "(top_k_top_p_min_p_sampling_from_probs_torch)",
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
        if (
            self.algorithm.routing_replay == "r3"
            and self.rollout.partial_rollouts
            and self.rollout.pause_mode == "retract"
        ):
            _bad(
                "rollout",
                "pause_mode",
                "retract",
                "(retract unless set) cannot combine with algorithm.routing_replay=r3 and "
                "rollout.partial_rollouts: a retracted request is prefilled again under the new weights, "
                "which replaces the routes of the tokens the older weights sampled (SGLang's "
                "Req.reset_for_retract drops its routed_experts), so r3 would replay them on routes they "
                "were not sampled with; set rollout.pause_mode=abort (or in_place; to resume a run started "
                "so, with train.allow_config_change=true)",
            )
        if self.data.prompts_per_step % self.train.mini_batches:
            _bad(
                "train",
                "mini_batches",
                self.train.mini_batches,
                f"must divide data.prompts_per_step={self.data.prompts_per_step}",
            )

    def check_world(self, world_size: int) -> None:
        """UserError naming the values unless `world_size` takes the parallel layout
        (`ParallelSection.check_world`) and, with padded micro-batches, each mini-batch's samples split
        evenly over its DP ranks (`engine.batch.split_for_data_parallel`; packed ones balance any count).
        Before, that split failed with a ValueError after step 1's rollout."""
        self.parallel.check_world(world_size)
        dp = world_size // self.parallel.model_parallel
        per_mini_batch = self.data.prompts_per_step // self.train.mini_batches * self.algorithm.group_size
        if not self.train.is_packed and per_mini_batch % dp:
            raise UserError(
                "padded micro-batches (train.packed false, or no train.max_tokens_per_micro_batch) split "
                f"each mini-batch's samples evenly over the {dp} data-parallel ranks (world {world_size} / "
                f"{self.parallel.model_parallel} model-parallel), but data.prompts_per_step / "
                f"train.mini_batches × algorithm.group_size = {self.data.prompts_per_step} / "
                f"{self.train.mini_batches} × {self.algorithm.group_size} = {per_mini_batch} samples do not "
                "divide by it; change one of them, or pack (train.max_tokens_per_micro_batch)"
            )

    def _check_token_budget(self) -> None:
        """A packed micro-batch must hold the longest sample (padded to 2·CP under context parallelism), and
        split evenly over CP chunks and under sequence parallelism; a padded one's `seq_len`, where set,
        the longest sample."""
        budget = self.train.max_tokens_per_micro_batch
        cp = self.parallel.context_parallel
        if not self.train.is_packed and cp > 1:
            _bad(
                "parallel",
                "context_parallel",
                cp,
                "needs packed micro-batches (train.max_tokens_per_micro_batch; train.packed not false)",
            )
        if self.data.max_prompt_tokens is not None:
            self.check_longest_prompt(
                self.data.max_prompt_tokens, f"data.max_prompt_tokens={self.data.max_prompt_tokens}"
            )
        if not self.train.is_packed:
            return
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

    def check_longest_prompt(self, tokens: int, prompt: str, context: int | None = None) -> None:
        """UserError unless a micro-batch holds the longest sample, a prompt of `tokens` tokens (`prompt`
        says which, for the message) and the longest response, at most `context` tokens in all (the engines
        end an episode at the model's context): packed, the token budget, each sequence padded to
        `sequence_multiple`; padded, a row of `train.seq_len` (rounded up to `micro_batch_multiple`, as
        `engine.batch.make_micro_batches` rounds it), where set. Before, a padded layout's `seq_len` was
        found too short by the first step whose samples were longer, after its rollout."""
        packed = self.train.is_packed
        budget = self.train.max_tokens_per_micro_batch if packed else self.train.seq_len
        if budget is None:
            return
        response = self.rollout.max_response_tokens
        longest = tokens + response
        capped = context is not None and longest > context
        if capped:
            longest = context
        multiple = self.sequence_multiple if packed else 1
        padded = -(-longest // multiple) * multiple
        room = budget if packed else -(-budget // self.micro_batch_multiple) * self.micro_batch_multiple
        if room >= padded:
            return
        what = (
            f"rollout.max_new_tokens={response}"
            if self.rollout.env.name is None
            else f"the longest episode's response ({response}: rollout.env.max_turns × max_new_tokens + "
            "(max_turns − 1) × max_observation_tokens)"
        )
        total = f"the model's context, {context}" if capped else str(longest)
        _bad(
            "train",
            "max_tokens_per_micro_batch" if packed else "seq_len",
            budget,
            f"must hold the longest sample: {prompt} + {what} = {total}"
            + (f", padded to a multiple of 2·context_parallel = {padded}" if padded != longest else ""),
        )

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

    def overlong_shaping(self) -> OverlongShaping | None:
        """DAPO's overlong penalty as this run adds it to the task rewards (`algorithm.overlong_buffer` > 0),
        else None."""
        from megatron_tail.algorithms.overlong import OverlongShaping  # torch: not at config load

        a = self.algorithm
        if a.overlong_buffer <= 0:
            return None
        return OverlongShaping(self.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty)

    def warnings(self) -> list[str]:
        """Valid settings a user should still be told about at the start of a run, one line each."""
        out = []
        if self.algorithm.sampling_support == "ignore":
            out.append(
                "algorithm.sampling_support=ignore: samples drawn with rollout.sampling.top_k/top_p/min_p "
                "are scored over the full vocabulary, so every importance weight is biased by the mass the "
                "sampler cut (mismatch/outside_support_mass); an ablation that reproduces stacks without "
                "replay, not a setting to train with"
                + (
                    ""
                    if self.rollout.sampling.truncates
                    else " (no truncation is on: it changes nothing here)"
                )
            )
        if self.algorithm.old_logprobs == "engine":
            out.append(
                "algorithm.old_logprobs=engine: θ_old is the engine's log-probs, so PPO's ratio starts at "
                "π_train/π_infer and the importance weights are 1; an ablation"
            )
        if self.data.filter_reward == "shaped" and self.overlong_shaping() is None:
            out.append(
                "data.filter_reward=shaped: without overlong shaping (algorithm.overlong_buffer=0) the "
                "shaped rewards are the task rewards; it changes nothing"
            )
        a = self.algorithm
        if a.loss_max_len is not None and a.loss_aggregation != "seq_mean_token_sum":
            out.append(
                f"algorithm.loss_max_len={a.loss_max_len} is read only by loss_aggregation="
                f"seq_mean_token_sum; with {a.loss_aggregation} it changes nothing"
            )
        return out

    def check_runnable(self) -> None:
        """What a run needs beyond a valid config: the required paths. ValueError naming the key."""
        if not self.model.hf_path:
            _bad("model", "hf_path", self.model.hf_path, "is required (a HF checkpoint directory)")
        if not self.data.train_path:
            _bad("data", "train_path", self.data.train_path, "is required (a jsonl/json/parquet file)")

    def check_plugins(self) -> None:
        """The reward and the environment the config names (`data.reward`, `rollout.env.name`), imported by
        name: UserError naming the key and what failed."""
        from megatron_tail.rewards.registry import load_reward_fn
        from megatron_tail.rollout.envs.registry import load_env_class

        if self.rollout.env.name is not None:
            env = load_env_class(self.rollout.env.name)
            later = getattr(env, "enable_thinking", None)  # how a tool environment renders the later turns
            first = self.data.enable_thinking
            if first is not None and later is not None and first != later:
                raise UserError(
                    f"data.enable_thinking={str(first).lower()} renders each episode's first prompt, and "
                    f"rollout.env.name={self.rollout.env.name} renders its later turns with enable_thinking="
                    f"{str(later).lower()} (the class's): one episode would mix thinking and non-thinking "
                    "turns; set them alike"
                )
        load_reward_fn(self.data.reward)

    def check_inputs(self, *, host: bool = True) -> None:
        """`check_runnable`, and what the run reads on this machine, as far as it can be told without
        megatron-core (`train` calls this before importing it, so a user's mistake is one line, not one
        after megatron's start-up): what the settings need of this machine (CUDA for the Triton op or a
        CUDA local engine); that the run directory is writable; the environment and the reward, imported by
        name; the prompt files; the model directory (config.json, tokenizer, safetensors headers); and on
        global rank 0, which reads them, every prompt (`run_inputs.run_prompts`: each one fits the model's
        context and the token budget, named by file and line). UserError naming the key and the culprit."""
        self.check_runnable()
        from megatron_tail.data.prompts import check_prompt_file
        from megatron_tail.model.directory import check_model_dir
        from megatron_tail.model.layout import check_parallel_layout
        from megatron_tail.utils.errors import global_rank
        from megatron_tail.utils.paths import check_run_dir

        if host:  # else: on another machine than the run's (slurm/rl.sbatch's batch step, before the job)
            self.model.check_host()
            self.rollout.check_host()
        check_run_dir(self.run_dir)

        self.check_plugins()
        check_prompt_file(self.data.train_path, "data.train_path")
        if self.data.eval_path:
            check_prompt_file(self.data.eval_path, "data.eval_path")
        arch = check_model_dir(self.model.hf_path)
        p = self.parallel
        check_parallel_layout(
            arch,
            tensor_parallel=p.tensor_parallel,
            pipeline_parallel=p.pipeline_parallel,
            expert_parallel=p.expert_parallel,
            expert_tensor_parallel=p.expert_tensor_parallel,
        )
        # only rank 0 reads the prompts: the other ranks would hold a copy of the tokenized set for nothing
        if global_rank() == 0:
            from megatron_tail.config.run_inputs import run_prompts

            run_prompts(self)
