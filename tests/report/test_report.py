"""`megatron-tail report` on the events of real tiny runs (2 RL steps each, two configs that differ in
`algorithm.is_mode`): every figure is a non-blank PNG that report.md embeds, the runs are labelled by their
config difference, and missing tags are reported instead of crashing. The tail-Δ histogram figure is also
drawn from histograms written here, so its code path runs whatever the trainer logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_tail.config import load_config
from megatron_tail.report.build import write_report
from megatron_tail.report.events import load_run
from megatron_tail.report.figures import FIGURES, tail_delta_figure
from megatron_tail.report.histograms import summed_histogram
from megatron_tail.report.labels import run_labels
from megatron_tail.utils.errors import EXIT_USER_ERROR
from tests.harness import run_distributed
from tests.loop.conftest import loop_overrides, serving

FIGURE_NAMES = [
    "reward_accuracy",
    "grad_norm",
    "mismatch_buckets",
    "mismatch_kl",
    "tail_delta",
    "safe_mass",
    "is_veto_masks",
    "safe_set_size",
    "truncation",
]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run_rank(rank, world, overrides):  # noqa: ARG001
    from megatron_tail.train.run.loop import run

    run(load_config(None, overrides))


@pytest.fixture(scope="module")
def run_dirs(tiny_model_dir, prompt_file, tmp_path_factory):
    """Two finished 2-step runs on one engine (TP = 1, one rank), eval at start and after each step."""
    root = tmp_path_factory.mktemp("report_runs")
    dirs = []
    with serving(tiny_model_dir, root / "engine_logs") as engine:
        for mode in ("none", "mis"):
            run_dir = root / f"is_{mode}"
            extra = {
                "rollout.engine": "remote",
                "rollout.server_urls": f"[{engine.url}]",
                "parallel.tensor_parallel": 1,
                "algorithm.is_mode": mode,
                "data.eval_path": prompt_file,
                "data.eval_prompts": 4,
                "train.eval_every": 1,
                "train.steps": 2,
            }
            run_distributed(
                _run_rank, 1, loop_overrides(tiny_model_dir, prompt_file, run_dir, extra), timeout=300
            )
            dirs.append(run_dir)
    return dirs


def _assert_png_not_blank(path):
    import matplotlib.image

    assert path.is_file() and path.stat().st_size > 0, path
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100, (path, pixels.shape)
    assert float(pixels[..., :3].std()) > 0.01, f"{path} is blank"


def test_report_of_two_real_runs(run_dirs, tmp_path):
    out = tmp_path / "report"
    report = write_report(run_dirs, out_dir=out)
    assert report == out / "report.md"
    text = report.read_text()
    for name in FIGURE_NAMES:
        _assert_png_not_blank(out / f"{name}.png")
        assert f"]({name}.png)" in text, name  # embedded with a relative link
    assert len(FIGURES) == len(FIGURE_NAMES) + 1  # + the early-warning figure, drawn for collapsed runs only
    # every figure has some data in a real run; these short runs do not collapse, so the early warning is
    # skipped and says why
    assert text.count("Skipped") == 1 and "Skipped: no run collapsed" in text
    assert "early_warning.png" not in text
    # the runs are labelled by the one config key they differ in (run_dir never counts)
    assert "algorithm.is_mode=none" in text and "algorithm.is_mode=mis" in text
    assert "run_dir=" not in text
    # the summary table has a row per run for the key scalars
    assert text.count("| `reward/mean` |") == 1 and "| `train/grad_norm` |" in text


def test_events_of_a_real_run(run_dirs):
    run = load_run(run_dirs[1])
    assert run.config["algorithm"]["is_mode"] == "mis"
    steps, values = run.scalars["reward/mean"]
    assert steps.tolist() == [1, 2] and values.dtype == np.float64 and np.isfinite(values).all()
    assert run.scalars["eval/greedy_accuracy"][0].tolist() == [0, 1, 2]
    assert any(tag.startswith("mismatch/abs_delta/p") for tag in run.scalars)
    for tag, hists in run.histograms.items():  # the trainer's tail-Δ histograms, where it logs them
        assert [step for step, _, _ in hists] == [1, 2][: len(hists)], tag
        for _, limits, counts in hists:
            assert limits.shape == counts.shape and counts.sum() > 0


def test_default_out_dir_and_labels_override(run_dirs, figures_not_rendered):
    report = write_report(run_dirs, labels=["naive", "mis"])
    assert figures_not_rendered and {p.parent for p in figures_not_rendered} == {report.parent}
    assert report == run_dirs[0].parent / "report" / "report.md"  # the runs' common parent
    text = report.read_text()
    assert "| naive |" in text and "| mis |" in text and "algorithm.is_mode" not in text
    with pytest.raises(ValueError, match="one label per run"):
        write_report(run_dirs, labels=["only one"])
    single = write_report(run_dirs[:1])
    assert single == run_dirs[0] / "report" / "report.md"
    assert f"| {run_dirs[0].name} |" in single.read_text()  # one run: labelled by its directory name


def test_missing_tags_are_reported_not_fatal(tmp_path):
    """A run that logged only a reward: the other figures are skipped and report.md names their tags."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "scalars_only"
    writer = SummaryWriter(str(run_dir / "tensorboard"))
    for step in (1, 2, 3):
        writer.add_scalar("reward/mean", 0.1 * step, step)
    writer.close()
    report = write_report([run_dir], out_dir=tmp_path / "out")
    text = report.read_text()
    _assert_png_not_blank(tmp_path / "out" / "reward_accuracy.png")
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["reward_accuracy.png"]
    assert "Not logged by any run (left out): `reward/accuracy`" in text
    assert "Skipped: no run logged any of its tags: `train/grad_norm`, `train/grad_norm_max`." in text
    assert "`mismatch/abs_delta/<label>`" in text  # bucket families are named once, as a pattern
    assert "`mismatch/tail_delta`" in text
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        write_report([tmp_path / "does_not_exist"])


