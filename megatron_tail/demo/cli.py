"""`megatron-tail demo [--compare]`: the embedded default run on CPU.

1. pretrain a tiny Qwen3 on toy addition if the cache lacks it (reproducible, one-off, ~1-2 min);
2. RL with `megatron-tail train` under torchrun: TP = 2 over gloo, fp32 trainer, bf16 local engine,
   GRPO + DVP + MIS/veto; greedy eval accuracy is printed as it rises, with the TensorBoard path;
3. `--compare`: the same seed four times, naive (no DVP, no IS), DVP + MIS, fp16 on both sides (no other
   remedy), and FP8 rollouts with DVP + MIS (`rollout.quantization=fp8`), their stability metrics side by
   side, and a report with figures of the four runs.

`--moe`: a tiny Qwen3-MoE (8 experts, top-2, pretrained the same way in its own cache directory) with
routing replay r3 (the engine's routes replayed by the trainer); `--moe --compare`: routing replay none, r2
and r3 from the same seed, routing agreement, mismatch KL, grad norm and reward side by side.

`--set rollout.env.name=calculator --set rollout.env.max_turns=3`: multi-turn episodes with the calculator
tool. The tiny model is pretrained (once, in its own cache directory) on transcripts that call the tool in
Qwen3's format half of the time; RL rewards the right final answer, which the tool's reply makes easy.
"""

from __future__ import annotations

import argparse

from megatron_tail.config.arguments import add_overrides_argument

DEFAULT_RUN_DIR = "runs/demo"
DEFAULT_MOE_RUN_DIR = "runs/demo_moe"
DEFAULT_CACHE_DIR = "runs/demo_cache"


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="the CPU demo: pretrain a tiny Qwen3 if needed, then RL on toy addition (TP=2, gloo)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run naive, DVP+MIS, fp16 and FP8 rollouts + DVP+MIS from the same seed; compare stability",
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="a tiny Qwen3-MoE (8 experts, top-2) with routing replay r3; with --compare: none vs r2 vs r3",
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        help=f"(default {DEFAULT_RUN_DIR}, with --moe {DEFAULT_MOE_RUN_DIR})",
    )
    parser.add_argument(
        "--cache-dir",
        default=DEFAULT_CACHE_DIR,
        help=f"pretrained model and data, reused across runs (default {DEFAULT_CACHE_DIR})",
    )
    add_overrides_argument(parser, "override the demo config, e.g. --set train.steps=10")
    parser.add_argument(
        "--fresh", action="store_true", help="delete the run directory first instead of resuming it"
    )
    parser.set_defaults(func=demo_command)
    return parser


def demo_command(args: argparse.Namespace) -> int:
    from megatron_tail.demo.run import run_demo

    default = DEFAULT_MOE_RUN_DIR if args.moe else DEFAULT_RUN_DIR
    return run_demo(
        run_dir=args.run_dir or default,
        cache_dir=args.cache_dir,
        overrides=args.overrides,
        compare=args.compare,
        fresh=args.fresh,
        moe=args.moe,
    )
