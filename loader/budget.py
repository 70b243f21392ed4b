"""The node's memory budget for splits held in RAM (the opt-in ``memory`` mode), counted once per node.

Every loader process on a node that wants a split in RAM asks the node's ledger, a small JSON file under the
node folder (``dutycycle.engine.cache.node``) changed only under a file lock. The budget is
``memory_fraction`` of the node's memory limit: the smaller of the machine's MemTotal and the memory limit of
this process's cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``, on its own group and every parent), so
a container sees its own limit rather than the host's memory. A copy that the node's processes share (the Ray
object store) is counted once under its key; a private copy is counted once per process. Entries of processes
that have exited are dropped the next time anyone reads the ledger, so a killed rank does not hold budget.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dutycycle.engine.cache import node

_NO_LIMIT = 1 << 60  # cgroup "no limit" values are near 2**63


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return v if 0 < v < _NO_LIMIT else None


def mem_total_bytes(proc: str) -> int | None:
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        pass
    return None


def cgroup_limit_bytes(proc: str, cgroup_root: str) -> int | None:
    """The tightest memory limit on this process's cgroup and its parents (v1 or v2), or None if unlimited."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":  # v2: unified hierarchy, at the root or under unified/ (hybrid)
            mounts = [m for m in (cgroup_root, os.path.join(cgroup_root, "unified"))
                      if os.path.exists(os.path.join(m, "cgroup.controllers"))]
            name = "memory.max"
        elif "memory" in controllers.split(","):
            mounts, name = [os.path.join(cgroup_root, "memory")], "memory.limit_in_bytes"
        else:
            continue
        for mount in mounts:
            # The group and every parent up to the mount (inside a container the path may not exist as
            # seen from the host's namespace; the mount root then is the container's own group).
            rel = path.strip("/")
            while True:
                v = _read_int(os.path.join(mount, rel, name))
                if v is not None:
                    limits.append(v)
                if not rel:
                    break
                rel = os.path.dirname(rel)
    return min(limits) if limits else None


def node_memory_limit() -> int:
    """What the node's processes may use together: min(MemTotal, cgroup limit); 0 when unknown."""
    found = [v for v in (mem_total_bytes("/proc"), cgroup_limit_bytes("/proc", "/sys/fs/cgroup")) if v]
    return min(found) if found else 0


@dataclass(frozen=True)
class Reservation:
    key: str
    granted: bool
    used: int  # bytes reserved on the node by others when asked


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _ledger_paths(root: str | None) -> tuple[str, str]:
    root = node.node_dir(root)
    return os.path.join(root, "memory-ledger.json"), os.path.join(root, "locks", "memory-ledger.lock")


def _load(path: str) -> dict:
    if not node.trusted(path):  # missing, or not written by this user: start a ledger of our own over it
        return {}
    try:
        with open(path) as f:
            ledger = json.load(f)
    except (OSError, ValueError):
        return {}
    out = {}
    for key, entry in ledger.items() if isinstance(ledger, dict) else ():
        pids = [p for p in entry.get("pids", []) if isinstance(p, int) and _alive(p)]
        if pids:
            out[key] = {"bytes": int(entry.get("bytes", 0)), "pids": pids}
    return out


def reserve(key: str, nbytes: int, budget: int, shared: bool, root: str | None = None) -> Reservation:
    """Reserve ``nbytes`` of the node's ``budget`` for ``key``. A shared key already held on the node is granted
    without counting again; a private one is per process."""
    path, lock = _ledger_paths(root)
    pid = os.getpid()
    key = key if shared else f"{key}:pid{pid}"
    with node.file_lock(lock):
        ledger = _load(path)
        entry = ledger.get(key)
        used = sum(e["bytes"] for k, e in ledger.items() if k != key)
        if entry is not None:
            granted = True
            if pid not in entry["pids"]:
                entry["pids"].append(pid)
        elif used + nbytes <= budget:
            granted = True
            ledger[key] = {"bytes": nbytes, "pids": [pid]}
        else:
            granted = False
        node.write_file_atomic(path, json.dumps(ledger).encode())
    return Reservation(key, granted, used)


def release(key: str, root: str | None = None) -> None:
    """Drop this process from ``key`` (a key returned in ``Reservation.key``); the entry goes with its last pid."""
    path, lock = _ledger_paths(root)
    pid = os.getpid()
    with node.file_lock(lock):
        ledger = _load(path)
        entry = ledger.get(key)
        if entry is not None:
            entry["pids"] = [p for p in entry["pids"] if p != pid]
            if not entry["pids"]:
                del ledger[key]
        node.write_file_atomic(path, json.dumps(ledger).encode())


def reserved_bytes(root: str | None = None) -> int:
    """Bytes reserved on the node by live processes."""
    path, lock = _ledger_paths(root)
    with node.file_lock(lock):
        return sum(e["bytes"] for e in _load(path).values())