def test_tail_delta_figure_from_written_histograms(tmp_path):
    """Histograms in the trainer's layout (upper limits: underflow, the `TAIL_DELTA_EDGES` bins, overflow
    written as twice the last edge): summed over steps; the figure is drawn with each run's mode."""
    from torch.utils.tensorboard import SummaryWriter

    from megatron_tail.train.rl.diagnostics import TAIL_DELTA_EDGES

    limits = [*TAIL_DELTA_EDGES, 2 * TAIL_DELTA_EDGES[-1]]
    rng = np.random.default_rng(0)
    for name, shift in (("a", 0.3), ("b", -0.2)):
        writer = SummaryWriter(str(tmp_path / name / "tensorboard"))
        for step in (1, 2, 3):
            for tag in ("mismatch/tail_delta", "mismatch/tail_delta_by_infer"):
                x = rng.normal(shift, 0.2, 500)
                counts = np.bincount(np.searchsorted(limits[:-1], x, side="right"), minlength=len(limits))
                writer.add_histogram_raw(
                    tag, min=float(x.min()), max=float(x.max()), num=500, sum=float(x.sum()),
                    sum_squares=float((x * x).sum()), bucket_limits=limits, bucket_counts=counts.tolist(),
                    global_step=step,
                )  # fmt: skip
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump({"run_dir": name, "seed": ord(name)}))
        writer.close()
    runs = [load_run(tmp_path / n) for n in ("a", "b")]
    edges, counts = summed_histogram(runs[0].histograms["mismatch/tail_delta"])
    assert counts.sum() == 3 * 500 and edges.shape == (counts.size + 1,)
    centre = (edges[np.argmax(counts)] + edges[np.argmax(counts) + 1]) / 2
    assert abs(centre - 0.3) < 0.2  # the mode sits at the shift
    labels = run_labels([r.config for r in runs], ["a", "b"])
    assert labels == ["seed=97", "seed=98"]
    result = tail_delta_figure(runs, labels, tmp_path)
    assert result.path == tmp_path / "tail_delta.png"
    _assert_png_not_blank(result.path)
    # histograms only: the scalar panels' tags are the missing ones
    assert result.missing == [
        "mismatch/tail_signed_delta",
        "mismatch/tail_signed_delta_by_infer",
        "mismatch/tail_delta_mode",
        "mismatch/tail_delta_mode_by_infer",
    ]


def test_labels_from_config_differences():
    configs = [
        {"run_dir": "/a", "algorithm": {"is_mode": "mis", "log_rho": -13.0}, "seed": 1},
        {"run_dir": "/b", "algorithm": {"is_mode": "none", "log_rho": None}, "seed": 1},
    ]
    assert run_labels(configs, ["a", "b"]) == [
        "algorithm.is_mode=mis, algorithm.log_rho=-13.0",
        "algorithm.is_mode=none, algorithm.log_rho=null",
    ]
    same = [{"run_dir": "/a", "seed": 1}, {"run_dir": "/b", "seed": 1}]
    assert run_labels(same, ["a", "b"]) == ["a", "b"]  # only the run directory differs
    assert run_labels(configs[:1], ["only"]) == ["only"]
    three = [*configs, {**configs[0], "run_dir": "/c"}]  # two equal configs: names keep them apart
    assert run_labels(three, ["a", "b", "c"])[0].startswith("a: algorithm.is_mode=mis")


