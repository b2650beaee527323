"""The tail experiment's pieces: the Zipf language samples its own law, the tokenizer and the reward count
words as a hand count does, the results table is mean ± std over seeds, and the example config is the
experiment's."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch

from megatron_tail.experiments import tail_mismatch
from megatron_tail.experiments.tail_config import TAIL_CONFIG_YAML
from megatron_tail.experiments.zipf_language import (
    TARGET_FRACTION,
    ZipfLanguage,
    target_fraction_reward,
    target_words,
)
from megatron_tail.utils.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def test_the_chain_samples_each_clusters_zipf_law():
    language = ZipfLanguage(num_words=200, num_clusters=3, seed=1)
    words = language.sample(20_000, 3, seed=0)
    cluster, _, _ = language._tables
    prev, nxt = words[:, :-1].reshape(-1), words[:, 1:].reshape(-1)
    for c in range(3):
        chosen = cluster[prev] == c
        counts = torch.bincount(nxt[chosen], minlength=200).double()
        law = language.next_word_probs(int(prev[chosen][0]))
        # every context of a cluster has the same law: a permutation of the Zipf law by rank
        torch.testing.assert_close(law.sort(descending=True).values, language.zipf_probs())
        n = counts.sum()
        # χ² over the 20 most probable words + the rest: within 5 standard deviations of its mean (20)
        top = law.argsort(descending=True)[:20]
        rest = torch.ones(200, dtype=torch.bool)
        rest[top] = False
        obs = torch.cat([counts[top], counts[rest].sum()[None]])
        exp = n * torch.cat([law[top], law[rest].sum()[None]])
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        assert chi2 < 20 + 5 * math.sqrt(40), (c, chi2)


def test_entropy_is_the_zipf_laws():
    language = ZipfLanguage(num_words=50)
    p = [r**-1.1 for r in range(1, 51)]
    total = sum(p)
    want = -sum(q / total * math.log(q / total) for q in p)
    assert language.entropy() == pytest.approx(want, rel=1e-12)
    assert language.vocab_size == 52


def test_tokenizer_round_trips_words_and_reward_counts_target_words():
    language = ZipfLanguage()
    tokenizer = language.tokenizer()
    ids = tokenizer("w0 w17 w8189", add_special_tokens=False)["input_ids"]
    assert ids == [2, 19, 8191] and len(tokenizer) == 8192
    assert tokenizer.decode([*ids, 1], skip_special_tokens=True) == "w0 w17 w8189"
    targets = target_words(language.num_words)
    assert len(targets) == round(TARGET_FRACTION * 8190) and target_words(8190) == targets
    inside = sorted(targets)[:3]
    outside = [w for w in range(10) if w not in targets][:2]
    text = " ".join(f"w{w}" for w in [*inside, *outside])
    assert target_fraction_reward(text, "8190") == pytest.approx(3 / 5)
    assert target_fraction_reward("", "8190") == 0.0
    assert target_fraction_reward.reward_range == (0.0, 1.0)


def test_results_table_is_mean_and_sample_std_over_seeds(tmp_path):
    values = [0.3, 0.5, 0.4]
    mean, std = tail_mismatch._mean_std(values)
    assert mean == pytest.approx(statistics.mean(values)) and std == pytest.approx(statistics.stdev(values))
    one = tail_mismatch._mean_std([math.nan, 2.0])  # one seed with a number: no spread to tell
    assert one[0] == 2.0 and math.isnan(one[1]) and tail_mismatch._cell(*one, ".3f") == "2.000 (one seed)"
    table = {"naive": {c[0]: (0.25, 0.01) for c in tail_mismatch.COLUMNS}}
    path = tail_mismatch.write_results(tmp_path, table, seeds=[0, 1, 2], minutes=1.0)
    lines = path.read_text().splitlines()
    header = next(line for line in lines if line.startswith("| arm"))
    row = next(line for line in lines if line.startswith("| naive"))
    # escaped pipes in the header (|Δ|, |V_S|) keep the columns aligned
    assert header.replace("\\|", "").count("|") == row.count("|") == len(tail_mismatch.COLUMNS) + 2
    assert "0.250 ± 0.010" in row


def test_unknown_arm_is_refused_by_name(tmp_path):
    # a UserError: one line and exit 2 at the command line (was a ValueError traceback, exit 1)
    with pytest.raises(UserError, match=r"unknown arm\(s\) \['nope'\]"):
        tail_mismatch.run_experiment(tmp_path, tmp_path, arms=["nope"])
    with pytest.raises(UserError, match=r"unknown variant 'int4'; the variants are \['bf16', 'fp8'\]"):
        tail_mismatch.run_experiment(tmp_path, tmp_path, variant="int4")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [  # before: found after the tail model's pretraining (a bad --set), or never (repeated seeds, --jobs 0)
        ({"overrides": ["train.steps=abc"]}, r"^arm 'naive': train\.steps must be an integer; got 'abc'$"),
        ({"seeds": (0, 0)}, r"^--seeds must be distinct; got \[0, 0\]$"),
        ({"seeds": (0, -1)}, r"^--seeds -1: .*seed must be an integer in \[0, 2\^63\); got -1$"),
        ({"jobs": 0}, r"^--jobs must be ≥ 1; got 0$"),
        # before: accepted, and every seed's run trained with seed 7 (identical replicates in the table)
        ({"overrides": ["seed=7"]}, r"^--set seed: experiment sets seed for each of its runs; .*--seeds$"),
        ({"overrides": ["run_dir=/x"]}, r"^--set run_dir: experiment sets run_dir .*under --out$"),
    ],
)
def test_a_bad_grid_is_refused_before_the_tail_model_is_made(tmp_path, monkeypatch, kwargs, message):
    def never(*_args, **_kwargs):
        raise AssertionError("the tail model was made before the grid was checked")

    monkeypatch.setattr(tail_mismatch, "ensure_tail_model", never)
    groups = {"naive": [*tail_mismatch.ARMS["naive"], *kwargs.get("overrides", ())]}
    with pytest.raises(UserError, match=message):
        tail_mismatch.run_grid(
            tmp_path / "out",
            tmp_path / "cache",
            groups,
            seeds=kwargs.get("seeds", (0,)),
            jobs=kwargs.get("jobs", 1),
        )
    (a_file := tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match=rf"^--out {a_file} is a file; a directory is expected$"):
        tail_mismatch.run_grid(a_file, tmp_path / "cache", {"naive": []}, seeds=(0,))


def test_example_config_is_the_experiments_and_loads():
    from megatron_tail.config import load_config

    path = REPO / "examples" / "experiments" / "tail_mismatch.yaml"
    assert path.read_text() == TAIL_CONFIG_YAML
    cfg = load_config(path, ["model.hf_path=x", "data.train_path=y"])
    assert cfg.algorithm.log_rho is None and cfg.algorithm.is_mode == "none"
    assert cfg.rollout.local.dtype == "bfloat16" and cfg.model.precision == "fp32"
    dvp = load_config(path, ["model.hf_path=x", "data.train_path=y", *tail_mismatch.ARMS["dvp_mis"]])
    assert dvp.algorithm.log_rho == -9.0 and dvp.algorithm.is_mode == "mis"
    for knobs in tail_mismatch.ARMS.values():  # every arm is a valid config (load_config raises otherwise)
        load_config(path, ["model.hf_path=x", "data.train_path=y", *knobs])
    fp8 = load_config(path, ["model.hf_path=x", "data.train_path=y", *tail_mismatch.VARIANTS["fp8"]])
    assert fp8.rollout.quantization == "fp8" and fp8.train.steps == 60 and cfg.rollout.quantization == "none"


def test_model_sizes_have_their_own_cache_and_shapes(tmp_path):
    from transformers import Qwen3ForCausalLM

    from megatron_tail.experiments.tail_model import (
        MODEL_SIZES,
        TailPretrainSettings,
        tail_model_config,
        tail_model_dir,
    )

    assert tail_model_dir(tmp_path) == tmp_path / "tiny_qwen3_zipf"  # the bf16 results' model, unchanged
    assert tail_model_dir(tmp_path, "small") == tmp_path / "qwen3_zipf_h256_l4"
    with pytest.raises(
        ValueError, match=r"unknown model size 'huge'; the sizes are \['tiny', 'small', 'ci'\]"
    ):
        tail_model_dir(tmp_path, "huge")
    config = tail_model_config(ZipfLanguage(), TailPretrainSettings(**MODEL_SIZES["small"]))
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    layers = model.model.layers
    assert len(layers) == 4 and layers[0].mlp.down_proj.weight.shape == (256, 768)
    assert layers[0].self_attn.q_proj.weight.shape == (256, 256)  # 4 heads x 64, divisible by TP = 2


def test_a_finished_run_of_another_config_is_refused_not_reused(tmp_path):
    """An experiment reused any finished run under its directory name: `collapse --level fp8` after the
    default level, or another `--model-size`, printed the earlier runs under the new title. A finished run
    is reused only where its checkpoint's config trains the same thing."""
    from megatron_tail.config.loader import config_from_yaml
    from megatron_tail.demo.run import reusable_run
    from megatron_tail.experiments.tail_config import TAIL_CONFIG_YAML
    from megatron_tail.train.run import run_dir as layout
    from megatron_tail.train.run.config_change import config_text
    from megatron_tail.utils.errors import UserError

    run_dir = tmp_path / "naive" / "seed0"
    run_dir.mkdir(parents=True)
    base = [f"model.hf_path={tmp_path / 'model'}", f"data.train_path={tmp_path / 'p.jsonl'}", "seed=0"]
    trained = config_from_yaml(TAIL_CONFIG_YAML, [*base, "optimizer.lr=1e-5"])
    assert not reusable_run(run_dir, [*base, "optimizer.lr=1e-5"], base_yaml=TAIL_CONFIG_YAML)  # none yet
    layout.mark_diverged(run_dir, 3, "diverged")  # a marker whose checkpoint was removed by hand
    assert not reusable_run(run_dir, [*base, "optimizer.lr=1e-5"], base_yaml=TAIL_CONFIG_YAML)
    (run_dir / layout.DIVERGED_NAME).unlink()
    checkpoint = run_dir / "checkpoints" / f"step_{trained.train.steps:06d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "metadata.json").write_text("{}")
    (checkpoint / "config.yaml").write_text(config_text(trained))
    assert reusable_run(run_dir, [*base, "optimizer.lr=1e-5"], base_yaml=TAIL_CONFIG_YAML)
    with pytest.raises(UserError, match=r"holds a finished run trained with another config .*optimizer\.lr"):
        reusable_run(run_dir, [*base, "optimizer.lr=1e-3"], base_yaml=TAIL_CONFIG_YAML)
    other_model = [f"model.hf_path={tmp_path / 'small'}", *base[1:], "optimizer.lr=1e-5"]
    with pytest.raises(UserError, match=r"model\.hf_path"):
        reusable_run(run_dir, other_model, base_yaml=TAIL_CONFIG_YAML)


