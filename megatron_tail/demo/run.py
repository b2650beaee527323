"""The demo driver: cache (pretrained model + data) → `megatron-tail train` under torchrun → summary."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_tail.demo.defaults import DATA_DIR_NAME, DEMO_CONFIG_YAML, PRETRAIN_DIR_NAME

# read_scalars is re-exported: tests and tools read runs with `demo.run.read_scalars`
from megatron_tail.demo.scalars import fmt as _fmt
from megatron_tail.demo.scalars import read_scalars, summarise, uses_environment
from megatron_tail.train.run.supervise import StopRelay, TrainingOutcome
from megatron_tail.utils.errors import UserError, signal_name

DEMO_MAX_DIGITS = 2
TOOL_PRETRAIN = {
    "tool_prob": 0.5,
    "steps": 150,
    "batch_size": 48,
    "num_examples": 8000,
    "lr": 5e-3,
    "warmup": 20,
}
"""The calculator demo's pretraining (`PretrainSettings`): half the examples call the tool, half answer
directly; after these 150 steps greedy decoding calls the tool with the right expression (checked on CPU:
11 minutes on 2 heavily shared cores)."""
DEMO_DATA = {"train": (2000, 1234), "heldout": (200, 5678)}
"""name → (number of problems, seed) of the demo's prompt files; the evaluation's ("heldout") holds no
training prompt (`make_held_out_examples`; its file's name changed with that, so a cache from before makes
it anew)."""

COMPARE_VARIANTS: dict[str, list[str]] = {
    "naive": ["algorithm.log_rho=null", "algorithm.is_mode=none", "algorithm.veto_threshold=0"],
    "dvp_mis": ["algorithm.log_rho=-13", "algorithm.is_mode=mis", "algorithm.veto_threshold=1e-4"],
    # fp16 trainer and engine, no other remedy: the simplest known fix for the mismatch
    "fp16": [
        "model.precision=fp16",
        "rollout.dtype=float16",
        "algorithm.log_rho=null",
        "algorithm.is_mode=none",
        "algorithm.veto_threshold=0",
    ],
    # FP8 rollouts (e4m3 linear layers, SGLang's scheme) against the bf16 baseline of "naive", remedied by
    # DVP + MIS with the veto, as FP8 users should run them
    "fp8_dvp_mis": [
        "rollout.quantization=fp8",
        "algorithm.log_rho=-13",
        "algorithm.is_mode=mis",
        "algorithm.veto_threshold=1e-4",
    ],
}
"""--compare: the same seed, data and steps; only the stability knobs (and the rollout precision) differ."""

CALCULATOR_OVERRIDES = [
    "rollout.max_new_tokens=20",  # a call turn is 15-17 tokens (`TOOL_TOKENS`), an answer 2-4
    "rollout.env.max_observation_tokens=24",  # a tool response is 14-16; 6 + 3 × 20 + 2 × 24 ≤ 128 positions
    "data.prompts_per_step=16",
    "data.eval_prompts=64",
    "train.eval_every=5",
    "train.steps=20",
]
"""With `rollout.env.name` set (`--set rollout.env.name=calculator`): the tool demo's lengths and a shorter
run (its episodes are ~5× the tokens of the plain demo's answers); the user's own `--set`s come after and
win."""


# (tag, how to summarise it over the steps, label)
STABILITY_ROWS: list[tuple[str, str, str]] = [
    ("eval/sampled_accuracy", "last", "eval accuracy, sampled (last)"),
    ("eval/greedy_accuracy", "last", "eval accuracy, greedy (last)"),
    ("reward/accuracy", "last5", "sampled accuracy (last 5 steps)"),
    ("mismatch/kl_infer_train_k3", "mean", "KL(π_infer‖π_train), k3 (mean)"),
    ("mismatch/kl_infer_train_k3", "max", "KL(π_infer‖π_train), k3 (max)"),
    ("mismatch/abs_delta/p0.5_1", "mean", "mean |Δ|, π ≥ 0.5 (head)"),
    ("mismatch/abs_delta/p0.01_0.5", "mean", "mean |Δ|, π ∈ [0.01, 0.5)"),
    ("mismatch/abs_delta/p0.0001_0.01", "mean", "mean |Δ|, π ∈ [1e-4, 0.01)"),
    ("mismatch/abs_delta/p0_0.0001", "mean", "mean |Δ|, π < 1e-4 (tail)"),
    ("mismatch/tail_signed_delta", "mean", "Δ = log π_infer − log π_train, tail by π_train (mean)"),
    ("mismatch/tail_signed_delta_by_infer", "mean", "Δ, tail by π_infer (mean; Prop. 4.3: both > 0)"),
    ("mismatch/tail_tokens", "sum", "sampled tail tokens (total)"),
    ("is/weight_max", "max", "IS weight (max)"),
    ("is/zero_weight_fraction", "mean", "tokens with IS weight 0 (mean)"),
    ("is/vetoed_fraction", "mean", "vetoed sequences (mean)"),
    ("train/clip_fraction", "mean", "PPO clip fraction (mean)"),
    ("train/grad_norm", "max", "gradient norm (max)"),
    ("policy/entropy", "last", "policy entropy (last)"),
    ("dvp/safe_set_size_mean", "mean", "safe-set size |V_S| (mean)"),
    ("dvp/safe_mass_min", "min", "min safe mass Z_min (Prop. 5.5)"),
    ("dvp/bias_bound", "max", "bias bound R·T·(1 − Z_min) (max)"),
    ("train/loss_scale", "min", "fp16 loss scale (min)"),
    ("train/skipped_updates", "sum", "skipped optimizer steps (total)"),
]


_YOURS = "`megatron-tail train` takes yours"
DEMO_OWNED_KEYS = {
    "run_dir": "choose it with --run-dir",
    "model.hf_path": f"the demo trains its own pretrained model (--cache-dir); {_YOURS}",
    "data.train_path": f"the demo trains on its own data (--cache-dir); {_YOURS}",
    "data.eval_path": f"the demo evaluates on its own data (--cache-dir); {_YOURS}",
}
"""`--set` keys the demo sets itself (`config.arguments.refuse_owned_overrides`)."""


def run_demo(
    *,
    run_dir: str,
    cache_dir: str,
    overrides: Sequence[str] = (),
    compare: bool = False,
    fresh: bool = False,
    moe: bool = False,
) -> int:
    """`moe`: the tiny Qwen3-MoE demo (`demo.moe_compare`): r3 alone, or none / r2 / r3 under `compare`."""
    from megatron_tail.config.arguments import refuse_owned_overrides
    from megatron_tail.demo import moe_compare

    refuse_owned_overrides(overrides, DEMO_OWNED_KEYS, "demo")
    started = time.monotonic()
    cache = Path(cache_dir)
    tools = uses_environment(overrides)
    if moe and (refusal := moe_compare.moe_refusals(overrides)):
        _say(refusal)
        return 2
    if tools:
        overrides = [*CALCULATOR_OVERRIDES, *overrides]
    if moe:
        overrides = [*moe_compare.MOE_OVERRIDES, *overrides]
        variants = moe_compare.MOE_COMPARE_VARIANTS if compare else moe_compare.MOE_SINGLE
    else:
        variants = COMPARE_VARIANTS if compare else {"": []}
    from megatron_tail.config.loader import config_from_yaml

    for knobs in variants.values():  # a typo in --set: one line now, not after minutes of pretraining
        config_from_yaml(DEMO_CONFIG_YAML, [*knobs, *overrides])
    from megatron_tail.utils.paths import unwritable_reason

    for flag, where in (("--run-dir", run_dir), ("--cache-dir", cache_dir)):  # the demo writes both
        if (reason := unwritable_reason(where)) is not None:
            raise UserError(f"{flag} {where}: a writable directory is expected; {reason}")
    from megatron_tail.demo.pretrain import PretrainStopped, StopRequests

    with StopRequests() as stop:  # from here: a stop while the model is made or checked is heard too
        try:
            model_dir = ensure_moe_pretrained(cache) if moe else ensure_pretrained(cache, tools=tools)
        except PretrainStopped as stopped:
            _say(f"{stopped}: rerun the demo to continue")
            return 128 + int(stopped.sig)
    if stop.received is not None:
        _say(f"{stop.received.name}: stopped before training (the pretrained model is saved)")
        return 128 + int(stop.received)
    train_file, test_file = ensure_data(cache)
    base = [
        f"model.hf_path={model_dir}",
        f"data.train_path={train_file}",
        f"data.eval_path={test_file}",
    ]
    dirs = {}
    for name, knobs in variants.items():
        target = Path(run_dir) / name if name else Path(run_dir)
        if target.exists() and (fresh or finished_run(target, [*base, *knobs, *overrides])):
            shutil.rmtree(target)  # a finished demo run starts over; a stopped one resumes
        label = f" [{name}]" if name else ""
        _say(f"\n== RL{label}: {target}  (SIGTERM to the trainers stops after the step; rerun resumes)")
        outcome = launch_training(target, [*base, f"run_dir={target}", *knobs, *overrides])
        if (code := training_failed(outcome, label)) is not None:
            return code
        if not finished_run(target, [*base, *knobs, *overrides]):  # its ranks were stopped, not this process
            _say(f"training{label} stopped before its last step (its ranks were signalled); rerun to resume")
            return 0
        dirs[name or "run"] = target
    for name, target in dirs.items():
        _print_accuracy(name, target)
    if compare and moe:
        moe_compare.print_moe_comparison(dirs, say=_say)
    elif compare:
        print_comparison(dirs)
        _say(f"report, figures of the compared runs: {_write_report(list(dirs.values()))}")
    for name, target in dirs.items():
        _say(f"TensorBoard logs ({name}): {(target / 'tensorboard').resolve()}")
    _say(f"  view with: tensorboard --logdir {Path(run_dir).resolve()}")
    _say(f"demo finished in {time.monotonic() - started:.0f} s")
    return 0


def _write_report(run_dirs: list[Path]) -> Path:
    """`megatron-tail report` on the compared runs: <run_dir>/report/report.md, runs labelled by the config
    keys they differ in."""
    from megatron_tail.report.build import write_report

    return write_report(run_dirs, say=_say).resolve()


def finished_run(run_dir: Path, overrides: Sequence[str], *, base_yaml: str = DEMO_CONFIG_YAML) -> bool:
    """The run in `run_dir` has a checkpoint at its last step."""
    from megatron_tail.config.loader import config_from_yaml
    from megatron_tail.train.run.run_dir import latest_checkpoint

    latest = latest_checkpoint(run_dir)
    if latest is None:
        return False
    return latest[0] >= config_from_yaml(base_yaml, overrides).train.steps


def reusable_run(run_dir: Path, overrides: Sequence[str], *, base_yaml: str = DEMO_CONFIG_YAML) -> bool:
    """`finished_run` (or diverged: `run_dir.diverged_at`), and trained with this config: a finished run
    whose last checkpoint holds another config in what it trains (`config_change`'s "trained" keys: another
    level, model or learning rate) is a `UserError` naming the keys. An experiment reused any finished run
    under the same directory name, so a table could report runs of another config under this one's title."""
    from megatron_tail.config.loader import config_from_yaml
    from megatron_tail.train.run.config_change import config_changes, read_checkpoint_config
    from megatron_tail.train.run.run_dir import diverged_at, latest_checkpoint
    from megatron_tail.utils.errors import UserError

    # a run that diverged ended as it would end again (rerun as is, it resumes into the same divergence)
    if not finished_run(run_dir, overrides, base_yaml=base_yaml) and diverged_at(run_dir) is None:
        return False
    cfg = config_from_yaml(base_yaml, overrides)
    latest = latest_checkpoint(run_dir)
    if latest is None:  # a divergence marker without the checkpoint it was written after (removed by hand)
        return False
    saved = read_checkpoint_config(latest[1])
    changed = [] if saved is None else [c for c in config_changes(saved, cfg) if c.kind == "trained"]
    if changed:
        raise UserError(
            f"{run_dir} holds a finished run trained with another config (its checkpoint → now): "
            f"{'; '.join(map(str, changed))}; give this experiment another --out, or remove {run_dir}"
        )
    return True


def ensure_pretrained(cache: Path, *, tools: bool = False) -> Path:
    """The pretrained tiny Qwen3 in `cache` (trained now, reproducibly, if absent or pretrained with other
    settings). `tools`: the calculator demo's model, whose pretraining also calls the tool
    (`PretrainSettings.tool_prob`), in its own directory."""
    from megatron_tail.demo.pretrain import PretrainSettings, pretrain

    model_dir = cache / (PRETRAIN_DIR_NAME + ("_calculator" if tools else ""))
    summary_file = model_dir / "pretrain.json"
    settings = PretrainSettings(**TOOL_PRETRAIN) if tools else PretrainSettings()
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        if summary.get("settings") == _settings_dict(settings):
            accuracy = summary.get("greedy_accuracy", 0.0)
            _say(f"pretrained tiny Qwen3: {model_dir} (greedy accuracy {accuracy:.3f})")
            return model_dir
    _, test_file = ensure_data(cache)
    rows = [json.loads(line) for line in test_file.read_text().splitlines() if line.strip()]
    what = "toy addition, half of it calling the calculator" if tools else "toy addition"
    _say(f"pretraining the tiny Qwen3 on {what} ({settings.steps} steps, one-off) → {model_dir}")
    summary = pretrain(model_dir, settings, eval_rows=rows, log=_say)
    direct = " (answering directly, without the tool)" if tools else ""
    _say(f"  greedy accuracy after pretraining{direct}: {summary['greedy_accuracy']:.3f}")
    return model_dir


def ensure_moe_pretrained(cache: Path) -> Path:
    """The MoE demo's pretrained tiny Qwen3-MoE in `cache` (`demo.moe_compare.MOE_PRETRAIN`, trained now if
    absent or pretrained with other settings); prints its bf16-vs-fp32 routing agreement on test prompts."""
    from megatron_tail.demo.moe import CLOSE_GAP, MoePretrainSettings, load_routing_stats
    from megatron_tail.demo.moe_compare import MOE_PRETRAIN, MOE_PRETRAIN_DIR_NAME
    from megatron_tail.demo.pretrain import pretrain

    model_dir = cache / MOE_PRETRAIN_DIR_NAME
    summary_file = model_dir / "pretrain.json"
    settings = MoePretrainSettings(**MOE_PRETRAIN)
    _, test_file = ensure_data(cache)
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    if summary.get("settings") != _settings_dict(settings):
        rows = [json.loads(line) for line in test_file.read_text().splitlines() if line.strip()]
        _say(f"pretraining the tiny Qwen3-MoE on toy addition ({settings.steps} steps, one-off): {model_dir}")
        summary = pretrain(model_dir, settings, eval_rows=rows, log=_say)
    if "routing" not in summary:
        summary["routing"] = load_routing_stats(model_dir, test_file)
        summary_file.write_text(json.dumps(summary, indent=2))
    r = summary["routing"]
    _say(
        f"pretrained tiny Qwen3-MoE: {model_dir} (greedy accuracy {summary['greedy_accuracy']:.3f}; routing "
        f"bf16 vs fp32 agrees on {r['agreement']:.4f} of {r['pairs']} (token, layer); router-logit gap "
        f"k-th to (k+1)-th: median {r['median_gap']:.3f}, {r['close_fraction']:.3f} of them < {CLOSE_GAP})"
    )
    return model_dir


def ensure_data(cache: Path) -> tuple[Path, Path]:
    """The demo's prompt files (train, test) in `cache`: additions of 1–2-digit numbers, written by the data
    package's generator with fixed seeds (`DEMO_DATA`)."""
    from megatron_tail.data.toy_arithmetic import (
        make_arithmetic_examples,
        make_held_out_examples,
        write_jsonl,
    )

    data = cache / DATA_DIR_NAME
    (n_train, train_seed), (n_test, test_seed) = DEMO_DATA["train"], DEMO_DATA["heldout"]
    train = make_arithmetic_examples(n_train, max_digits=DEMO_MAX_DIGITS, seed=train_seed)
    test = make_held_out_examples(n_test, max_digits=DEMO_MAX_DIGITS, seed=test_seed, train=train)
    paths = []
    for name, rows in (("train", train), ("heldout", test)):
        path = data / f"toy_addition_{name}.jsonl"
        if not path.is_file():
            data.mkdir(parents=True, exist_ok=True)
            write_jsonl(rows, path)
        paths.append(path)
    return paths[0], paths[1]


def launch_training(
    run_dir: Path,
    overrides: Sequence[str],
    *,
    base_yaml: str = DEMO_CONFIG_YAML,
    quiet: bool = False,
    relay: StopRelay | None = None,
) -> TrainingOutcome:
    """`megatron-tail train` on `base_yaml` with `overrides`, under our torchrun wrapper on as many local
    ranks as the layout needs (`ParallelSection.min_world_size`: TP × PP × CP and the experts'
    ETP × EP × PP), through `supervise.run_training`: a stop signal to this process stops the run after its
    step, with a checkpoint; `quiet` sends its output to `<run_dir>/train.log` instead of the console;
    `relay`: the stop-signal relay of runs at once (`supervise.run_at_once`)."""
    from megatron_tail.config import load_config, save_resolved_config
    from megatron_tail.train.run.supervise import run_training

    run_dir.mkdir(parents=True, exist_ok=True)
    base = run_dir / "demo_base.yaml"
    base.write_text(base_yaml)
    cfg = load_config(base, overrides)
    cfg.check_inputs()
    resolved = save_resolved_config(cfg, run_dir)
    torchrun = ["--standalone", f"--nproc-per-node={cfg.parallel.min_world_size}"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore",  # megatron's and torch's import-time warnings would bury the step lines
    }
    if not quiet:
        return run_training(torchrun, resolved, env=env, say=_say, relay=relay)
    with open(run_dir / "train.log", "ab") as log:
        return run_training(torchrun, resolved, env=env, stdout=log, say=_say, relay=relay)


def training_failed(outcome: TrainingOutcome, label: str = "") -> int | None:
    """None when the run finished; else the exit code to end with, having said why (`label` names the run):
    after a stop signal, the run's code, or 128 + the signal's number where the run checkpointed and exited
    0 (as a shell reports a command a signal ended: the demo did not finish); a failure's own code, without
    a second line where the run already printed its one line (`ONE_LINE_CODES`)."""
    from megatron_tail.train.run.torchrun import ONE_LINE_CODES

    if outcome.stopped_by is not None:
        how = "saved a checkpoint" if outcome.code == 0 else f"exited with code {outcome.code}"
        _say(f"training{label} stopped on {outcome.stopped_by.name} and {how}; rerun the command to resume")
        return outcome.code if outcome.code != 0 else 128 + int(outcome.stopped_by)
    if outcome.code == 0:
        return None
    if outcome.code < 0:  # the launcher itself died; its ranks stop as on SIGTERM (`launch_marks`)
        _say(
            f"the training{label} launcher was killed by {signal_name(-outcome.code)}; its ranks stop after "
            "their current step and save a checkpoint (rerun the command to resume)"
        )
        return 128 - outcome.code
    if outcome.code not in ONE_LINE_CODES:
        _say(f"training{label} failed with exit code {outcome.code}")
    return outcome.code


def print_comparison(dirs: dict[str, Path]) -> None:
    scalars = {name: read_scalars(path) for name, path in dirs.items()}
    names = list(dirs)
    width = max(len(label) for _, _, label in STABILITY_ROWS) + 2
    _say("\n== stability, same seed: " + " vs ".join(names))
    _say("".ljust(width) + "".join(n.rjust(14) for n in names))
    for tag, how, label in STABILITY_ROWS:
        cells = []
        for name in names:
            series = [v for _, v in scalars[name].get(tag, [])]
            cells.append(_fmt(summarise(series, how)).rjust(14))
        _say(label.ljust(width) + "".join(cells))


def _print_accuracy(name: str, run_dir: Path) -> None:
    scalars = read_scalars(run_dir)
    for kind in ("sampled", "greedy"):
        series = scalars.get(f"eval/{kind}_accuracy", [])
        if series:
            trail = "  ".join(f"{s}: {v:.2f}" for s, v in series)
            _say(f"eval accuracy, {kind} ({name}) by step: {trail}")


def _settings_dict(settings) -> dict:
    from dataclasses import asdict

    return asdict(settings)


def _say(text: str) -> None:
    print(text, flush=True)
