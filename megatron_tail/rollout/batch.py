"""`RolloutBatch`: one RL step's samples as the rollout side hands them to the trainer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass

from .columns import BUILTIN_COLUMNS, LOGPROBS, ROUTES, SUPPORT, TOP_LOGPROBS, VERSIONS, ColumnTable
from .columns.builtin import is_int_version


def _all_true(response: list[int]) -> list[bool]:
    return [True] * len(response)


def _unknown(_response: list[int]) -> None:
    return None


PER_SAMPLE = {"per_sample": True, "fill": None}
"""Field metadata of a `RolloutBatch` field with one entry per sample (a per-token field: one list or
`Ragged` per sample). Every stage that moves samples (`select_samples`, `concat_batches`, the checkpointed
buffers) moves all such fields by this declaration (per-token columns of the engine's live in `columns`).
Required (`default_factory=list`) or optional (default None: where a batch lacks it, a concatenation with
it lacks it too, as it cannot be made up). With a `fill(response_ids) -> entry` instead, a batch that lacks
it gets it made up per sample when concatenated with one that has it (`with_fill`)."""


def with_fill(fill) -> dict:
    """`PER_SAMPLE` with `fill`: a single-turn sample's policy mask is all True, an unknown ρ None."""
    return {**PER_SAMPLE, "fill": fill}


@dataclass(kw_only=True)
class RolloutBatch:
    """One step's samples, groups of `group_size` contiguous (prompt-major), identical on every rank.

    Per sample: `prompt_ids`, `response_ids`, `reward`, `truncated` (hit `max_new_tokens`), `weight_version`
    the engine reported, and its per-token `columns` (`rollout.columns`): column name → one entry per
    sample. The built-in ones (`columns.builtin`): `rollout_logprobs` (the engine's log π_infer^mp of each
    response token), where requested `rollout_top_logprobs` (the engine's log-prob of its most probable token
    at each position), `token_versions` (the weight version that sampled each response token: a partial
    rollout spans several; absent where an engine reported a non-integer version), with truncated sampling
    `sampling_support` (per sample a `Ragged` of `len(response)` rows, row j the token ids of the support
    the engine drew token j from; `rollout_logprobs` are then log-probs under that truncated distribution)
    and with routing replay `routed_experts` (per sample an integer tensor `[prompt + response − 1,
    num_hidden_layers, top_k]` of expert ids, row p the route of token p as a forward's input; the smallest
    integer dtype that holds the ids; a torch tensor, so a checkpointed buffer round-trips through
    `torch.save`/`torch.load(weights_only=True)`); and any column the run declared.
    `policy_mask` (multi-turn episodes, `rollout.env.name`; None for single-turn batches): per response token,
    True where the policy generated it, False for the environment's observation tokens (their log-probs are
    0.0 placeholders: they are context, never scored or trained).
    `sampled_log_rho` (None where unknown): per sample, the DVP log ρ the engine pruned with when it sampled
    the sample's first tokens (None: no pruning). With `algorithm.log_rho: auto` it can differ from the
    log ρ the trainer prunes with at the step that trains it (`log_rho_metrics`): a sample generated ahead
    (η ≥ 1) was sent under an earlier step's ρ. A partial rollout's later segments are sent under the ρ in
    force then; like its staleness, a sample counts as old as its oldest tokens.
    `stats`: rollout time and token counts. `metrics`: TensorBoard scalars of how the batch was drawn
    (dynamic sampling), logged with the step's. `data_cursor`: the prompt stream's position after this
    batch (dynamic sampling; None when prompts are a function of the step).
    """

    prompt_ids: list[list[int]] = field(default_factory=list, metadata=PER_SAMPLE)
    response_ids: list[list[int]] = field(default_factory=list, metadata=PER_SAMPLE)
    rewards: list[float] = field(default_factory=list, metadata=PER_SAMPLE)
    correct: list[bool] = field(default_factory=list, metadata=PER_SAMPLE)
    truncated: list[bool] = field(default_factory=list, metadata=PER_SAMPLE)
    weight_versions: list[str | None] = field(default_factory=list, metadata=PER_SAMPLE)
    policy_mask: list[list[bool]] | None = field(default=None, metadata=with_fill(_all_true))
    sampled_log_rho: list[float | None] | None = field(default=None, metadata=with_fill(_unknown))
    columns: dict[str, list] = field(default_factory=dict)
    """Per-token column name → one entry per sample (`rollout.columns`); every stage that moves samples
    moves each column alike (a column some batches of a concatenation lack is dropped)."""
    stats: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    data_cursor: int | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def column(self, name: str) -> list | None:
        """The entries of column `name`, one per sample, or None where the batch does not carry it."""
        return self.columns.get(name)

    def to_dict(self) -> dict:
        """`dataclasses.asdict(self)` for a checkpoint: without its deep copy of every per-token value (45 s
        for the 16M tokens of a step buffered ahead, by the host-time audit; the tensors are shared with the
        batch), and with each per-sample field and column of number lists packed into tensors
        (`utils.packed_rows`: `torch.load(weights_only=True)` read the lists back at ~1.5 µs an entry)."""
        from megatron_tail.utils.packed_rows import pack_rows

        state = _plain(self)
        for name in PER_SAMPLE_FIELDS:
            state[name] = pack_rows(state[name])
        state["columns"] = {name: pack_rows(entries) for name, entries in state["columns"].items()}
        return state

    @classmethod
    def from_dict(cls, state: dict, table: ColumnTable = BUILTIN_COLUMNS) -> RolloutBatch:
        """From `to_dict()` or `dataclasses.asdict(batch)` (a checkpoint's plain dicts, packed rows
        unpacked; each column's entries through its `restore`, `Ragged` supports included). A checkpoint of
        the layout before `columns` (one field per built-in column, declared ones in `token_fields`) is read
        into columns by the same names."""
        from megatron_tail.utils.packed_rows import unpack_rows

        state = {name: unpack_rows(value) for name, value in state.items()}
        columns = {name: unpack_rows(v) for name, v in (state.pop("columns", None) or {}).items()}
        for old, name in _FIELDS_BEFORE_COLUMNS.items():
            entries = state.pop(old, None)
            if entries is not None:
                columns[name] = entries
        declared = state.pop("token_fields", None)
        if declared is not None:
            for name in declared[0] if declared else ():
                columns[name] = [sample[name] for sample in declared]
        return cls(**state, columns=table.restore(columns))


def _plain(value):
    """What `dataclasses.asdict` makes of `value` (dataclasses → dicts of their fields, recursively), but
    sharing what it would copy: a list of plain values (a sample's tokens) and a tensor are the same
    objects."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        if all(map(_ATOMS.__contains__, map(type, value))):  # a C-level pass: ~15 ns a token
            return value
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        items = [_plain(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


_ATOMS = frozenset({int, float, str, bool, type(None)})
"""What `_plain` shares as is in a list (asdict copies each, to the same value)."""


_FIELDS_BEFORE_COLUMNS = {
    "rollout_logprobs": LOGPROBS,
    "rollout_top_logprobs": TOP_LOGPROBS,
    "rollout_supports": SUPPORT,
    "token_versions": VERSIONS,
    "routed_experts": ROUTES,
}
"""A checkpoint's fields of the layout before `columns` → their columns."""


PER_SAMPLE_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(RolloutBatch) if f.metadata.get("per_sample")
)
"""The fields of `RolloutBatch` with one entry per sample (`PER_SAMPLE`), besides `columns`."""
_FILL = {f.name: f.metadata["fill"] for f in fields(RolloutBatch) if f.metadata.get("per_sample")}