def test_the_collapse_table_reads_the_reports_reward_and_weighs_the_tail_per_token(tmp_path):
    """Under dynamic sampling a collapse's all-filtered steps log no `reward/mean`: the table said "not
    collapsed" (last-10 reward 0.6) where the report said collapsed (it reads `reward/generated_mean`). The
    tail |Δ| column was a plain mean over steps, 22× the report's token-weighted value on the audit's run."""
    from megatron_tail.experiments.collapse import summarise_run
    from tests.report.test_collapse import write_events

    steps = list(range(1, 41))
    generated = [0.6] * 20 + [0.0] * 20  # collapsed at step 21
    kept = [0.6] * 40  # the kept groups' reward: equal-reward groups are filtered, so it stays
    tail_tokens = [1000.0] * 30 + [1.0] * 10
    tail_delta = [0.01] * 30 + [1.0] * 10
    write_events(tmp_path, steps, {
        "reward/mean": kept, "reward/generated_mean": generated, "train/loss": [0.1] * 40,
        "mismatch/abs_delta/p0_0.0001": tail_delta, "mismatch/tokens/p0_0.0001": tail_tokens,
        # Lopti's two updates a step: their mean halves a spike that the step's max keeps
        "train/grad_norm": [1.0] * 39 + [3.0], "train/grad_norm_max": [1.0] * 39 + [5.0],
    })  # fmt: skip
    run = summarise_run(tmp_path)
    assert run["summary"]["grad-norm peak"] == 5.0
    assert tail_mismatch.logged_tag({"train/grad_norm": []}, "train/grad_norm_max") == "train/grad_norm"
    assert run["collapsed"] and run["reason"] == "reward"
    assert run["summary"]["reward, last 10"] == 0.0
    weighted = (30 * 1000 * 0.01 + 10 * 1.0) / (30 * 1000 + 10)
    assert run["summary"]["tail |Δ|, π<1e-4 (per token)"] == pytest.approx(weighted, rel=1e-6)


