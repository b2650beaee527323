"""pytest plugin of `scripts/gpu_check.sh` (`-p tests.gpu.results_plugin`): writes each test's outcome,
duration, skip reason or first failure line, and the rows it recorded with
`record_property("gpu_table", row)`, to the JSON file named by `$MT_GPU_RESULTS`, rewritten after every
test, so a run stopped by the time limit still leaves what it finished. `tests.gpu.table` renders it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

RESULTS_ENV = "MT_GPU_RESULTS"
_results: dict[str, dict] = {}
_started = time.monotonic()


def _reason(report) -> str:
    if report.skipped and hasattr(report, "wasxfail"):
        return f"known failure: {report.wasxfail}"[:300]
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        text = report.longreprtext.strip().splitlines()
        errors = [line for line in text if line.startswith("E ")]
        return (errors[0] if errors else text[-1] if text else "failed")[:300]
    return ""


def pytest_runtest_logreport(report):
    entry = _results.setdefault(
        report.nodeid, {"test": report.nodeid, "outcome": "passed", "seconds": 0.0, "reason": "", "rows": []}
    )
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    if report.outcome != "passed" and entry["outcome"] == "passed":
        entry["outcome"] = "error" if report.failed and report.when != "call" else report.outcome
        if report.skipped and hasattr(report, "wasxfail"):  # a strict xfail's expected failure
            entry["outcome"] = "xfailed"
        entry["reason"] = _reason(report)
    entry["rows"] = [value for key, value in report.user_properties if key == "gpu_table"]
    _write()


def _write() -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    data = {"elapsed_s": round(time.monotonic() - _started, 1), "tests": list(_results.values())}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
