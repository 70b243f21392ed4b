"""Shared measurement helpers for benchmarks/*.py: throughput, time to first batch, peak RSS, one row per process
and a local Ray cluster.

Every benchmark row runs in its own Python process (``run_row``), so its peak memory is its own: the row
measures the resident set of its whole process tree (itself, DataLoader workers, a local Ray cluster's
daemons and workers) by sampling, and the kernel's high-water mark for the row process itself.

Only the standard library (and tests/support/memory.py, standard library too) is imported at module level: the
peers' rows (``loader_peers.py``) import this module in a virtual environment without dutycycle.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.memory import peak_rss_bytes

RESULT_PREFIX = "BENCH_RESULT "


# ----------------------------------------------------------------------------------------------- memory


class PeakRSS:
    """Peak resident set of this process plus all its descendants, sampled every ``interval`` seconds.

    A sum of RSS counts pages shared between processes (a memory-mapped file, Ray's object store) once per
    process that touches them, so it is an upper bound on the memory the row really holds.
    """

    def __init__(self, interval: float = 0.05, exclude: str | None = None):
        self.interval = interval
        # descendants whose command line contains ``exclude`` (a server the row talks to, e.g. moto) are not the
        # row's: left out of its figures and measured apart (``peak_excluded_private``)
        self.exclude = exclude
        self.peak_tree = 0
        self.peak_private = 0  # resident minus file-backed and shared pages (Linux RssAnon), summed over the tree
        self.peak_excluded_private = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def _sample(self) -> tuple[int, int, int]:
        import psutil

        me = psutil.Process()
        total = private = excluded = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                m = p.memory_info()
                if self.exclude and p is not me and self.exclude in " ".join(p.cmdline()):
                    excluded += m.rss - getattr(m, "shared", 0)
                    continue
                total += m.rss
                private += m.rss - getattr(m, "shared", 0)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return total, private, excluded

    def _update(self) -> None:
        total, private, excluded = self._sample()
        self.peak_tree, self.peak_private = max(self.peak_tree, total), max(self.peak_private, private)
        self.peak_excluded_private = max(self.peak_excluded_private, excluded)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._update()
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._update()

    def result(self) -> dict[str, float]:
        mib = 1024**2
        self_hwm = peak_rss_bytes()
        return {
            "peak_rss_mb": round(max(self.peak_tree, self_hwm) / mib, 1),
            "peak_rss_self_mb": round(self_hwm / mib, 1),
            # what the row holds privately: memory-mapped files in the page cache (shared by every process on the
            # node) and shared memory are excluded; peak_rss_mb counts them in every process that maps them
            "peak_private_mb": round(self.peak_private / mib, 1),
            **({"excluded_peak_private_mb": round(self.peak_excluded_private / mib, 1)} if self.exclude else {}),
        }


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and its live descendants (workers, Ray)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return total


# ------------------------------------------------------------------------------------------- throughput


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the length of its ``label`` entry (dict batches) or of its first element."""
    labels = batch["label"] if isinstance(batch, dict) else batch[1]
    return len(labels)


def measure(
    open_loader: Callable[[], Any],
    epoch_iter: Callable[[Any, int], Iterable[Any]],
    *,
    min_seconds: float,
    round_seconds: float = 1.0,
    max_batches: int | None = None,
    max_epochs: int = 100_000,
    check: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Time a loader: time to first batch from construction, then samples/s after that warm-up batch.

    ``open_loader()`` builds the loader (timed as part of the first batch); ``epoch_iter(loader, e)`` yields
    epoch ``e``'s batches. Whole epochs repeat until ``min_seconds`` of steady state have passed (at least one
    epoch and one batch after the warm-up one), or stop after ``max_batches`` (for rows too slow for an epoch).
    The timed span is cut into rounds of ``round_seconds``; ``samples_per_s`` is the median round rate when
    there are three or more (the machine is shared, and a median shrugs off a neighbour's burst), otherwise
    the mean over the span, which ``samples_per_s_mean`` always reports. ``samples_per_cpu_s`` divides by the
    CPU time of the whole process tree instead (the row's own cost, less sensitive to a busy machine).
    """
    t0 = time.perf_counter()
    loader = open_loader()
    it: Iterator[Any] = iter(epoch_iter(loader, 0))
    first = next(it)
    t_first = time.perf_counter()
    if check is not None:
        check(first)
    cpu0 = tree_cpu_seconds()
    rates: list[float] = []
    samples = batches = epoch = round_samples = 0
    round_start = t_first
    while True:
        for batch in it:
            k = batch_size_of(batch)
            samples, batches, round_samples = samples + k, batches + 1, round_samples + k
            now = time.perf_counter()
            if now - round_start >= round_seconds:
                rates.append(round_samples / (now - round_start))
                round_samples, round_start = 0, now
            if max_batches is not None and batches >= max_batches:
                break
        else:
            epoch += 1
            elapsed = time.perf_counter() - t_first
            if not ((elapsed >= min_seconds and batches) or epoch >= max_epochs):
                it = iter(epoch_iter(loader, epoch))
                continue
        break
    elapsed = time.perf_counter() - t_first
    cpu = tree_cpu_seconds() - cpu0
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    mean = samples / elapsed if elapsed > 0 else 0.0
    return {
        "samples_per_s": round(statistics.median(rates) if len(rates) >= 3 else mean, 1),
        "samples_per_s_mean": round(mean, 1),
        "time_to_first_batch_s": round(t_first - t0, 3),
        "epochs": epoch,
        "batches_timed": batches,
        "samples_timed": samples,
        "seconds_timed": round(elapsed, 3),
        "rounds": len(rates),
        # CPU work per sample barely depends on what else the machine runs, unlike wall-clock rates
        "cpu_s_timed": round(cpu, 3),
        "samples_per_cpu_s": round(samples / cpu, 1) if cpu > 0 else None,
    }


# ------------------------------------------------------------------------------------------ processes


@contextmanager
def local_ray() -> Iterator[float]:
    """A local Ray with 2 CPUs for this row's process; yields its start-up seconds (0 when already running)."""
    import ray
    from dutycycle.trainer.cluster.local import start_local_ray

    t0 = time.perf_counter()
    if not start_local_ray(num_cpus=2, object_store_bytes=512 * 1024**2):  # a caller holds one for several rows
        yield 0.0
        return
    try:
        yield time.perf_counter() - t0
    finally:
        ray.shutdown()


def quiet_ray_data() -> None:
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def emit(result: dict[str, Any]) -> None:
    """A row process reports its result as one tagged JSON line on stdout (other output may surround it)."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def bench_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("DAFT_ANALYTICS_ENABLED", "0")
    env.setdefault("DAFT_PROGRESS_BAR", "0")
    env.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    env.setdefault("TQDM_DISABLE", "1")
    return env


def run_row(argv: list[str], timeout: float, python: str | None = None) -> tuple[dict[str, Any], float]:
    """Run ``python argv...`` in a fresh process (this Python unless ``python`` names another); return (its
    emitted result or ``{"error": ...}``, wall seconds)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [python or sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=bench_env()
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}, timeout
    wall = round(time.perf_counter() - t0, 1)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :]), wall
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}, wall


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts each rank in a session of its own, so a process
    group kill would leave the ranks running)."""
    import psutil

    me = psutil.Process(pid)
    for p in [*me.children(recursive=True), me]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def machine() -> dict[str, Any]:
    """What a result was measured on (CPUs, Python, platform), for the JSON beside the figures."""
    import platform

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def default_out(name: str) -> str:
    """Where a benchmark writes its JSON unless ``--out`` says otherwise: benchmarks/results/NAME.json."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{name}.json")


def read_result(out: str) -> dict[str, Any]:
    """What ``out`` holds already (for ``--merge``), or nothing."""
    if not os.path.exists(out):
        return {}
    with open(out) as f:
        return json.load(f)


def write_result(out: str, result: dict[str, Any], show: tuple[str, ...] = ()) -> None:
    """Write a benchmark's JSON to ``out`` whole or not at all, and print the ``show`` keys of it."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    if show:
        print(json.dumps({k: result[k] for k in show if k in result}, indent=2))
    print(f"wrote {out}", file=sys.stderr)


def main_for(parse_args, run, argv: list[str] | None = None) -> int:
    """A benchmark's whole command: its arguments, its run, the JSON written and printed whole."""
    args = parse_args(argv)
    result = run(args)
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
