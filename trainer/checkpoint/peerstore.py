"""Peer memory's stores (peer.py says the whole scheme): one detached Ray actor per node and run that holds the
ranks' parts in its memory, pinned to its node; which step the live stores hold whole and verified (``choose``);
freeing them (``release``). No torch here: each store's process imports this module only.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field

from . import manifest as mf

NAMESPACE = "dutycycle-peer"  # every run's stores, in a Ray namespace of their own
PREFIX = "store-"
CALL_TIMEOUT_S = 30.0  # one store call; a store on a node that is going away must not hang a restart


def run_key(run_dir: str, attempt_dir: str) -> str:
    """The stores' name for one launch of one run: its run directory and its launch's folder (Ray Train's
    restarts and resizes share both; a new ``dutycycle train`` of the run has a new launch folder)."""
    return hashlib.sha256(f"{run_dir}\n{attempt_dir}".encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------- the store


class Store:
    """One node's memory of one run (a Ray actor: ``actor_class``): parts keyed by ``(step, rank)``."""

    def __init__(self, key: str):
        self.key = key
        self.parts: dict[tuple[int, int], tuple[dict, dict[str, bytes]]] = {}

    def put(self, record: dict, blobs: dict) -> int:
        # bytes(...) makes the part this actor's own memory, whatever buffer Ray handed over
        self.parts[(int(record["step"]), int(record["rank"]))] = (record, {k: bytes(v) for k, v in blobs.items()})
        return sum(len(b) for b in blobs.values())

    def inventory(self) -> list[dict]:
        return [record for record, _ in self.parts.values()]

    def verify(self, step: int, ranks: list[int]) -> dict[int, str]:
        """The problem with each of these parts ("" when its blobs match their record), hashed here, on the
        store's own node."""
        out = {}
        for rank in ranks:
            part = self.parts.get((step, rank))
            out[rank] = "not held" if part is None else "; ".join(check_blobs(part[0], part[1]))
        return out

    def fetch(self, step: int, rank: int, names: list[str]) -> dict[str, bytes]:
        record, blobs = self.parts[(step, rank)]
        return {n: blobs[n] for n in names}

    def drop(self, below: int | None = None, above: int | None = None) -> int:
        gone = [k for k in self.parts if (below is not None and k[0] < below) or (above is not None and k[0] > above)]
        for k in gone:
            del self.parts[k]
        return len(gone)

    def nbytes(self) -> int:
        return sum(len(b) for _, blobs in self.parts.values() for b in blobs.values())


def check_blobs(record: dict, blobs: dict) -> list[str]:
    """One message per blob of ``blobs`` that does not match ``record`` (size and BLAKE3), each naming it."""
    problems = []
    for name, (size, digest) in record["files"].items():
        if name not in blobs:
            continue
        b = blobs[name]
        if len(b) != size:
            problems.append(f"{name} of rank {record['rank']} is {len(b)} bytes, its record says {size}")
            continue
        h = mf.hasher()
        h.update(b)
        if h.hexdigest() != digest:
            problems.append(f"{name} of rank {record['rank']} has {mf.ALGORITHM} {h.hexdigest()[:16]}..., its "
                            f"record says {digest[:16]}... (corrupted)")
    return problems


_ACTOR = None


def actor_class():
    global _ACTOR
    if _ACTOR is None:
        import ray

        # no CPU: a store takes none of the node's training slots; no restarts: its memory dies with it
        _ACTOR = ray.remote(num_cpus=0, max_restarts=0)(Store)
    return _ACTOR


def store_name(key: str, node_id: str) -> str:
    return f"{PREFIX}{key}-{node_id}"


