"""CPU time from the OS (Linux ``/proc``), per thread and per process: what a loader's threads and processes take
beside the training step, what the step's own threads take, and what the rest of the machine takes.

A wait timer cannot see a loader that decodes on the cores the step needs: the step itself slows. So the contention
experiment reads, at the start and end of a window, the CPU seconds of

- each thread of this process (``/proc/self/task/<tid>/stat``): the step's threads (the main thread and the
  intra-op pool, all started before the loader) apart from the rest, the loader's (its prefetch thread, its decode
  pool, and whatever its libraries start);
- this process as a whole, reaped children included (``/proc/self/stat``: a thread that ended in the window still
  counts there);
- every live descendant process (DataLoader workers, a local Ray cluster's workers);
- every other process's own CPU time (``others``: not this tree's, not Ray's) is what other work took.

Cores used = CPU seconds / wall seconds. Elsewhere than Linux nothing is read (``available()`` is False) and the
experiment records the step's times without the cores.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available() -> bool:
    return os.path.exists("/proc/self/task") and os.path.exists("/proc/stat")


def _fields(path: str) -> list[str] | None:
    """The fields of a ``stat`` file after the command name (which may hold spaces and parentheses); index 0 is
    the state (field 3 in proc(5)). None when the thread or process is gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def cpu_seconds(path: str, children: bool = False) -> float | None:
    """utime + stime of a ``stat`` file, in seconds (with ``children``: plus the reaped children's)."""
    f = _fields(path)
    if f is None:
        return None
    ticks = int(f[11]) + int(f[12]) + (int(f[13]) + int(f[14]) if children else 0)  # fields 14-17 of proc(5)
    return ticks / TICK


def thread_seconds(pid: int | str = "self") -> dict[int, float]:
    """CPU seconds of each live thread of ``pid``, by thread id."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        s = cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        if s is not None:
            out[int(tid)] = s
    return out


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = _fields(f"/proc/{name}/stat")
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(name))  # field 4: the parent's id
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _is_ray(pid: str) -> bool:
    """A Ray process (its workers, "ray::...", and its daemons): a cluster started with ``ray start`` is no
    descendant of a diagnosis, yet runs its workers."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
    except OSError:
        return False
    return cmd.startswith(b"ray::") or b"/ray/" in cmd or b"raylet" in cmd or b"gcs_server" in cmd


@dataclass
class Others:
    at: float  # time.perf_counter()
    since_boot: float  # seconds since boot then (/proc/uptime), against a process's start time
    seconds: dict[int, float]  # pid -> its own CPU seconds, processes not this run's


def others() -> Others:
    """The CPU seconds of every process on the machine that is not this process, its descendants or Ray's: what
    other work takes. Counted per process, by what each has used (the machine's busy time less this process
    tree's misses what our short-lived processes used once they are gone, and read 0.7 of 2 cores of "other
    work" on an idle machine beside a 2-worker Ray run)."""
    with open("/proc/uptime") as f:
        since_boot = float(f.read().split()[0])
    mine = {os.getpid(), *descendants(os.getpid())}
    seconds = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in mine and not _is_ray(name):
            # its own time only: a killed process waits as a zombie until init reaps it, and init's reaped
            # children's time then jumps by that process's whole life (a spinner's minute, killed before the
            # run, read as 1.3 cores of other work during it)
            s = cpu_seconds(f"/proc/{name}/stat")
            if s is not None:
                seconds[int(name)] = s
    return Others(time.perf_counter(), since_boot, seconds)


def others_cores(a: Others, b: Others) -> float:
    """Cores other processes used between two ``others`` readings: the ones alive at the second, from the first
    reading or from their start (a process that started in between); ones that ended in between are missed, so
    this is a lower bound."""
    total = 0.0
    for pid, s in b.seconds.items():
        if pid in a.seconds:
            total += max(0.0, s - a.seconds[pid])
        else:
            f = _fields(f"/proc/{pid}/stat")
            if f is not None and int(f[19]) / TICK >= a.since_boot:  # field 22: its start, in ticks since boot
                total += s
    return total / max(b.at - a.at, 1e-9)


@dataclass
class Snapshot:
    at: float  # time.perf_counter()
    threads: dict[int, float]  # this process's threads
    process: float  # this process, reaped children included
    children: dict[int, float] = field(default_factory=dict)  # live descendants
    others: Others | None = None  # the other processes' CPU (``others``)


def snapshot() -> Snapshot:
    pid = os.getpid()
    kids = {}
    for p in descendants(pid):
        s = cpu_seconds(f"/proc/{p}/stat", children=True)
        if s is not None:
            kids[p] = s
    return Snapshot(time.perf_counter(), thread_seconds(), cpu_seconds("/proc/self/stat", children=True) or 0.0,
                    kids, others())


def cores(a: Snapshot, b: Snapshot, step_threads: set[int]) -> dict:
    """Cores used between two snapshots: by the step's threads (``step_threads``), by everything else of this
    process and its descendants (the loader's threads and processes), and by other processes on the machine."""
    wall = max(b.at - a.at, 1e-9)
    step = sum(b.threads[t] - a.threads.get(t, 0.0) for t in step_threads if t in b.threads)
    kids = sum(s - a.children.get(p, 0.0) for p, s in b.children.items())  # a child started in the window: all
    ours = (b.process - a.process) + kids
    loader = max(0.0, ours - step)
    loader_threads = [t for t in b.threads if t not in step_threads]
    return {"step": step / wall, "loader": loader / wall, "wall_s": wall,
            "others": others_cores(a.others, b.others) if a.others and b.others else 0.0,
            "loader_threads": len(loader_threads), "loader_processes": len(b.children)}


def cores_available() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
