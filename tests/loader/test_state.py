"""Loader state that knows its plan: ``state_dict()`` records every plan input and ``format: 1``,
``load_state_dict`` refuses a state whose plan differs (naming the field, the saved value and this loader's),
``force=True`` continues this loader's own plan from the saved position with a warning, a state lacking fields is
refused naming them, a state of another format (or none) is refused naming the format it has, and a round trip
at the same config resumes exactly."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from dutycycle.engine.errors import ConfigError, CorruptArtifactError
from dutycycle.loader import ArrayLoader, AugmentConfig, CacheLoader, LoaderConfig
from dutycycle.loader import plan as loader_plan
from dutycycle.loader.plan import PLAN_VERSION
from dutycycle.loader.state import PLAN_FIELDS, STATE_FORMAT

from ..support.cachemaker import make_cache
from .test_loader import as_arrays, assert_same, take

# the shared ``cache`` fixture is tests/loader/conftest.py's

N = 96  # samples of the array split: 6 global batches of 16 with the base config
IMAGES = np.stack([np.full((4, 4, 3), i % 256, np.uint8) for i in range(N + 8)])
LABELS = np.arange(N + 8) % 3


def config(**kw) -> LoaderConfig:
    base = dict(global_batch_size=16, seed=3, mode="sync", block_size=8, window=32,
                augment=AugmentConfig(flip=True, normalize=False))
    return LoaderConfig(**{**base, **kw})


def arrays(n: int = N, fingerprint: str = "arrays-v1", rank: int = 0, world_size: int = 1, **kw) -> ArrayLoader:
    return ArrayLoader(IMAGES[:n], LABELS[:n], rank, world_size, config(**kw), fingerprint=fingerprint)


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    """A cache whose two splits have the same number of samples, so only the split name tells them apart."""
    uri = str(tmp_path_factory.mktemp("state") / "cache")
    make_cache(uri, 64, shape=(4, 4, 3), shards=2, splits={"a": 0.5, "b": 0.5})
    return uri


def cache_pair(halves, **kw):
    a = CacheLoader(halves, "a", config=config(**kw))
    b = CacheLoader(halves, "b", config=config(**kw))
    assert a.num_samples == b.num_samples  # the split is the only difference
    return a, b


# (field, saving loader, loading loader): the two differ in that plan input only
MISMATCHES = {
    "split": "cache",
    "fingerprint": (lambda: arrays(fingerprint="arrays-v1"), lambda: arrays(fingerprint="arrays-v2")),
    "num_samples": (lambda: arrays(n=N), lambda: arrays(n=N + 8)),
    "seed": (lambda: arrays(seed=3), lambda: arrays(seed=4)),
    "global_batch_size": (lambda: arrays(), lambda: arrays(global_batch_size=32)),
    "drop_last": (lambda: arrays(n=N + 8), lambda: arrays(n=N + 8, drop_last=False)),
    "shuffle": (lambda: arrays(), lambda: arrays(shuffle=False)),
    "block_size": (lambda: arrays(), lambda: arrays(block_size=16)),
    "window": (lambda: arrays(), lambda: arrays(window=64)),
    "partitions": (lambda: arrays(), lambda: arrays(partitions=4)),
    "plan_version": "patched",
}


def saved_and_other(field, halves, monkeypatch):
    """A state saved two batches into epoch 1 by one loader, and a loader that differs from it in ``field``."""
    how = MISMATCHES[field]
    if how == "cache":
        saver, other = cache_pair(halves)
    elif how == "patched":  # a state written by a dutycycle whose plan had another version
        saver, other = arrays(), arrays()
        monkeypatch.setattr(loader_plan, "PLAN_VERSION", PLAN_VERSION + 1)
    else:
        saver, other = how[0](), how[1]()
    saver.set_epoch(1)
    take(saver, 2)
    state = json.loads(json.dumps(saver.state_dict()))  # as a checkpoint stores it
    monkeypatch.setattr(loader_plan, "PLAN_VERSION", PLAN_VERSION)
    return saver, state, other


def test_state_records_every_plan_input(halves):
    loader = CacheLoader(halves, "a", config=config())
    state = loader.state_dict()
    assert set(PLAN_FIELDS) <= set(state)
    assert state["format"] == STATE_FORMAT == 1 and state["plan_version"] == PLAN_VERSION
    assert "sha256" not in state and "version" not in state  # a checkpoint's manifest checksums the file
    assert (state["split"], state["fingerprint"], state["num_samples"]) == ("a", loader.fingerprint, 32)
    assert (state["seed"], state["global_batch_size"], state["drop_last"], state["shuffle"]) == (3, 16, True, True)
    assert (state["block_size"], state["window"]) == (8, 32)
    assert json.loads(json.dumps(state)) == state  # plain JSON
    assert arrays().state_dict()["split"] is None  # arrays are named by their fingerprint


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_each_plan_mismatch_is_refused_naming_the_field(field, halves, monkeypatch):
    saver, state, other = saved_and_other(field, halves, monkeypatch)
    mine = other.state_dict()[field]
    with pytest.raises(ConfigError) as err:
        other.load_state_dict(state)
    msg = str(err.value)
    assert f"{field}={state[field]!r} but this loader has {field}={mine!r}" in msg
    assert "force=True" in msg and "same cache, split and loader config" in msg
    named = set(re.findall(r"(\w+)=\S+ but this loader has", msg))
    assert named == {field}, msg  # only the field that differs
    assert (other.epoch, other.step) == (0, 0)  # nothing loaded


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_force_loads_the_position_and_continues_this_loaders_plan(field, halves, monkeypatch):
    saver, state, other = saved_and_other(field, halves, monkeypatch)
    with pytest.warns(UserWarning, match=f"{field}=.* but this loader has {field}="):
        other.load_state_dict(state, force=True)
    # the split case's epoch has two batches: a state after them is the next epoch's start
    step = min(state["step"], len(other))
    assert (other.epoch, other.step) == (state["epoch"], step) and state["epoch"] in (1, 2)
    # what follows is this loader's own plan (its seed and config) from the saved position
    reference = MISMATCHES[field][1]() if isinstance(MISMATCHES[field], tuple) else None
    if reference is None:
        reference = CacheLoader(halves, "b", config=config()) if field == "split" else arrays()
    reference.set_epoch(state["epoch"])
    take(reference, step)
    assert_same(as_arrays(take(other, 2)), as_arrays(take(reference, 2)))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_round_trip_at_the_same_config_resumes_exactly(cache, world_size):
    cfg = LoaderConfig(global_batch_size=16, seed=7, mode="sync", block_size=4, window=24,
                       augment=AugmentConfig(crop_padding=1, flip=True, normalize=True))
    first = CacheLoader(cache, "train", config=cfg)
    first.set_epoch(2)
    take(first, len(first) - 2)
    state = json.loads(json.dumps(first.state_dict()))
    expected = as_arrays(take(first, 4))  # crosses into epoch 3
    parts = []
    for rank in range(world_size):
        loader = CacheLoader(cache, "train", rank, world_size, cfg)
        loader.load_state_dict(state)
        assert loader.state_dict()["step"] == state["step"]
        parts.append(as_arrays(take(loader, 4)))
    got = [(np.concatenate([p[s][0] for p in parts]), np.concatenate([p[s][1] for p in parts]),
            [i for p in parts for i in p[s][2]]) for s in range(4)]
    assert_same(expected, got)


def test_a_state_missing_plan_fields_is_refused_naming_them():
    """A state lacking some plan inputs is refused, naming each missing field: nothing shows the run used the
    same ones. force=True loads its position."""
    saver = arrays()
    take(saver, 2)
    state = saver.state_dict()
    partial = {k: v for k, v in state.items() if k not in ("block_size", "window", "plan_version")}
    with pytest.raises(ConfigError) as err:
        arrays().load_state_dict(partial)
    msg = str(err.value)
    for field in ("block_size", "window", "plan_version"):
        assert f"{field} is missing (this loader has {field}=" in msg
    assert "format 1 records them all" in msg and "force=True" in msg
    loader = arrays()
    with pytest.warns(UserWarning, match="block_size is missing"):
        loader.load_state_dict(partial, force=True)
    assert (loader.epoch, loader.step) == (0, 2)


@pytest.mark.parametrize("found", [2, 0, "1", None])
def test_a_state_of_another_format_or_none_is_refused_naming_it(found):
    saver = arrays()
    take(saver, 2)
    state = saver.state_dict()
    other = dict(state, format=found) if found is not None else {k: v for k, v in state.items() if k != "format"}
    for force in (False, True):
        with pytest.raises(CorruptArtifactError, match=re.escape(f"loader state has format={found!r}; this "
                                                                 "dutycycle reads loader state format 1 only")):
            arrays().load_state_dict(other, force=force)
    assert issubclass(CorruptArtifactError, ValueError)


def test_fields_outside_the_plan_do_not_stop_a_resume():
    """The state is judged by its format, position and plan inputs; what else it carries is information."""
    saver = arrays()
    take(saver, 2)
    loader = arrays()
    loader.load_state_dict(dict(saver.state_dict(), step=3, world_size=8, extra=1))
    assert (loader.epoch, loader.step) == (0, 3)


@pytest.mark.parametrize("bad, words", [
    ([1, 2], "loader state is a list, not a mapping"),
    ({"epoch": 0, "step": 0}, "loader state has format=None"),
    ("format=2", "loader state has format=2; this dutycycle reads loader state format 1 only"),
    ("epoch=-1", "loader state has epoch=-1"),
    ("step=1.0", "loader state has step=1.0"),
    ("step=True", "loader state has step=True"),
    ("step=99", "loader state has step=99 but an epoch of this plan has 6 steps"),
])
def test_a_malformed_state_is_refused_naming_the_field(bad, words):
    state = arrays().state_dict()
    if isinstance(bad, str):
        key, value = bad.split("=")
        state[key] = json.loads(value.lower()) if value in ("True",) else json.loads(value)
    else:
        state = bad
    with pytest.raises(CorruptArtifactError, match=re.escape(words)):
        arrays().load_state_dict(state)