def test_a_run_of_the_flat_rollout_section_labels_under_the_new_keys():
    """A run directory written before the rollout section had its parts (`rollout.top_k`,
    `rollout.local_port`) beside a new one: the same settings are not a difference, the others are named as
    a user sets them now, and the engine's port is still one a run picks for itself."""
    old = {"run_dir": "/a", "rollout": {"top_k": 20, "local_port": 5000, "weight_sync": "disk"}}
    new = {"run_dir": "/b", "rollout": {"sampling": {"top_k": 40}, "local": {"port": 6000}}}
    new["rollout"]["weight_sync"] = {"mode": "disk"}
    assert run_labels([old, new], ["a", "b"]) == ["rollout.sampling.top_k=20", "rollout.sampling.top_k=40"]


def test_cli_writes_the_report(run_dirs, tmp_path, capsys, figures_not_rendered):
    from megatron_tail.cli import main

    out = tmp_path / "cli_out"
    assert main(["report", *map(str, run_dirs), "--out", str(out), "--labels", "A", "B"]) == 0
    assert f"report: {(out / 'report.md').resolve()}" in capsys.readouterr().out
    assert "| A |" in (out / "report.md").read_text()
    assert figures_not_rendered and all(p.parent == out for p in figures_not_rendered)


def test_cli_refusals_are_one_line(tmp_path, capsys):
    """Before: `--out` naming a file gave a FileExistsError traceback, `--labels` of the wrong count printed
    its message without `megatron-tail report: error:`, a directory without events exited 0 with an
    empty report, and one beside a run with events was left out of the report without a word."""
    from torch.utils.tensorboard import SummaryWriter

    from megatron_tail.cli import main

    run_dir, empty, a_file = tmp_path / "run", tmp_path / "empty", tmp_path / "out.txt"
    writer = SummaryWriter(str(run_dir / "tensorboard"))
    writer.add_scalar("reward/mean", 0.5, 1)
    writer.close()
    empty.mkdir()
    a_file.write_text("x")
    refusals = [
        (
            ["--out", str(a_file)],
            f"output directory '{a_file}' is a file; expected a directory (--out) for the figures and "
            "report.md",
        ),
        (
            [str(run_dir), "--labels", "A"],
            "--labels: got 1 labels for 2 run directories; give one label per run directory, in order",
        ),
    ]
    for extra, message in refusals:
        assert main(["report", str(run_dir), *extra]) == EXIT_USER_ERROR
        assert capsys.readouterr().err == f"megatron-tail report: error: {message}\n"
    assert main(["report", str(empty)]) == EXIT_USER_ERROR
    assert capsys.readouterr().err == (
        f"megatron-tail report: error: no run found: no TensorBoard events in {empty / 'tensorboard'}; each "
        "RUN_DIR must be the run_dir of a `megatron-tail train` run that has logged a step\n"
    )
    assert list(empty.iterdir()) == []  # no empty report written
    # one run with events and one without: before, a report of the first alone (exit 0)
    assert main(["report", str(run_dir), str(empty)]) == EXIT_USER_ERROR
    assert capsys.readouterr().err == (
        f"megatron-tail report: error: no TensorBoard events in {empty / 'tensorboard'}; each RUN_DIR must "
        "be the run_dir of a `megatron-tail train` run that has logged a step\n"
    )
    assert list(empty.iterdir()) == [] and not (tmp_path / "report").exists()
    # a run whose config.yaml was edited into bad YAML: before, a 62-line yaml.parser traceback
    (run_dir / "config.yaml").write_text("algorithm: {log_rho: -13\n")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "r")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith(
        f"megatron-tail report: error: {run_dir / 'config.yaml'} is not the YAML a run writes (line "
    )
    assert len(err.splitlines()) == 1, err