def test_a_run_that_diverges_is_a_result_of_the_grid_not_its_failure(tmp_path, monkeypatch):
    """A collapse suite's run that stops on `train.max_nonfinite_updates_in_a_row` (exit 2) ended the whole
    suite, and its rerun resumed into the same divergence: the "non-finite loss" collapse never reached a
    table. It is logged as collapsed, the grid goes on, and a rerun does not train it again."""
    from megatron_tail.train.run import run_dir as layout
    from megatron_tail.train.run.supervise import TrainingOutcome

    launched, said = [], []

    def launch(target, _overrides, **_):  # the first arm diverges after 3 steps; the second finishes
        launched.append(target.parent.name)
        target.mkdir(parents=True, exist_ok=True)
        if target.parent.name == "naive":
            layout.mark_diverged(target, 3, "step 3: the gradient norm was NaN")
            return TrainingOutcome(2, None)
        return TrainingOutcome(0, None)

    monkeypatch.setattr(tail_mismatch, "launch_training", launch)
    monkeypatch.setattr(tail_mismatch, "ensure_tail_model", lambda cache, **_: Path(cache) / "model")
    monkeypatch.setattr(tail_mismatch, "ensure_tail_prompts", lambda cache: (Path(cache) / "p.jsonl", None))
    monkeypatch.setattr(
        tail_mismatch, "reusable_run", lambda target, *_, **__: layout.diverged_at(target) == 3
    )
    groups = {"naive": [], "dvp": []}
    runs = tail_mismatch.run_grid(tmp_path, tmp_path / "cache", groups, seeds=(0,), log=said.append)
    assert launched == ["naive", "dvp"] and list(runs) == ["naive", "dvp"]
    assert (
        said[0]
        == f"[naive seed 0] diverged after step 3, counted as collapsed: {tmp_path / 'naive' / 'seed0'}"
    )
    launched.clear()
    tail_mismatch.run_grid(tmp_path, tmp_path / "cache", groups, seeds=(0,), log=said.append)
    assert launched == ["dvp"]  # the diverged run is not trained again
