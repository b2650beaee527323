"""The MoE demo's pieces (`megatron-tail demo --moe [--compare]`): config variants, the comparison table from
TensorBoard-shaped scalars, the routing statistics, MoE pretraining with the load-balancing loss, the CLI."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_tail.config import load_config
from megatron_tail.demo import moe_compare
from megatron_tail.demo.defaults import DEMO_CONFIG_YAML
from megatron_tail.demo.moe import MoePretrainSettings, new_tiny_qwen3_moe, routing_stats


def test_moe_variants_differ_only_in_routing_replay(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_text(DEMO_CONFIG_YAML)
    base = [*moe_compare.MOE_OVERRIDES, "model.hf_path=x", "data.train_path=y.jsonl"]
    single = load_config(path, [*moe_compare.MOE_SINGLE[""], *base])  # run_demo's order: knobs, overrides
    single.check_runnable()
    assert single.algorithm.routing_replay == "r3" and single.parallel.tensor_parallel == 1
    assert single.rollout.local.dtype == "bfloat16" and single.model.precision == "fp32"
    assert single.train.mini_batches == 2  # r2 replays θ_old's routes in the second update too
    assert single.model.moe_aux_loss_coeff == 0  # RL without the load-balancing loss (moe_compare's comment)
    mine = load_config(path, [*moe_compare.MOE_SINGLE[""], *base, "algorithm.routing_replay=none"])
    assert mine.algorithm.routing_replay == "none"  # the user's --set wins
    arms = {n: load_config(path, [*k, *base]) for n, k in moe_compare.MOE_COMPARE_VARIANTS.items()}
    assert {n: c.algorithm.routing_replay for n, c in arms.items()} == {
        "none": "none",
        "r2": "r2",
        "r3": "r3",
    }
    assert arms["r3"] == single


def test_comparison_lines_put_each_value_in_its_arm_and_step():
    scalars = {
        "none": {"moe/routing_agreement": [(1, 0.99), (2, 0.97)], "train/grad_norm": [(1, 2.0), (2, 4.0)]},
        "r3": {"moe/routing_agreement": [(1, 1.0), (2, 1.0)], "train/grad_norm": [(2, 5.0)]},
    }
    lines = moe_compare.comparison_lines(scalars)
    assert lines[0].split() == ["none", "r3"]
    mean_row = next(line for line in lines if line.startswith("routing agreement, engine vs trainer (mean)"))
    assert mean_row.split()[-2:] == ["0.98", "1"]
    min_row = next(line for line in lines if line.startswith("routing agreement (min)"))
    assert min_row.split()[-2:] == ["0.97", "1"]
    grad = lines.index(next(line for line in lines if line.startswith("grad norm by step")))
    assert lines[grad + 1].split() == ["1", "2", "—"] and lines[grad + 2].split() == ["2", "4", "5"]
    assert not any(line.startswith("reward by step") for line in lines)  # no such scalar: no table


def _tiny(**overrides):
    model, _ = new_tiny_qwen3_moe(0, hidden_size=32, head_dim=8, moe_intermediate_size=16, **overrides)
    return model


def test_routing_stats_counts_real_tokens_and_sees_ties():
    model = _tiny()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()  # every router logit equal: the k-th and (k+1)-th tie
    ids = torch.randint(2, 90, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # 3 padding positions are not compared
    stats = routing_stats(model, ids, mask)
    assert stats.pairs == (21 - 3) * 3  # real tokens × MoE layers
    assert stats.median_gap == 0.0 and stats.close_fraction == 1.0 and stats.agreement == 1.0


def test_routing_stats_far_apart_routers_agree():
    model = _tiny()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 20.0)  # logits tens apart: bf16 cannot reorder them
    ids = torch.randint(2, 90, (4, 8), generator=torch.Generator().manual_seed(1))
    stats = routing_stats(model, ids, torch.ones_like(ids))
    assert (
        stats.pairs == 96
        and stats.agreement == 1.0
        and stats.median_gap > 1.0
        and stats.close_fraction < 0.05
    )


def test_moe_pretraining_adds_the_load_balancing_loss():
    from megatron_tail.demo.pretrain import fit_causal_lm, make_batches

    settings = MoePretrainSettings(steps=1, batch_size=4, num_examples=16, threads=1, warmup=1)
    losses = {}
    for coef in (0.0, 100.0):
        model, tokenizer = settings.new_model()
        model.config.router_aux_loss_coef = coef
        data = make_batches(tokenizer, settings)
        losses[coef] = fit_causal_lm(model, data, settings, log=None)
    fresh, _ = settings.new_model()  # the same init and the same first batch, independently
    ids, _, attention = data
    rows = torch.randint(0, ids.shape[0], (settings.batch_size,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        aux = fresh(input_ids=ids[rows], attention_mask=attention[rows], output_router_logits=True).aux_loss
    assert losses[100.0] - losses[0.0] == pytest.approx(100.0 * float(aux), rel=1e-4)
    assert fresh.config.num_experts == 8 and fresh.config.num_experts_per_tok == 2


def _parse(argv):
    from megatron_tail.demo.cli import add_demo_parser

    parser = argparse.ArgumentParser()
    add_demo_parser(parser.add_subparsers())
    return parser.parse_args(["demo", *argv])


def test_cli_moe_has_its_own_run_dir(monkeypatch):
    import megatron_tail.demo.run as run

    calls = []
    monkeypatch.setattr(run, "run_demo", lambda **kw: calls.append(kw) or 0)
    for argv in (["--moe", "--compare"], [], ["--moe", "--run-dir", "x"]):
        args = _parse(argv)
        assert args.func(args) == 0
    assert [(c["moe"], c["compare"], c["run_dir"]) for c in calls] == [
        (True, True, "runs/demo_moe"),
        (False, False, "runs/demo"),
        (True, False, "x"),
    ]


def test_moe_with_an_environment_is_refused_in_one_line(tmp_path, capsys):
    from megatron_tail.demo.run import run_demo

    code = run_demo(
        run_dir=str(tmp_path / "r"),
        cache_dir=str(tmp_path / "c"),
        overrides=["rollout.env.name=calculator"],
        moe=True,
    )
    assert code == 2 and not (tmp_path / "c").exists()
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "demo --moe with rollout.env.name: the MoE demo model is pretrained without the calculator tool"
    ]


@pytest.mark.parametrize("key", ["run_dir", "model.hf_path", "data.train_path", "data.eval_path"])
def test_a_key_the_demo_sets_itself_is_refused_in_set(tmp_path, key):
    """Before: `--set run_dir=X` trained in X while the demo said and read `--run-dir`, and reported "training
    stopped before its last step" with exit 0."""
    from megatron_tail.demo.run import run_demo
    from megatron_tail.utils.errors import UserError

    with pytest.raises(UserError, match=rf"^--set {key}: demo sets {key} for each of its runs; "):
        run_demo(run_dir=str(tmp_path / "r"), cache_dir=str(tmp_path / "c"), overrides=[f"{key}=/elsewhere"])
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_bad_override_is_refused_before_the_model_is_pretrained(tmp_path, moe):
    """Before: on a fresh cache the typo surfaced only when training started, minutes of pretraining later."""
    from megatron_tail.config import ConfigError
    from megatron_tail.demo.run import run_demo

    with pytest.raises(ConfigError, match=r"train\.steps must be an integer; got 'abc'"):
        run_demo(
            run_dir=str(tmp_path / "r"), cache_dir=str(tmp_path / "c"), overrides=["train.steps=abc"], moe=moe
        )
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("flag", ["run_dir", "cache_dir"])
def test_a_directory_flag_naming_a_file_is_one_line_before_anything(tmp_path, flag):
    """Before: `FileExistsError` (--run-dir) or `NotADirectoryError` (--cache-dir) tracebacks, the latter
    after the data was made."""
    from megatron_tail.demo.run import run_demo
    from megatron_tail.utils.errors import UserError

    (a_file := tmp_path / "a_file").write_text("")
    dirs = {"run_dir": str(tmp_path / "r"), "cache_dir": str(tmp_path / "c"), flag: str(a_file)}
    with pytest.raises(
        UserError, match=rf"^--{flag.replace('_', '-')} {a_file}: a writable directory is expected"
    ):
        run_demo(**dirs)
    assert not (tmp_path / "c").exists()
