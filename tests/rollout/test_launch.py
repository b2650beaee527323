"""Server / router / local-engine command lines, checked against the parsers that will read them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_tail.cli import build_parser, main
from megatron_tail.rollout.launch import (
    LocalEngineConfig,
    RouterConfig,
    SGLangServerConfig,
    build_local_engine_command,
    build_router_command,
    build_sglang_server_command,
)


def test_sglang_command_parses_with_sglangs_own_arguments():
    server_args = pytest.importorskip(
        "sglang.srt.server_args", reason="sglang (sglang-cpu extra) parses its flags"
    )
    cfg = SGLangServerConfig(
        model_path="/ckpt/qwen3-8b", host="10.0.0.5", port=31000, tp_size=2, ep_size=2,
        mem_fraction_static=0.8, weight_version="0", random_seed=7, base_gpu_id=2,
        extra_args=("--log-level", "warning"), deterministic_inference=True, sampling_mask_max_tokens=1024,
    )  # fmt: skip
    cmd = build_sglang_server_command(cfg, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(cmd[3:])
    assert args.enable_custom_logit_processor is True
    assert args.enable_deterministic_inference is True
    assert (args.model_path, args.host, args.port, args.tp_size) == ("/ckpt/qwen3-8b", "10.0.0.5", 31000, 2)
    assert args.ep_size == 2  # cluster.sglang.ep
    assert (args.dtype, args.mem_fraction_static, args.weight_version) == ("bfloat16", 0.8, "0")
    assert (args.random_seed, args.base_gpu_id, args.log_level) == (7, 2, "warning")
    assert args.sampling_mask_max_tokens == 1024  # rollout.sampling.mask_max_tokens
    plain = build_sglang_server_command(SGLangServerConfig(model_path="/m"))
    assert "--sampling-mask-max-tokens" not in plain and "--ep-size" not in plain


def test_fp8_servers_quantize_online_with_the_rl_loader_and_parse_with_sglangs_arguments():
    """rollout.quantization=fp8 → `--quantization fp8 --load-format flash_rl` (the loader that re-quantizes
    synced bf16 weights); none adds neither flag."""
    plain = build_sglang_server_command(SGLangServerConfig(model_path="/m"), python="python")
    assert "--quantization" not in plain and "--load-format" not in plain
    fp8 = SGLangServerConfig(model_path="/m", quantization="fp8")
    cmd = build_sglang_server_command(fp8, python="python")
    assert cmd[-4:] == ["--quantization", "fp8", "--load-format", "flash_rl"]
    server_args = pytest.importorskip(
        "sglang.srt.server_args", reason="sglang (sglang-cpu extra) parses its flags"
    )
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(cmd[3:])
    assert (args.quantization, args.load_format) == ("fp8", "flash_rl")


def test_router_command():
    cfg = RouterConfig(worker_urls=("http://n1:30000", "http://n2:30000"), port=29000, policy="round_robin")
    assert build_router_command(cfg, python="python") == [
        "python", "-m", "sglang_router.launch_router", "--worker-urls", "http://n1:30000", "http://n2:30000",
        "--host", "127.0.0.1", "--port", "29000", "--policy", "round_robin",
    ]  # fmt: skip
    keyed = build_router_command(dataclasses.replace(cfg, key_env="MT_ROLLOUT_API_KEY"), python="python")
    assert keyed[:2] == ["python", "-c"] and keyed[3:] == build_router_command(cfg, python="python")[3:]


def test_local_engine_command_parses_with_the_cli_and_binds_localhost_by_default():
    cmd = build_local_engine_command(
        LocalEngineConfig(model_path="/m", port=30001, num_threads=1), python="py"
    )
    assert cmd[:4] == ["py", "-m", "megatron_tail.cli", "serve-local"]
    args = build_parser().parse_args(cmd[3:])
    assert (args.model_path, args.port, args.host, args.dtype, args.num_threads) == (
        "/m",
        30001,
        "127.0.0.1",
        "bfloat16",
        1,
    )
    defaults = build_parser().parse_args(["serve-local", "--model-path", "/m", "--port", "1"])
    assert defaults.host == "127.0.0.1" and defaults.dtype == "bfloat16"
    assert defaults.sampling_mask_max_tokens == 4096  # SGLang's default
    capped = build_local_engine_command(LocalEngineConfig(model_path="/m", sampling_mask_max_tokens=64))
    assert build_parser().parse_args(capped[3:]).sampling_mask_max_tokens == 64
    assert defaults.quantization == "none" and "--quantization" not in cmd
    fp8 = build_local_engine_command(LocalEngineConfig(model_path="/m", quantization="fp8"), python="py")
    assert build_parser().parse_args(fp8[3:]).quantization == "fp8"
    # SGLang's CUDA default sampler unless told otherwise (`rollout.deterministic` → pytorch)
    assert defaults.sampling_backend == "flashinfer" and "--sampling-backend" not in cmd
    seeded = build_local_engine_command(LocalEngineConfig(model_path="/m", sampling_backend="pytorch"))
    assert build_parser().parse_args(seeded[3:]).sampling_backend == "pytorch"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SGLangServerConfig(model_path="m", port=0), "port must be an int in 1..65535; got 0"),
        (lambda: SGLangServerConfig(model_path="m", dtype="fp8"), "dtype must be one of .* got 'fp8'"),
        (
            lambda: SGLangServerConfig(model_path="m", mem_fraction_static=1.5),
            r"mem_fraction_static must be in \(0, 1\)",
        ),
        (lambda: RouterConfig(worker_urls=()), "worker_urls must name at least one server"),
        (
            lambda: LocalEngineConfig(model_path="m", dtype="int8"),
            "dtype must be bfloat16, float16 or float32",
        ),
        (
            lambda: LocalEngineConfig(model_path="m", sampling_backend="triton"),
            "sampling_backend must be flashinfer or pytorch; got 'triton'",
        ),
        (
            lambda: LocalEngineConfig(model_path="m", quantization="int4"),
            r"quantization must be one of \('none', 'fp8', 'fp8_tensor', 'nvfp4_a16'\); got 'int4'",
        ),
        (
            lambda: SGLangServerConfig(model_path="m", quantization="fp4"),
            r"quantization must be one of \('none', 'fp8'\); got 'fp4'",
        ),
        (
            lambda: SGLangServerConfig(
                model_path="m", quantization="fp8", extra_args=("--load-format", "auto")
            ),
            "must not repeat them",
        ),
        (
            lambda: SGLangServerConfig(model_path="m", tp_size=2, ep_size=4),
            r"ep_size must be ≥ 1 and divide tp_size=2; got 4",
        ),
    ],
)
def test_bad_config_names_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_cli_requires_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "serve-local" in capsys.readouterr().err


def test_deterministic_inference_is_opt_in():
    cfg = SGLangServerConfig(model_path="/ckpt", port=31000)
    assert "--enable-deterministic-inference" not in build_sglang_server_command(cfg, python="python")
    det = SGLangServerConfig(model_path="/ckpt", port=31000, deterministic_inference=True)
    assert "--enable-deterministic-inference" in build_sglang_server_command(det, python="python")


def test_the_flags_rl_sbatch_sets_are_refused_in_extra_args_under_every_sglang_spelling():
    """`config.cluster.OWNED_SGLANG_FLAGS` holds every flag the server command can carry, with each alias
    SGLang's own parser gives it: what `cluster.sglang.extra_args` refuses cannot drift from what is set."""
    server_args = pytest.importorskip(
        "sglang.srt.server_args", reason="sglang (sglang-cpu extra) parses its flags"
    )
    from megatron_tail.config.cluster import OWNED_SGLANG_FLAGS

    everything = SGLangServerConfig(
        model_path="/m", tp_size=2, ep_size=2, mem_fraction_static=0.8, deterministic_inference=True,
        quantization="fp8", sampling_mask_max_tokens=64, return_routed_experts=True,
    )  # fmt: skip
    emitted = {a for a in build_sglang_server_command(everything, python="python") if a.startswith("--")}
    # context length and the seed are the Python API's (rl.sbatch leaves them to extra_args)
    assert emitted - {"--context-length", "--random-seed"} <= set(OWNED_SGLANG_FLAGS), emitted
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    for action in parser._actions:
        if set(action.option_strings) & emitted:
            assert set(action.option_strings) <= set(OWNED_SGLANG_FLAGS), action.option_strings
    # and every flag refused for what it does to sampling is one of SGLang's (a prefix: some are)
    from megatron_tail.config.cluster import REFUSED_SGLANG_FLAGS

    flags = [o for action in parser._actions for o in action.option_strings]
    for refused in REFUSED_SGLANG_FLAGS:
        assert any(f.startswith(refused) if refused.endswith("-") else f == refused for f in flags), refused