def select_samples(batch: RolloutBatch, rows: Sequence[int]) -> RolloutBatch:
    """The samples `rows` of `batch` (in that order), every per-sample field and column alike; stats,
    metrics and the data cursor kept."""
    picked = {
        name: None if (values := getattr(batch, name)) is None else [values[i] for i in rows]
        for name in PER_SAMPLE_FIELDS
    }
    columns = {name: [entries[i] for i in rows] for name, entries in batch.columns.items()}
    return RolloutBatch(
        **picked,
        columns=columns,
        stats=dict(batch.stats),
        metrics=dict(batch.metrics),
        data_cursor=batch.data_cursor,
    )


def select_groups(batch: RolloutBatch, groups: Sequence[int], group_size: int) -> RolloutBatch:
    """The groups `groups` (of `group_size` contiguous samples each) of `batch`, in that order."""
    return select_samples(batch, [g * group_size + j for g in groups for j in range(group_size)])


def concat_batches(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """The samples of `batches` in order, every per-sample field alike (`PER_SAMPLE`: a field some batches
    lack is filled where it has a `fill`, else dropped) and every column all of them carry; numeric stats
    summed (times, token and episode counts). Metrics and data cursor: not carried (they describe one
    batch's drawing)."""
    out = {}
    for name in PER_SAMPLE_FIELDS:
        parts = [getattr(b, name) for b in batches]
        fill = _FILL[name]
        if all(p is not None for p in parts):
            out[name] = [x for p in parts for x in p]
        elif fill is not None and any(p is not None for p in parts):
            out[name] = [
                x
                for b, p in zip(batches, parts, strict=True)
                for x in (p if p is not None else [fill(r) for r in b.response_ids])
            ]
        else:
            out[name] = None
    common = [n for n in batches[0].columns if all(n in b.columns for b in batches)] if batches else []
    columns = {n: [x for b in batches for x in b.columns[n]] for n in common}
    stats: dict[str, float] = {}
    for b in batches:
        for key, value in b.stats.items():
            stats[key] = stats.get(key, 0.0) + value
    return RolloutBatch(**out, columns=columns, stats=stats)


def rollout_metrics(batch: RolloutBatch, *, policy_version: int) -> dict[str, float]:
    """Reward, accuracy and response-length statistics of a step's samples, and `batch.metrics`.

    With episode counters in `batch.stats` (multi-turn, `episode_stats`), also `rollout/turns_mean`,
    `rollout/tool_calls_mean` (per episode), `rollout/tool_errors` (malformed or failed calls, total),
    `rollout/env_token_fraction` (share of response tokens that came from the environment: no loss) and
    `rollout/truncated_by_turns` (fraction of episodes that `rollout.env.max_turns` ended).
    `policy_version`: the weight version being trained (the step's θ_old). A sample's staleness is
    `policy_version` minus the version of its oldest token (`token_versions`; without them, of its reported
    `weight_version`, which is its last segment's, or an episode's first turn's). `rollout/stale_fraction`
    is the fraction of samples with a staleness above 0 (without an integer version: reported by another
    version than `policy_version`), so a partial rollout begun by an older version counts, as it does in
    `rollout/staleness_mean`;
    `rollout/staleness_mean` and `rollout/staleness_max` over samples (samples without an integer version
    are left out, and both are absent if none has one). With `token_versions`, also
    `rollout/partial_fraction` (samples whose tokens span more than one version: they crossed a weight
    update) and `rollout/versions_per_sample_mean`.
    With truncated sampling, `rollout/support_size_mean`: the mean support size per token the policy sampled
    (a multi-turn sample's observation tokens have none).
    """
    n = len(batch)
    if n == 0:
        return dict(batch.metrics)
    lags = _sample_lags(batch, policy_version)
    staleness = _staleness_metrics(batch, lags)
    stale = sum(
        lag > 0 if lag is not None else w != str(policy_version)
        for lag, w in zip(lags, batch.weight_versions, strict=True)
    )
    lengths = [len(r) for r in batch.response_ids]
    support = {}
    supports = batch.column(SUPPORT)
    if supports is not None:  # mean |support| over the policy's tokens (not observations')
        kept = sum(s.nnz for s in supports)
        sampled = sum(lengths) if batch.policy_mask is None else sum(sum(m) for m in batch.policy_mask)
        support["rollout/support_size_mean"] = kept / max(sampled, 1)
    mean_reward = sum(batch.rewards) / n
    return {
        "reward/mean": mean_reward,
        "reward/std": (sum((r - mean_reward) ** 2 for r in batch.rewards) / n) ** 0.5,
        "reward/accuracy": sum(batch.correct) / n,
        "response/length_mean": sum(lengths) / n,
        "response/length_max": float(max(lengths)),
        "response/truncated_fraction": sum(batch.truncated) / n,
        "rollout/stale_fraction": stale / n,
        **staleness,
        **support,
        **episode_metrics(batch.stats),
        **batch.metrics,
    }


def log_rho_metrics(batch: RolloutBatch, log_rho: float | None) -> dict[str, float]:
    """How far the log ρ the samples were drawn with is from `log_rho`, the one the trainer prunes with at
    the step that trains them (both the rule's log ρ, `AlgorithmConfig.rule_log_rho`):
    `rollout/sampled_log_rho_mean` (mean over the samples of `batch.sampled_log_rho`) and
    `rollout/log_rho_lag_max` (the largest |`log_rho` − a sample's|; 0 when every sample was drawn at the
    step's ρ). Empty when the trainer does not prune (`log_rho` None) or no sample knows its ρ."""
    sampled = [r for r in batch.sampled_log_rho or [] if r is not None]
    if log_rho is None or not sampled:
        return {}
    return {
        "rollout/sampled_log_rho_mean": sum(sampled) / len(sampled),
        "rollout/log_rho_lag_max": max(abs(log_rho - r) for r in sampled),
    }


def _sample_lags(batch: RolloutBatch, policy_version: int) -> list[int | None]:
    """Each sample's staleness: `policy_version` minus its oldest token's version (`token_versions`; a
    sample with no response tokens, or without them: its reported version); None without an integer one."""
    token_versions = batch.column(VERSIONS) or [()] * len(batch)
    lags: list[int | None] = []
    for versions, reported in zip(token_versions, batch.weight_versions, strict=True):
        if versions:
            lags.append(policy_version - min(versions))
        else:
            lags.append(policy_version - int(reported) if is_int_version(reported) else None)
    return lags


def _staleness_metrics(batch: RolloutBatch, lags: list[int | None]) -> dict[str, float]:
    token_versions = batch.column(VERSIONS)
    extra = {}
    if token_versions is not None:
        per_sample = [sorted(set(v)) for v in token_versions]
        extra = {
            "rollout/partial_fraction": sum(len(v) > 1 for v in per_sample) / len(per_sample),
            "rollout/versions_per_sample_mean": sum(max(len(v), 1) for v in per_sample) / len(per_sample),
        }
    lags = [lag for lag in lags if lag is not None]
    if not lags:
        return extra
    mean, worst = sum(lags) / len(lags), float(max(lags))
    return {"rollout/staleness_mean": mean, "rollout/staleness_max": worst, **extra}


EPISODE_COUNTERS = (
    "episodes",
    "turns",
    "tool_calls",
    "tool_errors",
    "env_tokens",
    "response_tokens",
    "truncated_by_turns",
    "observation_overflows",
)
"""Sums a multi-turn batch keeps in `RolloutBatch.stats` (summed again when batches are concatenated)."""


def episode_stats(episodes) -> dict[str, float]:
    """The `EPISODE_COUNTERS` of `envs.Episode`s."""
    return {
        "episodes": float(len(episodes)),
        "turns": float(sum(e.turns for e in episodes)),
        "tool_calls": float(sum(e.tool_calls for e in episodes)),
        "tool_errors": float(sum(e.tool_errors for e in episodes)),
        "env_tokens": float(sum(e.env_tokens for e in episodes)),
        "response_tokens": float(sum(len(e.response_ids) for e in episodes)),
        "truncated_by_turns": float(sum(e.truncated_by_turns for e in episodes)),
        "observation_overflows": float(sum(e.observation_overflow for e in episodes)),
    }


def episode_metrics(stats: dict[str, float]) -> dict[str, float]:
    """TensorBoard scalars of the episode counters in `stats` (none for a single-turn batch)."""
    n = stats.get("episodes", 0.0)
    if not n:
        return {}
    return {
        "rollout/turns_mean": stats["turns"] / n,
        "rollout/tool_calls_mean": stats["tool_calls"] / n,
        "rollout/tool_errors": stats["tool_errors"],
        "rollout/env_token_fraction": stats["env_tokens"] / max(stats["response_tokens"], 1.0),
        "rollout/truncated_by_turns": stats["truncated_by_turns"] / n,
        "rollout/observation_overflows": stats["observation_overflows"],
    }
