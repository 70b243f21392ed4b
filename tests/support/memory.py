"""Peak memory of this process, as the kernel counts it. Standard library only: a fresh child process (the
memory tests run their measurement in one) and the benchmarks' rows import it before anything heavy."""

from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    """The kernel's peak resident set of this process (VmHWM), exact even for spikes between samples."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def mapping_of(address: int) -> str:
    """The line of /proc/self/maps whose range holds ``address`` ('' if none): which file, if any, backs it."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.rstrip("\n")
    return ""
