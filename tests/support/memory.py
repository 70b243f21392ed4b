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