def test_the_report_imports_no_megatron():
    """It only reads files, so it runs where megatron-core (or a GPU stack) is not installed."""
    code = (
        "import sys, megatron_tail.report.build, megatron_tail.report.cli; print('megatron' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_cli_names_a_missing_run_directory_in_one_line(tmp_path):
    """Before: a FileNotFoundError traceback (exit 1)."""
    missing = tmp_path / "no_such_run"
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    for path, why in ((missing, "does not exist"), (not_a_dir, "is not a directory")):
        done = subprocess.run(
            [sys.executable, "-m", "megatron_tail.cli", "report", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == EXIT_USER_ERROR, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("megatron-tail report: error: ")
        assert str(path) in lines[0] and why in lines[0]


def test_a_resumed_runs_events_are_read_as_the_resume_wrote_them(tmp_path):
    """A run logged steps 1-7, crashed, resumed from its step-5 checkpoint and logged 6-9 with the trainer's
    own writer (`ScalarLog(purge_step=6)`), then stopped after step 9 and resumed from 8: each step holds the
    last process's value, a histogram too, and the report says once per resume that the log was rewound.
    Before: TensorBoard's accumulator over the directory printed "Detected out of order event.step ...
    Removing N scalars" and the report said nothing."""
    import subprocess
    import sys

    from megatron_tail.train.run.tensorboard import ScalarLog

    run_dir = tmp_path / "resumed"
    for process, (purge, steps) in enumerate([(0, range(1, 8)), (6, range(6, 10)), (9, range(9, 11))]):
        log = ScalarLog(run_dir / "tensorboard", purge_step=purge)
        for step in steps:
            log.write(step, {"reward/mean": 10.0 * process + step})
            log.write_histograms(step, {"mismatch/tail_delta": ([1.0, 2.0, 3.0], [0, process + 1, 0])})
        log.close()
    run = load_run(run_dir)
    steps, values = run.scalars["reward/mean"]
    assert steps.tolist() == list(range(1, 11))
    assert values.tolist() == [1, 2, 3, 4, 5, 16, 17, 18, 29, 30]
    assert run.rewound_to == [6, 9]
    histograms = run.histograms["mismatch/tail_delta"]
    assert [step for step, _, _ in histograms] == list(range(1, 11))
    assert [int(counts.sum()) for _, _, counts in histograms] == [1, 1, 1, 1, 1, 2, 2, 2, 3, 3]
    from megatron_tail.demo.run import read_scalars

    assert [v for _, v in read_scalars(run_dir)["reward/mean"]] == values.tolist()  # the demo reads the same
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_tail.cli", "report", str(run_dir)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (
        f"{run_dir}: resumed, its log rewound to step 6, 9; the steps it logged again are reported with the "
        "resumed run's values"
    )
    assert "out of order" not in proc.stdout + proc.stderr


def test_an_output_directory_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """Before: a PermissionError or NotADirectoryError traceback (exit 1) from `mkdir`, and runs that share
    no directory but / got /report as their default output."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    from megatron_tail.cli import main

    run_dir, a_file = tmp_path / "run", tmp_path / "mk.py"
    writer = SummaryWriter(str(run_dir / "tensorboard"))
    writer.add_scalar("reward/mean", 0.5, 1)
    writer.close()
    a_file.write_text("x")
    assert main(["report", str(run_dir), "--out", str(a_file / "sub")]) == EXIT_USER_ERROR
    assert capsys.readouterr().err == (
        f"megatron-tail report: error: --out {a_file / 'sub'}: the report writes its figures and report.md "
        f"there: {a_file} is not a directory\n"
    )
    elsewhere = Path("/dev/shm") / f"mt_report_{tmp_path.name}"  # another tree than tmp_path's
    if not Path("/dev/shm").is_dir() or Path(os.path.commonpath([tmp_path, "/dev/shm"])) != Path("/"):
        pytest.skip("needs /dev/shm, sharing no directory but / with the temporary directory")
    shutil.copytree(run_dir, elsewhere)
    try:
        assert main(["report", str(run_dir), str(elsewhere)]) == EXIT_USER_ERROR
        assert capsys.readouterr().err == (
            f"megatron-tail report: error: the runs share no directory but / ({run_dir}, {elsewhere}): the "
            "report's default place would be /report; pass --out DIR\n"
        )
        assert not Path("/report").exists()
    finally:
        shutil.rmtree(elsewhere)


def test_a_non_finite_step_leaves_the_summary_of_the_others(tmp_path):
    """Before: one NaN step made a run's mean and max NaN, printed as "—", the mark of a tag not logged."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "run"
    writer = SummaryWriter(str(run_dir / "tensorboard"))
    for step, value in enumerate([0.25, float("nan"), 0.75, 0.5], start=1):
        writer.add_scalar("reward/mean", value, step)
    writer.close()
    text = write_report([run_dir], out_dir=tmp_path / "out").read_text()
    assert (
        "| `reward/mean` | run | 0.5 | 0.5 (1 of 4 steps NaN or ±inf) | 0.75 (1 of 4 steps NaN or ±inf) |"
        in text
    )
