"""The global batch at every size of an elastic run, checked at config time (trainer/config_batch.py), the
config a worker takes at the size it runs at (``resolve_for_world``), the default canonical partitions
(``loader.plan.default_partitions``) and uneven micro-batches weighted into the global mean. No processes: the
runs at several sizes are tests/trainer/test_elastic_step.py."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import ArrayLoader, LoaderConfig
from dutycycle.loader.plan import default_partitions
from dutycycle.trainer.cluster.world import World
from dutycycle.trainer.config import ParallelSection, load_config, resolve_for_world
from dutycycle.trainer.config_batch import keep_run_partitions, micro_batch_size
from dutycycle.trainer.parallel.apply import parallelize
from dutycycle.trainer.step.loop import forward_backward

SYN = ["data.source=synthetic"]


def test_a_global_batch_that_does_not_split_at_some_size_is_refused_naming_the_sizes_that_work():
    with pytest.raises(ConfigError) as e:
        load_config(None, [*SYN, "parallel.num_workers=[2,4]", "data.global_batch_size=128"])
    msg = str(e.value)
    assert "data.global_batch_size = 128" in msg and "at 3 (128 samples do not split evenly over 3 workers)" in msg
    assert "it splits at 2, 4 workers" in msg and "[4, 4]" in msg and "120 or 132 (multiples of 12)" in msg
    load_config(None, [*SYN, "parallel.num_workers=[2,4]", "data.global_batch_size=120"])  # the suggestion works
    # a fixed size keeps its message
    with pytest.raises(ConfigError, match="does not split evenly over parallel.num_workers = 3"):
        load_config(None, [*SYN, "parallel.num_workers=3", "data.global_batch_size=128"])


def test_micro_batches_and_layouts_are_checked_at_every_size():
    with pytest.raises(ConfigError, match="data.micro_batches = 5 is more than the 4 samples"):
        load_config(None, [*SYN, "parallel.num_workers=[2,3]", "data.global_batch_size=12", "data.micro_batches=5"])
    # uneven micro-batches are allowed: 4 samples in 3 (2, 1, 1)
    load_config(None, [*SYN, "parallel.num_workers=[2,3]", "data.global_batch_size=12", "data.micro_batches=3"])
    with pytest.raises(ConfigError, match=r"parallel.num_workers = \[1, 4\] cannot train at 2 of its sizes "
                                          r"\(1, 3\); at 1 workers: parallel.node_size = 2 must divide"):
        load_config(None, [*SYN, "parallel.num_workers=[1,4]", "parallel.node_size=2"])


def test_a_worker_resolves_the_config_at_its_size():
    cfg = load_config(None, ["data.cache=/c", "parallel.num_workers=[2,4]", "data.global_batch_size=24",
                             "data.micro_batches=2"])
    assert micro_batch_size(cfg) == 3  # 24 / 4 workers / 2
    at = {w: resolve_for_world(cfg, w) for w in (2, 3, 4)}
    # 12, 8, 6 samples per worker in micro-batches of at most 3
    assert {w: c.data.micro_batches for w, c in at.items()} == {2: 4, 3: 3, 4: 2}
    assert all(c.parallel.num_workers == w and c.parallel.min_workers == 0 for w, c in at.items())
    assert {c.data.partitions for c in at.values()} == {12}  # lcm(2, 3, 4): the run's plan at every size
    assert {c.data.global_batch_size for c in at.values()} == {24}
    with pytest.raises(ConfigError, match=r"5 workers is outside parallel.num_workers = \[2, 4\]"):
        resolve_for_world(cfg, 5)
    fixed = load_config(None, [*SYN, "parallel.num_workers=2"])
    assert resolve_for_world(fixed, 2) is fixed


def test_default_partitions_follow_the_sizes_a_run_may_take():
    assert [default_partitions(s, 128) for s in ([1], [4], [2, 3], [2, 3, 4])] == [1, 4, 6, 12]
    # lcm(1..16) = 720720 > 64: the multiple of 16 within the batch that the most sizes divide
    assert default_partitions(range(1, 17), 64) == 48
    cfg = load_config(None, ["data.cache=/c", "parallel.num_workers=[2,3]", "data.global_batch_size=12"])
    assert cfg.data.partitions == 6 and cfg.to_dict()["data"]["partitions"] == 6  # recorded in config.json
    assert load_config(None, ["data.cache=/c"]).data.partitions == 1  # one worker: the plain shuffle, as before
    synthetic = load_config(None, [*SYN, "parallel.num_workers=[2,3]", "data.global_batch_size=12"])
    assert synthetic.data.partitions == 1  # arrays in memory
    assert load_config(None, [*SYN, "parallel.num_workers=2", "data.partitions=3"]).data.partitions == 3
    # a Loader given 0 sizes it for its own world
    images, labels = np.zeros((48, 4, 4, 3), np.uint8), np.zeros(48, np.int64)
    loader = ArrayLoader(images, labels, 1, 4, LoaderConfig(global_batch_size=8, partitions=0, mode="sync"))
    assert loader.config.partitions == 4 and loader.state_dict()["partitions"] == 4


def test_a_resume_with_the_default_partitions_keeps_the_runs_count():
    cfg = load_config(None, ["data.cache=/c", "parallel.num_workers=2"])
    assert keep_run_partitions(cfg, {"data": {"partitions": 1}}) == 1 and cfg.data.partitions == 1
    mine = load_config(None, ["data.cache=/c", "parallel.num_workers=2", "data.partitions=4"])
    assert keep_run_partitions(mine, {"data": {"partitions": 1}}) is None and mine.data.partitions == 4


def test_uneven_micro_batches_train_the_global_mean():
    """4 samples in 3 micro-batches (2, 1, 1), each weighted by its share: the gradient of the mean over the 4,
    as one micro-batch gives it, within float64 rounding (a few 1e-16 relative)."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    grads = {}
    for m in (1, 3):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
        strategy = parallelize(model, ParallelSection(), World(0, 1), device=torch.device("cpu"), precision="fp64",
                               micro_batches=m)
        loss = forward_backward(strategy, x, y, m, contextlib.nullcontext)
        grads[m] = (float(loss), torch.cat([p.grad.reshape(-1) for p in strategy.module.parameters()]))
    assert grads[3][0] == pytest.approx(grads[1][0], rel=1e-14)
    assert torch.allclose(grads[3][1], grads[1][1], rtol=1e-13, atol=1e-16)