def open_store(key: str, node_id: str):
    """The run's store on node ``node_id``, started there if it is not running (detached: it outlives the
    worker that started it; pinned: it never moves to another node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return actor_class().options(
        name=store_name(key, node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)).remote(key)


def live_stores(key: str) -> dict[str, object]:
    """``{name: handle}`` of every store of run ``key`` the cluster still names (one on a dead node may be
    listed a moment longer: its calls fail, and it counts as gone)."""
    import ray

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        ns = entry.get("namespace") if isinstance(entry, dict) else NAMESPACE
        if ns == NAMESPACE and name.startswith(f"{PREFIX}{key}-" if key else PREFIX):
            try:
                out[name] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # gone between the listing and the lookup
                pass
    return out


def gather_calls(calls: dict) -> dict:
    """``{name: result or the exception}`` of remote calls made in parallel, each within ``CALL_TIMEOUT_S``."""
    import ray

    out, deadline = {}, time.monotonic() + CALL_TIMEOUT_S
    for name, ref in calls.items():
        try:
            out[name] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - a dead or unreachable store: it holds nothing usable
            out[name] = e
    return out


def release(key: str) -> int:
    """Kill every store of run ``key`` (its memory is freed); returns how many. Safe to call twice, and from the
    driver whatever happened to the workers."""
    import ray

    if not ray.is_initialized():
        return 0
    stores = live_stores(key)
    for handle in stores.values():
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001, S110 - already dead with its node
            pass
    return len(stores)


# --------------------------------------------------------------------------------------------- choosing


@dataclass
class Candidate:
    """A step whose every part is held, verified, by some live store."""

    step: int
    world: int
    records: list[dict]  # rank order
    sources: dict[int, list[str]]  # rank -> stores holding its part: a verified copy first, then the others
    problems: list[str] = field(default_factory=list)  # copies passed over

    @property
    def files(self) -> dict[str, tuple[int, int, str]]:
        """``{file name: (rank, size, digest)}`` over every part."""
        return {name: (r["rank"], size, digest) for r in self.records for name, (size, digest) in r["files"].items()}


def choose(key: str, at_least: int = 0) -> Candidate | None:
    """(Rank 0) the newest step of run ``key`` at or after ``at_least`` that the live stores hold whole and
    verified, or None."""
    stores = live_stores(key)
    inventories = gather_calls({n: h.inventory.remote() for n, h in stores.items()})
    held: dict[tuple[int, int], dict[int, tuple[dict, list[str]]]] = {}  # (step, world) -> rank -> (record, stores)
    for name, inv in inventories.items():
        if isinstance(inv, Exception):
            continue
        for rec in inv:
            slot = held.setdefault((int(rec["step"]), int(rec["world"])), {})
            slot.setdefault(int(rec["rank"]), (rec, []))[1].append(name)
    problems: list[str] = []
    for (step, world), ranks in sorted(held.items(), reverse=True):
        if step < at_least:
            break
        if set(ranks) != set(range(world)) or "state" not in ranks[0][0]:
            continue  # a rank's part never arrived (killed during the hand-over): not a whole step
        # one copy of each part verified (hashed on its store's node, no transfer), the next only when it fails;
        # the copies are spread over the stores (rank r starts at its r-th holder), and so are the fetches
        untried = {r: sorted(names)[r % len(names):] + sorted(names)[:r % len(names)] for r, (_, names) in
                   ranks.items()}
        verified: dict[int, str] = {}
        while True:
            by_store: dict[str, list[int]] = {}
            for rank in range(world):
                if rank not in verified and untried[rank]:
                    by_store.setdefault(untried[rank].pop(0), []).append(rank)
            if not by_store:
                break
            verdicts = gather_calls({n: stores[n].verify.remote(step, rs) for n, rs in by_store.items()})
            for n, verdict in verdicts.items():
                if isinstance(verdict, Exception):
                    continue
                for rank, problem in verdict.items():
                    if problem:
                        problems.append(f"step {step}, store {n}: {problem}")
                    else:
                        verified[int(rank)] = n
        # the verified copy first, then any other (unverified, checked on arrival like every blob)
        sources = {r: [verified[r]] + [n for n in sorted(ranks[r][1]) if n != verified[r]] if r in verified else []
                   for r in range(world)}
        if all(sources.values()):
            return Candidate(step, world, [ranks[r][0] for r in range(world)], sources, problems)
    if problems:
        print(f"[checkpoint] peer memory passed over: {'; '.join(problems[:4])}", file=sys.stderr, flush=True)
    return None