def test_the_api_key_reaches_sglang_in_a_file_of_flags_not_on_its_command_line(tmp_path):
    """`args_file` (`mt_slurm.py serve` writes the job's key there): SGLang's own `--config` merger reads it
    into `--api-key`; the command line, which `ps` shows every user of the node, holds only the path."""
    server_args = pytest.importorskip(
        "sglang.srt.server_args", reason="sglang (sglang-cpu extra) parses its flags"
    )
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    path = tmp_path / "api_key.yaml"
    path.write_text('api-key: "0123abcd"\n')
    cmd = build_sglang_server_command(
        SGLangServerConfig(model_path="/m", args_file=str(path)), python="python"
    )
    assert cmd[cmd.index("--config") + 1] == str(path) and not any("0123abcd" in a for a in cmd)
    entry = ["-m", "megatron_tail.patches.sglang_key_redaction", "--mask-env", "MT_ROLLOUT_API_KEY"]
    assert cmd[1:5] == entry  # the key masked in the server's log
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(cmd[5:]))
    assert args.api_key == "0123abcd" and args.admin_api_key is None  # --api-key alone covers every endpoint
    assert "--config" not in build_sglang_server_command(SGLangServerConfig(model_path="/m"))


def test_a_servers_url_brackets_an_ipv6_address():
    assert SGLangServerConfig(model_path="/m", host="::1", port=31000).url == "http://[::1]:31000"
    assert LocalEngineConfig(model_path="/m", host="fe80::2", port=30001).url == "http://[fe80::2]:30001"
    assert SGLangServerConfig(model_path="/m", host="10.0.0.5", port=31000).url == "http://10.0.0.5:31000"
