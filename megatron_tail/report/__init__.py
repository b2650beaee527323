"""The run report (`megatron-tail report`): TensorBoard events of one or more runs → PNGs + `report.md`.

    path = write_report(["runs/demo/naive", "runs/demo/dvp_mis"])      # runs/demo/report/report.md

Reads files only (event records past any damaged one, `config.yaml` via yaml), never megatron:
`events` loads a run, `labels` names runs by their config differences, `plotting` draws panels,
`buckets` / `histograms` the mismatch panels, `figures` one function per figure, `build` the report.
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "RunEvents": ".events",
        "load_run": ".events",
        "run_labels": ".labels",
        "write_report": ".build",
    },
)
