"""`sglang_key_redaction`: an SGLang server started with the job's API key logs its resolved arguments
with the key masked, through SGLang's own argument parsing, `--config` merger and `configure_logger`; the
entry point runs `sglang.launch_server` as `python -m sglang.launch_server` would."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import REPO

pytest.importorskip("sglang.srt.server_args", reason="sglang (sglang-cpu extra) parses and logs its args")

KEY = "0123abcd9876"
ENTRY = "megatron_tail.patches.sglang_key_redaction"

# Logs SGLang's start line the way `entrypoints/engine.py` does (its module cannot be imported on a CPU host:
# uvloop, torchvision): `logger.info(f"server_args={_server_args_for_logging(server_args)}")` with
# `_server_args_for_logging` = `redact_watermark_secrets(server_args.resolved_dict())`, which the test below
# reads in the pinned source. Once before the mask, once after; then a repr and a traceback holding the key.
PROBE = """
import logging, sys
from sglang.srt.sampling.watermarking.core import redact_watermark_secrets
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils.common import configure_logger
from megatron_tail.patches.sglang_key_redaction import mask_in_log_records

server_args = prepare_server_args(["--model-path", "/m", "--config", sys.argv[1]])
configure_logger(server_args)
logger = logging.getLogger("sglang.srt.entrypoints.engine")
logger.info(f"server_args={redact_watermark_secrets(server_args.resolved_dict())}")
print("--- masked", file=sys.stderr, flush=True)
mask_in_log_records(sys.argv[2])
mask_in_log_records(sys.argv[2])
configure_logger(server_args)  # SGLang calls it again in its engine: handlers replaced, the mask stays
logger.info(f"server_args={redact_watermark_secrets(server_args.resolved_dict())}")
logger.warning("args: %r", server_args)
try:
    raise ValueError(f"bad key {server_args.api_key}")
except ValueError:
    logger.exception("start failed")

# uvicorn's access lines (SGLang serves through uvicorn's LOGGING_CONFIG): its AccessFormatter unpacks
# `record.args` as a 5-tuple (uvicorn/logging.py, `AccessFormatter.formatMessage`); uvicorn is not installed
# here, so a formatter that does the same
class Access(logging.Formatter):
    def formatMessage(self, record):
        client, method, path, version, status = record.args
        return f"{client} - {method} {path} HTTP/{version} {status}"
access = logging.getLogger("uvicorn.access")
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(Access())
access.addHandler(handler)
access.propagate = False
access.info('%s - "%s %s HTTP/%s" %d', "10.0.0.7:5100", "GET", "/q?k=" + sys.argv[2], "1.1", 200)
logger.info("%d requests", sys.argv[2])  # does not format: unmasked, the handler would print its arguments
"""


def test_the_servers_log_shows_its_arguments_with_the_key_masked(tmp_path):
    flags = tmp_path / "api_key.yaml"
    flags.write_text(f'api-key: "{KEY}"\n')
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(flags), KEY], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    before, after = proc.stderr.split("--- masked")
    assert f"'api_key': '{KEY}'" in before  # what SGLang 0.5.23 logs unpatched
    assert KEY not in after, after
    assert "'api_key': '<redacted>'" in after and "'model_path': '/m'" in after
    assert "api_key='<redacted>'" in after  # the repr
    assert "ValueError: bad key <redacted>" in after and "start failed" in after
    assert "10.0.0.7:5100 - GET /q?k=<redacted> HTTP/1.1 200" in after  # the access line, whole
    assert "'%d requests' % ('<redacted>',)" in after  # a record that does not format: its masked text


def test_sglang_logs_its_arguments_only_where_the_mask_applies():
    """The pinned source: the start lines are `logger` calls in the launching process (which the record
    factory sees), built by the function the probe above copies."""
    sglang = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    source = (sglang / "srt" / "entrypoints" / "engine.py").read_text()
    assert source.count('logger.info(f"server_args={_server_args_for_logging(server_args)}")') == 2
    assert "    return redact_watermark_secrets(server_args.resolved_dict())\n" in source
    assert "print(server_args" not in source and 'print(f"server_args' not in source


def test_the_entry_point_masks_the_named_variable_in_what_the_launcher_logs(tmp_path):
    """A stand-in `sglang.launch_server` (first on the path; the installed sglang's version still answers the
    pin) logs the variable's value: the server's log shows it masked."""
    stand_in = tmp_path / "sglang"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text("")
    (stand_in / "launch_server.py").write_text(
        "import logging, os, sys\n"
        "logging.basicConfig(level=logging.INFO, force=True)\n"
        "logging.getLogger('sglang.srt.entrypoints.engine').info('args=%s key=%s', sys.argv[1:], "
        "os.environ['MT_ROLLOUT_API_KEY'])\n"
    )
    env = {**os.environ, "MT_ROLLOUT_API_KEY": KEY, "PYTHONPATH": f"{tmp_path}:{REPO}"}
    proc = subprocess.run(
        [sys.executable, "-m", ENTRY, "--mask-env", "MT_ROLLOUT_API_KEY", "--port", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "args=['--port', '1'] key=<redacted>" in proc.stderr and KEY not in proc.stderr


def test_the_entry_point_runs_sglangs_launcher_as_main():
    """`python -m megatron_tail.patches.sglang_key_redaction --mask-env NAME ARGS` is `python -m
    sglang.launch_server ARGS`: here its `--help`, parsed by SGLang's own parser, with the key's variable set;
    without `--mask-env`, one usage line."""
    env = {**os.environ, "MT_ROLLOUT_API_KEY": KEY}
    proc = subprocess.run(
        [sys.executable, "-m", ENTRY, "--mask-env", "MT_ROLLOUT_API_KEY", "--help"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--model-path MODEL_PATH" in proc.stdout and "--api-key" in proc.stdout
    assert "'python -m sglang.launch_server' is still supported" in proc.stderr  # its __main__ block ran
    bare = subprocess.run([sys.executable, "-m", ENTRY, "--help"], cwd=REPO, capture_output=True, text=True)
    assert bare.returncode == 1 and bare.stderr.startswith("usage: python -m " + ENTRY + " --mask-env NAME")
