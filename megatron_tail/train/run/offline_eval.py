"""Offline evaluation of a checkpoint or an exported model on the config's eval set, exactly as the loop
evaluates (`RolloutService.evaluate`: pass@k, mean@n, greedy accuracy, same seeds).

    scalars = evaluate_offline(cfg, hf_dir="runs/x/rollout_weights")
    scalars = evaluate_offline(cfg, checkpoint="runs/x/checkpoints/step_000100")   # exported first

A checkpoint is loaded into a one-process trainer (TP = PP = 1: checkpoints reshard) and exported as a HF
checkpoint beside it (`<checkpoint>/hf`), which the engines then serve: the local engine loads it at start,
remote servers (`rollout.engine: remote`) load it from disk as weight version "eval". A checkpoint never
changes, so its export is made once and reused by later evaluations (delete `<checkpoint>/hf` to export
again), under a lock: evaluations of one checkpoint started together export it once, and none replaces
an export another one's engine is loading.

The results go to `<checkpoint or model dir>/eval/<eval file stem>-<hash of its path>/` (`eval.json`, the
engine's `logs/`; `results_dir`), or `--out`: one directory per eval set, outside the export, so
evaluating on another set, or a failed evaluation, loses none.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

from megatron_tail.config import RunConfig
from megatron_tail.utils.errors import UserError

EVAL_WEIGHT_VERSION = "eval"


def evaluate_offline(
    cfg: RunConfig,
    *,
    hf_dir: str | Path | None = None,
    checkpoint: str | Path | None = None,
    out_dir: str | Path | None = None,
) -> dict[str, float]:
    """Exactly one of `hf_dir` / `checkpoint`; `cfg.data.eval_path` must be set. Returns the `eval/*`
    scalars and writes them to `<out_dir>/eval.json`, the local engine's log to `<out_dir>/logs/` (default
    `results_dir`: under the model or checkpoint directory, so a read-only one needs `out_dir`)."""
    from megatron_tail.config.run_inputs import load_eval_examples

    from ..engine.checkpoint import check_checkpoint
    from .session import load_tokenizer

    check_inputs(cfg, hf_dir=hf_dir, checkpoint=checkpoint, out_dir=out_dir)
    if checkpoint is not None:  # its files, before anything reads them (the log ρ of `auto`)
        check_checkpoint(Path(checkpoint))
    if cfg.algorithm.adaptive_rho:
        cfg = with_checkpoint_log_rho(cfg, Path(checkpoint))
    # the prompts before a checkpoint's export (minutes for a large model): a bad row is said first; the
    # export copies its tokenizer from model.hf_path, so both tokenize alike
    tokenizer = load_tokenizer(str(hf_dir if hf_dir is not None else cfg.model.hf_path))
    examples = load_eval_examples(cfg.data, tokenizer)
    model_dir = Path(hf_dir) if hf_dir is not None else export_checkpoint(cfg, Path(checkpoint))
    out = results_dir(cfg, hf_dir=hf_dir, checkpoint=checkpoint, out_dir=out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the engines load the HF directory itself: from disk, whatever the run's `rollout.weight_sync.mode`
    served = replace(
        cfg,
        model=replace(cfg.model, hf_path=str(model_dir)),
        rollout=replace(cfg.rollout, weight_sync=replace(cfg.rollout.weight_sync, mode="disk")),
    )
    scalars = _evaluate(served, model_dir, out, tokenizer, examples)
    (out / "eval.json").write_text(json.dumps(scalars, indent=2, sort_keys=True))
    return scalars


def results_dir(
    cfg: RunConfig,
    *,
    hf_dir: str | Path | None = None,
    checkpoint: str | Path | None = None,
    out_dir: str | Path | None = None,
) -> Path:
    """Where an evaluation writes `eval.json` and the engine's logs: `out_dir`, else
    `<checkpoint or hf_dir>/eval/<stem of data.eval_path>-<8 hex digits of its absolute path's SHA-1>` (two
    eval sets both named test.jsonl do not share one)."""
    if out_dir is not None:
        return Path(out_dir)
    eval_path = Path(cfg.data.eval_path)
    digest = hashlib.sha1(str(eval_path.absolute()).encode()).hexdigest()[:8]
    return Path(checkpoint if checkpoint is not None else hf_dir) / "eval" / f"{eval_path.stem}-{digest}"


def check_inputs(
    cfg: RunConfig,
    *,
    hf_dir: str | Path | None = None,
    checkpoint: str | Path | None = None,
    out_dir: str | Path | None = None,
) -> None:
    """What `evaluate_offline` needs that can be told without torch or megatron-core (`megatron-tail eval`
    checks it before importing them): exactly one model, an eval set that is a prompt file, the reward and
    environment it names, a model directory that is one (with a checkpoint: `model.hf_path`'s config and
    tokenizer, which the export copies), and somewhere writable for the results (`--out`, else the model
    directory; a checkpoint's export writes `<checkpoint>/hf`). UserError naming the bad input."""
    from megatron_tail.data.prompts import check_prompt_file
    from megatron_tail.model.directory import check_model_dir
    from megatron_tail.utils.paths import unwritable_reason

    if (hf_dir is None) == (checkpoint is None):
        raise UserError(
            f"evaluate_offline needs exactly one of hf_dir, checkpoint; got {hf_dir=}, {checkpoint=}"
        )
    if cfg.data.eval_path is None:
        raise UserError("data.eval_path is required to evaluate (a jsonl/json/parquet file of prompts)")
    check_prompt_file(cfg.data.eval_path, "data.eval_path")
    cfg.check_plugins()
    if checkpoint is not None and not Path(checkpoint).is_dir():
        what = "is not a directory" if Path(checkpoint).exists() else "does not exist"
        raise UserError(f"--checkpoint {checkpoint} {what} (a run's checkpoints/step_NNNNNN directory)")
    if checkpoint is not None and not (Path(checkpoint) / "metadata.json").is_file():
        raise UserError(f"--checkpoint {checkpoint} is not a complete checkpoint (no metadata.json)")
    if hf_dir is not None:
        check_model_dir(hf_dir, key="--hf")
    elif not cfg.model.hf_path:
        raise UserError(
            "model.hf_path is required with --checkpoint: its export takes the base model's config.json and "
            "tokenizer from there"
        )
    else:
        check_model_dir(cfg.model.hf_path, weights=False)  # the weights come from the checkpoint
    _refuse_a_live_runs_servers(cfg)
    if cfg.algorithm.adaptive_rho and hf_dir is not None:
        raise UserError(
            f"algorithm.log_rho: auto has no value for {hf_dir} (an exported model keeps no log ρ): evaluate "
            "its run's --checkpoint, which keeps the log ρ the run had reached, or pass --set "
            "algorithm.log_rho=<number> (the run logs dvp/log_rho every step)"
        )
    if out_dir is not None and Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise UserError(
            f"--out {out_dir} is a file; a directory for eval.json and the engine's logs is expected"
        )
    # a checkpoint's export (<checkpoint>/hf), then the results (--out, else the model directory)
    writes = [("--checkpoint (its export, hf/)", checkpoint)] if checkpoint is not None else []
    if checkpoint is not None and exported(checkpoint):  # reused: only the results are written
        writes = [] if out_dir is not None else [("--checkpoint (no --out)", checkpoint)]
    if out_dir is not None:
        writes.append(("--out", out_dir))
    elif hf_dir is not None:
        writes.append(("--hf (no --out)", hf_dir))
    for flag, where in writes:
        reason = unwritable_reason(where)
        if reason is not None:
            raise UserError(
                f"{flag} {where}: the evaluation writes there (eval.json, the engine's logs): {reason}"
                + ("; pass --out DIR" if flag.startswith("--hf") else "")
            )


def _refuse_a_live_runs_servers(cfg: RunConfig) -> None:
    """UserError where the evaluation's remote servers are those of a trainer running now in `run_dir` (its
    lock held; its config.yaml names them): loading the model to evaluate into them would change the
    policy that run samples from, mid-run (the natural mistake: evaluating a checkpoint with the run's own
    config.yaml while it trains)."""
    from megatron_tail.config import load_config

    from .run_dir import CONFIG_NAME
    from .run_dir_lock import live_holder

    if cfg.rollout.engine != "remote" or (holder := live_holder(cfg.run_dir)) is None:
        return
    try:
        running = load_config(Path(cfg.run_dir) / CONFIG_NAME).rollout.server_urls
    except Exception:  # no config there, or one this version does not read: nothing to compare
        return
    if shared := sorted(set(cfg.rollout.server_urls) & set(running)):
        raise UserError(
            f"rollout.server_urls {', '.join(shared)} serve the run in {cfg.run_dir}, which a trainer is "
            f"running now ({holder}): evaluating there would load this model into its servers mid-run. "
            "Start servers for the evaluation and pass --set rollout.server_urls=..., or evaluate on the "
            "local engine (--set rollout.engine=local)"
        )


def with_checkpoint_log_rho(cfg: RunConfig, checkpoint: Path) -> RunConfig:
    """`cfg` (`algorithm.log_rho: auto`) at the log ρ the run had reached when it saved `checkpoint` (its
    `rl_state`, `RunSession.rl_state`): the ρ its next step would have sampled with. UserError where the
    checkpoint keeps none (its run had a fixed log ρ)."""
    from ..engine.checkpoint import read_checkpoint_meta
    from .session import with_log_rho

    log_rho = read_checkpoint_meta(checkpoint)["rl_state"].get("log_rho")
    if log_rho is None:
        raise UserError(
            f"algorithm.log_rho: auto, but checkpoint {checkpoint} keeps no log ρ (its run had a fixed one): "
            "pass --set algorithm.log_rho=<number>, the run's"
        )
    return with_log_rho(cfg, float(log_rho))


def export_checkpoint(cfg: RunConfig, checkpoint: Path, note=print) -> Path:
    """`<checkpoint>/hf`: `checkpoint` loaded into a TP = PP = 1 trainer on this process and exported there,
    or the export an earlier evaluation made (module docstring), under `<checkpoint>/.hf.lock`."""
    out = checkpoint / "hf"
    if not exported(checkpoint):  # else read without the lock: a checkpoint others may not write to
        with export_lock(checkpoint, note):
            if not exported(checkpoint):  # another evaluation may have finished it while this one waited
                _export(cfg, checkpoint, out)
                return out
    note(
        f"eval: reusing {out}, this checkpoint's export by an earlier evaluation (delete it to export again)"
    )
    return out


def exported(checkpoint: Path) -> bool:
    """Whether `<checkpoint>/hf` holds a finished export (`export_hf` renames a finished directory into
    place)."""
    return (Path(checkpoint) / "hf" / "config.json").is_file()


@contextlib.contextmanager
def export_lock(checkpoint: Path, note=print):
    """Hold a POSIX record lock on `<checkpoint>/.hf.lock` (`run_dir_lock`'s kind: NFS and Lustre lock it
    across nodes; the kernel drops it when its holder dies). A wait for another holder is said first."""
    from .run_dir_lock import try_lock

    path = checkpoint / EXPORT_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not try_lock(fd, path):
            note(
                f"eval: waiting for another evaluation of {checkpoint} to finish its export "
                f"({path} is locked)"
            )
            fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


EXPORT_LOCK = ".hf.lock"


def _export(cfg: RunConfig, checkpoint: Path, out: Path) -> None:
    import torch.distributed as dist

    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import export_hf, load_hf_config

    from ..engine.checkpoint import load_weights
    from ..engine.parallel import init_parallel
    from ..engine.setup import build_model
    from .loop import init_torch_distributed

    if init_torch_distributed() != 1:
        raise UserError(f"offline evaluation runs in one process; the world has {dist.get_world_size()}")
    init_parallel(ParallelSection(tensor_parallel=1, pipeline_parallel=1), seed=cfg.seed)
    # the model alone: a trainer's optimizer (float32 copies, grad buffers) would not fit one GPU beside
    # the weights of a model that does (a 14B's 28 GB of bf16 weights, ~5x that as a trainer)
    arch = load_hf_config(cfg.model.hf_path)
    model = build_model(arch, cfg.model)
    load_weights(checkpoint, [model], arch, cfg.model, tp_size=1)
    export_hf([model], out, arch, copy_files_from=cfg.model.hf_path)


def _evaluate(cfg: RunConfig, model_dir: Path, out: Path, tokenizer, examples) -> dict[str, float]:
    from megatron_tail.model.directory import check_model_dir
    from megatron_tail.rollout.weight_sync import HFDirectory

    from .rollout_plan import start_rollout

    check_model_dir(model_dir, key="the model to evaluate")
    engines = start_rollout(cfg, out, tokenizer)
    try:
        engines.wait_ready()
        if cfg.rollout.engine != "local":
            engines.sync_weights(HFDirectory(model_dir), EVAL_WEIGHT_VERSION)
        return engines.evaluate([e.prompt_ids for e in examples], [e.answer for e in examples])
    finally:
        engines.close()
