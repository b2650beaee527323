"""Host memory probes of the benchmarks (Linux): the RSS now and its peak, in bytes."""

from __future__ import annotations

import os
import resource


def rss_bytes() -> int:
    """Resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Start the peak RSS afresh (VmHWM := RSS); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes(reset: bool = False) -> int:
    """VmHWM since `reset_peak_rss` if `reset` (it worked), else the process's lifetime peak (ru_maxrss)."""
    if reset:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
