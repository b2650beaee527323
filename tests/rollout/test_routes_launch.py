"""`--enable-return-routed-experts` (routing replay r3) on the launch paths: SGLang's own argument parser,
`megatron-tail serve-local`'s, and the Slurm helper that `slurm/rl.sbatch` runs for either backend."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import pytest

from megatron_tail.cli import build_parser
from megatron_tail.rollout.launch import (
    LocalEngineConfig,
    SGLangServerConfig,
    build_local_engine_command,
    build_sglang_server_command,
)

HELPER = Path(__file__).resolve().parents[2] / "slurm" / "mt_slurm.py"


def test_sglang_servers_get_the_flag_and_sglang_parses_it():
    server_args = pytest.importorskip(
        "sglang.srt.server_args", reason="sglang (sglang-cpu extra) parses its flags"
    )
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    on = build_sglang_server_command(
        SGLangServerConfig(model_path="/m", return_routed_experts=True), "python"
    )
    off = build_sglang_server_command(SGLangServerConfig(model_path="/m"), "python")
    assert parser.parse_args(on[3:]).enable_return_routed_experts is True
    assert parser.parse_args(off[3:]).enable_return_routed_experts is False


def test_local_engines_get_the_flag_and_serve_local_parses_it():
    parser = build_parser()
    on = build_local_engine_command(LocalEngineConfig(model_path="/m", return_routed_experts=True), "python")
    off = build_local_engine_command(LocalEngineConfig(model_path="/m"), "python")
    assert parser.parse_args(on[3:]).enable_return_routed_experts is True
    assert parser.parse_args(off[3:]).enable_return_routed_experts is False


@pytest.mark.parametrize("backend", ["local", "sglang"])
@pytest.mark.parametrize("flag", [[], ["--return-routed-experts"]])
def test_the_slurm_helper_passes_the_flag_to_either_backend(monkeypatch, backend, flag):
    spec = importlib.util.spec_from_file_location("mt_slurm_routes_under_test", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    started = []
    monkeypatch.setattr(os, "execv", lambda _path, cmd: started.append(cmd))
    argv = ["serve", "--backend", backend, "--model-path", "/m", "--port-base", "9000", "--host", "127.0.0.1"]
    module.main([*argv, *flag])
    (cmd,) = started
    assert ("--enable-return-routed-experts" in cmd) == bool(flag)
