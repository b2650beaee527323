"""README.md and the docs pages split from it stay true to the code: every `megatron-tail` sub-command they
write exists in the CLI parser, with every `--flag` written after it; every dotted config key they name
(`rollout.max_staleness`) is a key of the schema; every relative link, and its `#anchor`, resolves; every
`make` target and `python -m megatron_tail...` module exists; and the README's config reference names the
modules that define each section. Each checker is also run on a made-up sample, so each can fail."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from functools import cache
from pathlib import Path

import pytest

from megatron_tail.cli import build_parser
from megatron_tail.config.loader import all_keys
from megatron_tail.config.schema import RunConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = (
    "README.md",
    "docs/features.md",
    "docs/rollouts.md",
    "docs/design.md",
    "docs/operations.md",
    "docs/experiments.md",
    "docs/benchmarks.md",
)
"""The README and the docs pages that hold what it used to (issue 54): checked in full."""

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`]+)`")
_COMMAND = re.compile(r"(?:megatron-tail|-m megatron_tail\.cli)[ \t]+([a-z][\w-]*)(.*)", re.S)
_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
_COMMENT = re.compile(r"\s#")
_KEY = re.compile(r"(?<![\w./<>-])([A-Za-z_]\w*(?:\.\w+)+)(?![\w(/-])")
_FILE_SUFFIX = re.compile(r"\.(py|md|yaml|yml|json|jsonl|sh|sbatch|txt|toml|parquet|log|png)$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_MAKE = re.compile(r"(?<![\w-])make[ \t]+([a-z][\w-]*)")
_MODULE = re.compile(r"python -m (megatron_tail(?:\.\w+)+)")


def _read(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


def code_spans(text: str) -> list[str]:
    """The code a Markdown text writes: each logical line of a fenced block (backslash continuations
    joined), then each inline `code` span outside the fences (it may run over a line break)."""
    spans = []
    for block in _FENCE.findall(text):
        spans.extend(block.replace("\\\n", " ").splitlines())
    spans.extend(_INLINE.findall(_FENCE.sub("", text)))
    return spans


@cache
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def commands(text: str) -> list[tuple[str, str]]:
    """(sub-command, what follows it on its line) for each `megatron-tail SUB ...` (or `python -m
    megatron_tail.cli SUB ...`) in the text's code, up to a shell comment or the next command."""
    found = []
    for span in code_spans(text):
        for part in re.split(r"(?=megatron-tail[ \t]|-m megatron_tail\.cli[ \t])", span):
            m = _COMMAND.match(part)
            if m:
                found.append((m.group(1), _COMMENT.split(m.group(2), maxsplit=1)[0]))
    return found


def cli_problems(text: str) -> list[str]:
    """Sub-commands the parser lacks, flags their sub-command lacks, and a first word that is not one of a
    positional's choices (`experiment NAME`)."""
    problems = []
    for sub, rest in commands(text):
        parser = _subcommands().get(sub)
        if parser is None:
            problems.append(f"megatron-tail {sub}: no such sub-command (have {sorted(_subcommands())})")
            continue
        options = {opt for action in parser._actions for opt in action.option_strings}
        problems += [
            f"megatron-tail {sub} {flag}: no such option"
            for flag in _FLAG.findall(rest)
            if flag not in options
        ]
        positionals = [a for a in parser._actions if not a.option_strings and a.choices]
        first = rest.split()[0] if rest.split() else ""
        if positionals and re.fullmatch(r"[a-z][\w-]*", first) and first not in positionals[0].choices:
            problems.append(f"megatron-tail {sub} {first}: not one of {sorted(positionals[0].choices)}")
    return problems


@cache
def _sections() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(RunConfig))


def config_keys(text: str) -> list[str]:
    """Every dotted name in the text whose first part is a top-level name of `RunConfig`, such as
    `algorithm.log_rho`; not file names (`rollout/manager.py`, `train.py`), module paths
    (`megatron_tail.ops.safe_vocab`) or calls (`optimizer.step()`)."""
    found = []
    for m in _KEY.finditer(text):
        name = m.group(1)
        if name.split(".")[0] in _sections() and not _FILE_SUFFIX.search(name):
            found.append(name)
    return found