def test_the_loader_resumes_a_partitioned_plan_across_a_shrink_and_a_grow_mid_epoch():
    """The default partitions of [2, 3] (6) on 96 samples, global batch 12: 3 loaders to step 3, their state
    loaded by 2 loaders to step 6, then by 3 to the end. Each step's global batch is the plan's, in order, and
    the epoch holds every sample once."""
    from dutycycle.loader.plan import plan_epoch

    images, labels = np.zeros((96, 2, 2, 3), np.uint8), np.arange(96) % 4
    config = LoaderConfig(global_batch_size=12, partitions=default_partitions([2, 3], 12), mode="sync", window=16,
                          block_size=4, seed=3)
    state, got = None, []
    for world, stop in ((3, 3), (2, 6), (3, 8)):
        loaders = [ArrayLoader(images, labels, r, world, config, fingerprint="f") for r in range(world)]
        iters = []
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
            iters.append(iter(loader))
        while len(got) < stop:
            got.append([int(i) for it in iters for i in next(it)["sample_id"]])
        state = loaders[0].state_dict()
        assert state["partitions"] == 6 and (state["epoch"], state["step"]) == ((0, stop) if stop < 8 else (1, 0))
    want = [b.tolist() for b in plan_epoch(96, 3, 0, "f", 12, True, block_size=4, window=16, partitions=6)]
    assert got == want
    assert sorted(i for b in got for i in b) == list(range(96))
