"""An SGLang server's log without the engines' API key, and the entry point that starts one so.

SGLang 0.5.23 logs its resolved arguments at start, `--api-key` among them:
`sglang/srt/entrypoints/engine.py`, `logger.info(f"server_args={_server_args_for_logging(server_args)}")`
(in `Engine.__init__` and `_launch_subprocesses`), where `_server_args_for_logging` redacts only the
watermark secrets (`sampling/watermarking/core.py`, `redact_watermark_secrets`). `rl.sbatch` writes that
log into the run's log directory, which the cluster's other users can usually read: the key that keeps
them off the servers' ports would be theirs to read.

`mask_in_log_records(secret)` installs a log-record factory that replaces the secret's text in every
record the process makes afterwards (message, arguments and exception text), whatever logger, handler or
`configure_logger` (`utils/common.py`, `logging.basicConfig(force=True)`: handlers are replaced, the record
factory stays). By value, not by field name: a repr of `ServerArgs` (its `__repr__` hides only the
watermark fields) or a traceback holding the key is masked too. The record factory is the process's, so
it covers the launching process, where SGLang logs its arguments; the scheduler and detokenizer processes
(spawned) do not log them.

`python -m megatron_tail.patches.sglang_key_redaction --mask-env NAME SGLANG-ARGS...` masks the value of
the environment variable NAME (`http_session.API_KEY_ENV`) and runs `sglang.launch_server` as `__main__`
(`runpy`), exactly as `python -m sglang.launch_server SGLANG-ARGS...` would. `rollout/launch.py`
(`build_sglang_server_command`) uses it for a server that has a key.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

from .pinning import check_pinned

SGLANG_PIN = "0.5.23"
"""Verified against sglang 0.5.23 (`constraints-sglang.txt`): the log lines named above."""
MASK = "<redacted>"

_secrets: list[str] = []
_upstream_factory = None


def mask_in_log_records(secret: str) -> None:
    """Every log record made in this process after this call shows `MASK` where `secret`'s text was.
    Idempotent (a secret is masked once; one factory for all of them); an empty secret masks nothing."""
    global _upstream_factory
    if not secret or secret in _secrets:
        return
    check_pinned("sglang", SGLANG_PIN)
    _secrets.append(secret)
    if _upstream_factory is None:
        _upstream_factory = logging.getLogRecordFactory()
        logging.setLogRecordFactory(_masked_record)


def _masked_record(*args, **kwargs) -> logging.LogRecord:
    """The upstream factory's record with the secrets masked in its message template and in each argument,
    keeping the arguments' shape (uvicorn's access formatter unpacks `record.args` as a 5-tuple); an
    argument whose text holds a secret becomes that text, masked. Where the formatted message still holds
    one (or does not format), the record carries the masked message alone."""
    record = _upstream_factory(*args, **kwargs)
    if isinstance(record.msg, str):
        record.msg = _mask(record.msg)
    if isinstance(record.args, tuple):
        record.args = tuple(_masked_arg(a) for a in record.args)
    elif isinstance(record.args, dict):
        record.args = {k: _masked_arg(v) for k, v in record.args.items()}
    try:
        message = record.getMessage()
    except Exception:  # its handler would print the arguments: give it the masked text instead
        record.msg, record.args = _mask(f"{record.msg!r} % {record.args!r}"), None
    else:
        masked = _mask(message)
        if masked is not message:
            record.msg, record.args = masked, None
    if record.exc_info and record.exc_info[0] is not None:
        text = logging.Formatter().formatException(record.exc_info)
        masked = _mask(text)
        if masked is not text:  # a formatter uses exc_text where set, and formats exc_info only where not
            record.exc_text = masked
    return record


def _masked_arg(value):
    if isinstance(value, str):
        return _mask(value)
    if isinstance(value, (int, float, bool, type(None))):
        return value
    try:
        text = str(value)
    except Exception:
        return value
    masked = _mask(text)
    return value if masked is text else masked


def _mask(text: str) -> str:
    """`text` itself where it holds no secret (the same object), else a copy with each one masked."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def main() -> None:
    """`--mask-env NAME SGLANG-ARGS...`: masks the value of the environment variable NAME (if set), then runs
    `sglang.launch_server` with SGLANG-ARGS as its `sys.argv[1:]`."""
    if sys.argv[1:2] != ["--mask-env"] or len(sys.argv) < 3:
        sys.exit("usage: python -m megatron_tail.patches.sglang_key_redaction --mask-env NAME SGLANG-ARGS...")
    name = sys.argv[2]
    del sys.argv[1:3]
    key = os.environ.get(name, "")
    if not key:
        print(f"[sglang_key_redaction] {name} is not set: no key to mask in this log", file=sys.stderr)
    mask_in_log_records(key)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
