"""`megatron-tail train CONFIG.yaml [--set section.key=value ...]`: the RL loop on this process's rank.

Launch one process per rank with torchrun (`torchrun --nproc-per-node 2 -m megatron_tail.cli train
CONFIG.yaml`; `python -m megatron_tail.train.run.torchrun ...` takes the same arguments and exits 0 when a
signal stopped the workers cleanly), or run it plainly for a world of one. Exit codes: 0 also after a
graceful stop (SIGTERM / SIGUSR1 / SIGINT / SIGHUP / SIGQUIT / SIGUSR2, or the launcher's death: the step
finishes, a checkpoint is written; rerunning resumes at the next step); 2 a user error (one line naming it;
MT_TRACEBACK=1 shows the traceback); 3 a step abandoned on a second stop signal (the last checkpoint is kept);
4 an outside failure (one line naming it, e.g. an engine killed by a signal, with its log; the last
checkpoint is kept); 5 another rank died (the launcher names it; the last checkpoint is kept); 1 an
internal error (traceback).
"""

from __future__ import annotations

import argparse

from megatron_tail.config.arguments import add_config_arguments


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="run (or resume) RL training from a YAML config; launch with torchrun for several ranks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser, required=True)
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config (YAML) and exit"
    )
    parser.set_defaults(func=train_command)
    return parser


def train_command(args: argparse.Namespace) -> int:
    from megatron_tail.config import config_yaml, load_config
    from megatron_tail.utils.start_up import collector_paused

    with collector_paused():
        cfg = load_config(args.config, args.overrides)  # a UserError: one line (megatron_tail.cli.main)
        if not args.print_config:
            cfg.check_inputs()
        if args.print_config:
            print(config_yaml(cfg), end="")
            return 0
        import torch.distributed as dist

        from megatron_tail.patches import import_megatron_deferring_compile

        import_megatron_deferring_compile()  # before the trainer imports it (patches/lazy_compile.py: why)
        from megatron_tail.train.run import launch_marks
        from megatron_tail.train.run.loop import LoopHooks, run

        if cfg.rollout.engine == "local" and cfg.rollout.local.in_process:  # the session would, collector on
            import megatron_tail.rollout.local_engine.engine
            import megatron_tail.rollout.local_engine.server  # noqa: F401

    launch_marks.watch_launcher()  # a launcher that dies (kill -9) stops this worker as a SIGTERM would
    launch_marks.mark_worker("started")
    try:
        run(cfg, LoopHooks(keep_history=False))  # TensorBoard holds them; a long run's list only grows
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    launch_marks.mark_worker("done")  # finished or stopped cleanly: after a signal the launcher exits 0
    launch_marks.forget_marks_of_dead_launcher()
    return 0


EVAL_DESCRIPTION = """`megatron-tail eval CONFIG.yaml (--checkpoint DIR | --hf DIR) [--set ...]`: evaluate a
training checkpoint or an exported HF model on `data.eval_path` exactly as the loop does:
`train.eval_samples_per_prompt` samples per prompt at the rollout temperature (pass@k, mean@n) plus greedy
decoding, with the config's reward, engines and DVP rule. A checkpoint is loaded in this one process
(TP = PP = 1) and exported to `<checkpoint>/hf` first (once: later evaluations reuse that export). Prints the
scalars and writes them to `<checkpoint or model dir>/eval/<eval file stem>-<hash of its path>/eval.json` (or
`--out DIR`), one directory per eval set, beside the engine's logs.
"""


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a checkpoint or HF model on the eval set (pass@k, mean@n, greedy accuracy)",
        description=EVAL_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser, required=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a checkpoint directory (<run_dir>/checkpoints/step_NNNNNN)")
    which.add_argument("--hf", help="a HF model directory (e.g. <run_dir>/rollout_weights)")
    parser.add_argument(
        "--out",
        help="where eval.json and the engine log go "
        "(default: <checkpoint or model dir>/eval/<stem of data.eval_path>-<hash>)",
    )
    parser.set_defaults(func=eval_command)
    return parser


def eval_command(args: argparse.Namespace) -> int:
    from megatron_tail.config import load_config
    from megatron_tail.utils.start_up import collector_paused

    with collector_paused():
        cfg = load_config(args.config, args.overrides)
        from megatron_tail.train.run.offline_eval import check_inputs

        # a user's mistake before the imports
        check_inputs(cfg, hf_dir=args.hf, checkpoint=args.checkpoint, out_dir=args.out)
        import torch.distributed as dist

        from megatron_tail.patches import import_megatron_deferring_compile

        import_megatron_deferring_compile()
        from megatron_tail.train.run.offline_eval import evaluate_offline

    try:
        scalars = evaluate_offline(cfg, hf_dir=args.hf, checkpoint=args.checkpoint, out_dir=args.out)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    width = max(len(k) for k in scalars)
    for key in sorted(scalars):
        print(f"{key.ljust(width)}  {scalars[key]:.4f}")
    return 0
