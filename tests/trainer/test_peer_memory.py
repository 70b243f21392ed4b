"""Peer memory (trainer/checkpoint/peer.py): state kept in Ray actors outlives the ranks that saved it, a step
counts only when every rank's part is there and verifies, and a run resumed at another world size from memory
trains as if never stopped. Spawned gloo ranks join the session's Ray cluster (one node: each part is kept once;
test_peer_memory_nodes.py loses a node of a multi-node cluster)."""

from __future__ import annotations

import math

import pytest
from dutycycle.trainer.checkpoint import manifest as mf
from dutycycle.trainer.checkpoint import peerstore as peer

from ..support import peer_worker as pw
from ..support.harness import run_calls, run_distributed


def _record(blobs: dict) -> dict:
    files = {}
    for name, b in blobs.items():
        h = mf.hasher()
        h.update(b)
        files[name] = [len(b), h.hexdigest()]
    return {"rank": 1, "files": files}


def test_every_blob_is_checked_against_its_record():
    blobs = {"__1_0.distcp": b"shard bytes", "metadata.json": b"{}"}
    record = _record(blobs)
    assert peer.check_blobs(record, blobs) == []
    flipped = {**blobs, "__1_0.distcp": b"shard bytez"}
    (problem,) = peer.check_blobs(record, flipped)
    assert "__1_0.distcp of rank 1" in problem and "corrupted" in problem
    (problem,) = peer.check_blobs(record, {**blobs, "metadata.json": b"{} "})
    assert "metadata.json of rank 1 is 3 bytes, its record says 2" in problem


@pytest.mark.timeout(400)
def test_a_run_resumed_at_another_size_from_peer_memory_trains_as_if_never_stopped(ray_cluster, tmp_path):
    import ray

    address = ray.get_runtime_context().gcs_address
    run, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    # on the same two ranks: the uninterrupted reference, then the run that crashes in step 7 (memory holds
    # steps 4 and 6, storage step 4)
    out = run_calls(2, [("ref", "tests.support.peer_worker:train", (address, ref, None, [])),
                        ("a", "tests.support.peer_worker:train", (address, run, 7, []))], timeout=300)
    assert out["a"] == [{"crashed": True}] * 2 and out["ref"][0]["resumed"] is None
    assert out["ref"][0]["memory"]["saves"] == 5  # steps 2, 4, 6, 8, 10 (none at the last)
    key = peer.run_key(run, run)
    stores = peer.live_stores(key)
    assert len(stores) == 1 and not peer.live_stores(peer.run_key(ref, ref))  # a finished run frees its memory
    (store,) = stores.values()
    held = sorted((r["step"], r["rank"]) for r in ray.get(store.inventory.remote()))
    assert held == [(4, 0), (4, 1), (6, 0), (6, 1)]  # retention: the newest step and the one before
    assert peer.choose(key).step == 6

    # nothing half-used: a step one rank never finished handing over is not a step
    part0 = next(r for r in ray.get(store.inventory.remote()) if (r["step"], r["rank"]) == (6, 0))
    blobs0 = ray.get(store.fetch.remote(6, 0, list(part0["files"])))
    ray.get(store.put.remote({**part0, "step": 8}, blobs0))
    assert peer.choose(key).step == 6
    ray.get(store.drop.remote(above=6))
    # every blob verified before use: a flipped byte in rank 1's shard of step 6 makes step 4 the newest whole one
    part1 = next(r for r in ray.get(store.inventory.remote()) if (r["step"], r["rank"]) == (6, 1))
    shard = "__1_0.distcp"
    good = ray.get(store.fetch.remote(6, 1, list(part1["files"])))
    bad = bytearray(good[shard])
    bad[len(bad) // 2] ^= 0x01
    ray.get(store.put.remote(part1, {**good, shard: bytes(bad)}))
    cand = peer.choose(key)
    assert cand.step == 4 and any(shard in p and "corrupted" in p for p in cand.problems), cand.problems
    ray.get(store.put.remote(part1, good))

    # resumed at one rank: from memory (step 6, newer than storage's 4), resharded, the same losses
    (b,) = run_distributed(pw.train, 1, address, run, None, [], timeout=300)
    assert b["resumed"]["source"] == "memory" and b["resumed"]["step"] == 6 and b["steps"] == 12, b["resumed"]
    got, want = pw.losses(run), pw.losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 13))
    # float64: only the order of the sums over ranks and samples differs (2 ranks against 1): a few ulps of a
    # loss near 1.4 compounded over 12 steps of Adam stays far below 1e-9 relative
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=1e-9, abs_tol=0), (step, got[step], want[step])
    assert not peer.live_stores(key)  # freed at the end


def test_the_default_is_on_for_elastic_ray_runs_and_an_explicit_k_needs_ray():
    from dutycycle.engine.errors import ConfigError
    from dutycycle.trainer.checkpoint.peer import DEFAULT_EVERY, resolve_every
    from dutycycle.trainer.config import load_config

    def cfg(*extra):
        return load_config(None, ["data.source=synthetic", "data.global_batch_size=96", *extra])

    assert resolve_every(cfg("parallel.num_workers=[2, 3]"), under_ray=True) == DEFAULT_EVERY == 5
    assert resolve_every(cfg("parallel.num_workers=[2, 3]"), under_ray=False) == 0  # --local, torchrun: none
    assert resolve_every(cfg("parallel.num_workers=3", "ray.max_failures=2"), under_ray=True) == 0
    assert resolve_every(cfg("checkpoint.memory_every=2"), under_ray=True) == 2
    with pytest.raises(ConfigError, match=r"checkpoint.memory_every = 2 keeps the state in Ray actors"):
        resolve_every(cfg("checkpoint.memory_every=2"), under_ray=False)
    with pytest.raises(ConfigError, match=r"checkpoint.memory_every = -1 must be a number of steps >= 0"):
        cfg("checkpoint.memory_every=-1")
