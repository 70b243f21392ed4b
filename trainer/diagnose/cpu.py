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
- the whole machine (``/proc/stat``): its busy time less this process tree's is what other processes took.

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


RAY_COMMANDS = ("raylet", "gcs_server")  # and every "ray::..." worker: Ray's own processes (their /proc comm)


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def descendants(pid: int, ray: bool = False) -> list[int]:
    """The live processes below ``pid`` (children, their children, ...); with ``ray``, Ray's processes on this
    machine too (a cluster started with ``ray start`` is no descendant, yet it runs this diagnosis's workers)."""
    children: dict[int, list[int]] = {}
    rays = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = _fields(f"/proc/{name}/stat")
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(name))  # field 4: the parent's id
                if ray and int(name) != pid:
                    c = _comm(name)
                    if c.startswith("ray::") or c in RAY_COMMANDS:
                        rays.append(int(name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out + [p for p in rays if p not in set(out)]


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent busy since boot (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return (total - values[3] - values[4]) / TICK


@dataclass
class Snapshot:
    at: float  # time.perf_counter()
    threads: dict[int, float]  # this process's threads
    process: float  # this process, reaped children included
    children: dict[int, float] = field(default_factory=dict)  # live descendants
    machine: float = 0.0  # the machine's busy seconds


def snapshot(ray: bool = False) -> Snapshot:
    """This process's threads, itself and its descendants (with ``ray``: and Ray's processes), and the machine."""
    pid = os.getpid()
    kids = {}
    for p in descendants(pid, ray):
        s = cpu_seconds(f"/proc/{p}/stat", children=True)
        if s is not None:
            kids[p] = s
    return Snapshot(time.perf_counter(), thread_seconds(), cpu_seconds("/proc/self/stat", children=True) or 0.0,
                    kids, machine_busy_seconds())


def cores(a: Snapshot, b: Snapshot, step_threads: set[int]) -> dict:
    """Cores used between two snapshots: by the step's threads (``step_threads``), by everything else of this
    process and its descendants (the loader's threads and processes), and by other processes on the machine."""
    wall = max(b.at - a.at, 1e-9)
    step = sum(b.threads[t] - a.threads.get(t, 0.0) for t in step_threads if t in b.threads)
    kids = sum(s - a.children.get(p, 0.0) for p, s in b.children.items())  # a child started in the window: all
    ours = (b.process - a.process) + kids
    loader = max(0.0, ours - step)
    others = max(0.0, (b.machine - a.machine) - ours)
    loader_threads = [t for t in b.threads if t not in step_threads]
    return {"step": step / wall, "loader": loader / wall, "others": others / wall, "wall_s": wall,
            "loader_threads": len(loader_threads), "loader_processes": len(b.children)}


def cores_available() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
