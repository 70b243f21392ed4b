"""Fixtures shared by the trainer's test modules."""

from __future__ import annotations

import pytest

from ..support.harness import run_calls


@pytest.fixture(scope="session")
def four_ranks_shared(tmp_path_factory):
    """The 4-rank workloads of test_hybrid.py and test_tensor.py in one set of spawned ranks (five spawns of 4
    Pythons with torch before; measured here, the two files: 309 s and 233 s of CPU before, 232 s and 135 s
    after). The checkpoint round trips run first: the through-the-loop workloads report nodes a, b, a, b, where
    hybrid groups of consecutive ranks would be refused (the harness restores the environment after each
    workload anyway)."""
    root = tmp_path_factory.mktemp("four-ranks")
    calls = [("hybrid round trip", "tests.support.ckpt_worker:hybrid_round_trip", (str(root / "hybrid"),)),
             ("tensor round trip", "tests.support.tensor_worker:round_trip", (str(root / "tensor"),)),
             ("hybrid", "tests.trainer.test_hybrid:_worker", ()),
             ("tensor", "tests.trainer.test_tensor:_worker", ()),  # every config
             ("tensor loop", "tests.trainer.test_tensor:_through_the_loop", ())]
    return root, run_calls(4, calls, timeout=900)

