"""The examples' memory headers are the planner's output: build, check and (`--write`) rewrite them.

Each `examples/qwen3_*.yaml` carries, between `# Memory plan` and the first YAML key, the table that
`megatron-tail plan` prints for it on the layout of its own `cluster:` section (the one its launch line
starts), with the model's config.json from `tests/plan/configs/`.

    python -m tests.plan.example_headers --write    # after changing the planner or an example
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("qwen3_*.yaml"))
MODEL_CONFIGS = {
    "Qwen3-8B": "qwen3_8b",
    "Qwen3-14B": "qwen3_14b",
    "Qwen3-30B-A3B": "qwen3_30b_a3b",
    "Qwen3-235B-A22B": "qwen3_235b_a22b",
}
START = "# Memory plan"


def model_override(text: str) -> str:
    name = re.search(r"hf_path: models/(\S+)", text).group(1)
    return f"model.hf_path={ROOT / 'tests/plan/configs' / MODEL_CONFIGS[name]}"


def expected_header(path: Path) -> str:
    import argparse

    from megatron_tail.config import load_config
    from megatron_tail.plan.cli import add_plan_parser, cluster_from_args
    from megatron_tail.plan.planner import make_plan
    from megatron_tail.plan.report import format_plan

    text = path.read_text()
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", str(path)])
    config = load_config(path, [model_override(text)])
    plan = make_plan(config, cluster_from_args(args, config.cluster))
    lines = [
        f"{START} (`megatron-tail plan examples/{path.name}`; it reads only the model's config.json;",
        "# tests/plan/test_example_headers.py keeps this block equal to its output). GiB = 2^30 bytes:",
        *(f"#   {ln}" for ln in format_plan(plan).splitlines()),
    ]
    return "\n".join(lines) + "\n"


def current_header(text: str) -> str:
    """The block from `# Memory plan` to the line before the first YAML key."""
    start = text.index(START)
    end = re.search(r"^\w", text[start:], flags=re.M).start() + start
    return text[start:end]


def write(path: Path) -> None:
    text = path.read_text()
    old = current_header(text)
    path.write_text(text.replace(old, expected_header(path)))


if __name__ == "__main__":
    if "--write" in sys.argv:
        for example in EXAMPLES:
            write(example)
            print(f"wrote {example.relative_to(ROOT)}")
