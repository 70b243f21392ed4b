"""Fixtures shared by the trainer's test modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..support import REPO
from ..support import multinode as mn
from ..support.cachemaker import make_cache
from ..support.harness import run_calls


@pytest.fixture(scope="session")
def four_ranks_shared(tmp_path_factory):
    """The 4-rank workloads of test_hybrid.py and test_tensor.py in one set of spawned ranks (five spawns of 4
    Pythons with torch before: the two files took 242 s of CPU, 166 s with the spawns shared, measured here). The checkpoint round trips run first: the
    through-the-loop workloads report nodes a, b, a, b, where hybrid groups of consecutive ranks would be refused
    (the harness restores the environment after each workload anyway)."""
    root = tmp_path_factory.mktemp("four-ranks")
    calls = [("hybrid round trip", "tests.support.ckpt_worker:hybrid_round_trip", (str(root / "hybrid"),)),
             ("tensor round trip", "tests.support.tensor_worker:round_trip", (str(root / "tensor"),)),
             ("hybrid", "tests.trainer.test_hybrid:_worker", ()),
             ("tensor", "tests.trainer.test_tensor:_worker", ()),  # every config
             ("tensor loop", "tests.trainer.test_tensor:_through_the_loop", ())]
    return root, run_calls(4, calls, timeout=900)


@pytest.fixture(scope="session")
def multinode(tmp_path_factory):
    """test_placement.py's and test_two_nodes.py's runs on one local multi-node Ray cluster (tests/support/
    multinode.py), started once in a child process: ``(the two-node cache, {"placement": ..., "two_nodes": ...})``."""
    root = tmp_path_factory.mktemp("multinode")
    cache = str(root / "cache")
    make_cache(cache, mn.SAMPLES, shape=(8, 8, 3), shards=mn.SHARDS, splits={"train": 0.75, "val": 0.25})
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", DAFT_ANALYTICS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.support.multinode", str(root), cache], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    return cache, json.loads(line[0][len("RESULT "):])