def key_problems(text: str) -> list[str]:
    """Dotted names in `text` that are neither a config key nor a section of keys (`rollout.sampling`)."""
    keys = set(all_keys())
    sections = {key.rsplit(".", n)[0] for key in keys for n in range(1, key.count("."))}
    return sorted({key for key in config_keys(text) if key not in keys | sections})


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, heading in _HEADING.findall(_FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(path: Path) -> list[str]:
    """Relative links of a Markdown file (outside code) whose file, or whose `#anchor` in a Markdown file,
    does not exist."""
    text = _INLINE.sub("code", _FENCE.sub("", path.read_text(encoding="utf-8")))
    problems = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{path.name}: {target}: no heading with that anchor")
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_commands_exist(page):
    assert cli_problems(_read(page)) == []


def test_readme_names_the_commands_a_user_runs():
    named = {sub for sub, _ in commands(_read("README.md"))}
    assert {"train", "plan", "demo", "eval", "report"} <= named


def test_cli_check_catches_a_wrong_command_or_flag():
    assert cli_problems("`megatron-tail plan CONFIG.yaml --nodes 2 --json`") == []
    assert (
        cli_problems("```bash\nmegatron-tail train C.yaml \\\n    --print-config  # --not-a-flag\n```") == []
    )
    assert cli_problems("`megatron-tail trian CONFIG.yaml`")
    assert cli_problems("`megatron-tail plan CONFIG.yaml --nodez 2`")
    assert cli_problems("```bash\nmegatron-tail train C.yaml \\\n    --print-confg\n```")
    assert cli_problems("`torchrun --nproc-per-node 2 -m megatron_tail.cli train C.yaml --sett a.b=1`")
    assert cli_problems("`megatron-tail experiment tail-mismatch --seeds 0`") == []
    assert cli_problems("`megatron-tail experiment tail-mismatches`")


@pytest.mark.parametrize("page", PAGES)
def test_config_keys_exist(page):
    assert key_problems(_read(page)) == []


def test_readme_names_config_keys():
    assert {"algorithm.log_rho", "rollout.max_staleness"} <= set(config_keys(_read("docs/features.md")))
    assert "algorithm.log_rho" in config_keys(_read("README.md"))


def test_key_check_catches_a_made_up_key_and_skips_paths():
    sample = (
        "`algorithm.log_rho`, `rollout.max_staleness: 1`, --set train.steps=5, the `rollout` section; "
        "`rollout/manager.py`, `megatron_tail.ops.safe_vocab`, `train.run.torchrun` in "
        "`python -m megatron_tail.train.run.torchrun`, `optimizer.step()`, `train.py`, e.g. this."
    )
    assert config_keys(sample) == [
        "algorithm.log_rho",
        "rollout.max_staleness",
        "train.steps",
        "train.run.torchrun",
    ]
    assert key_problems(sample) == ["train.run.torchrun"]
    assert key_problems("the `rollout.sampling` section, `cluster.sglang`, `rollout.samplin`") == [
        "rollout.samplin"
    ]
    assert key_problems("`algorithm.log_rhoo` and `model.bf16` (moved to model.precision)") == [
        "algorithm.log_rhoo",
        "model.bf16",
    ]


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    assert link_problems(ROOT / page) == []


def test_link_check_catches_a_missing_file_or_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Exit codes: 0–5\n\n```\n# not a heading\n```\n")
    good = tmp_path / "good.md"
    good.write_text(
        "# Top\n[a](other.md) [b](other.md#exit-codes-05) [c](#top) [d](https://example.com) "
        "`[e](nowhere.md)`\n"
    )
    assert link_problems(good) == []
    bad = tmp_path / "bad.md"
    bad.write_text("[a](missing.md) [b](other.md#not-a-heading) [c](#nowhere)\n```\n[d](x.md)\n```\n")
    assert len(link_problems(bad)) == 3


@pytest.mark.parametrize("page", PAGES)
def test_make_targets_and_modules_exist(page):
    targets = set(re.findall(r"^([a-z][\w-]*):", _read("Makefile"), re.M))
    spans = code_spans(_read(page))
    named = {m for span in spans for m in _MAKE.findall(span)}
    assert named <= targets, f"make targets the Makefile lacks: {sorted(named - targets)}"
    modules = {m for span in spans for m in _MODULE.findall(span)}
    missing = [
        m
        for m in modules
        if not (ROOT / (m.replace(".", "/") + ".py")).is_file()
        and not (ROOT / m.replace(".", "/") / "__init__.py").is_file()
    ]
    assert missing == []


def test_readme_make_check_can_fail():
    assert _MAKE.findall("`make demo`, `make gpu-wheels GPU_PYTHON_VERSION=3.12`") == ["demo", "gpu-wheels"]
    assert {"demo", "test"} <= {m for s in code_spans(_read("README.md")) for m in _MAKE.findall(s)}


def _defining_files(cls: type) -> set[str]:
    """The modules of a settings class and of the settings classes it extends, relative to the root."""
    return {
        Path(inspect.getsourcefile(c)).resolve().relative_to(ROOT).as_posix()
        for c in cls.__mro__
        if dataclasses.is_dataclass(c)
    }


def reference_problems(text: str) -> list[str]:
    """The README's "config reference" table: each row's sections must be defined in exactly the files the
    row names (a section that is a dataclass: its class and the settings classes it extends; a top-level
    key: `RunConfig`'s module)."""
    hints = typing.get_type_hints(RunConfig)
    rows = re.findall(r"^\| (`[^|]*) \| (`[^|]*`) \|$", text, re.M)
    problems = []
    covered = set()
    for names, files in rows:
        named_files = set(re.findall(r"`([^`]+\.py)`", files))
        for name in re.findall(r"`(\w+)`", names):
            covered.add(name)
            cls = hints.get(name)
            if cls is None:
                problems.append(f"{name}: not a top-level name of RunConfig")
                continue
            owner = _defining_files(cls) if dataclasses.is_dataclass(cls) else _defining_files(RunConfig)
            if owner != named_files:
                problems.append(f"{name}: defined in {sorted(owner)}, the table says {sorted(named_files)}")
    missing = _sections() - covered
    if missing:
        problems.append(f"sections the table leaves out: {sorted(missing)}")
    return problems


def test_config_reference_names_where_each_section_is_defined():
    assert reference_problems(_read("README.md")) == []
    wrong = (
        "| `rollout` | `megatron_tail/config/schema.py` |\n| `seedz` | `megatron_tail/config/schema.py` |\n"
    )
    problems = reference_problems(wrong)
    assert any(p.startswith("rollout: defined in") for p in problems)
    assert any(p.startswith("seedz:") for p in problems)
    assert any(p.startswith("sections the table leaves out") for p in problems)
