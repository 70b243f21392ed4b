"""The commit protocol and what it refuses: manifests with checksums, fallback from corrupted or truncated files
(naming them), torn and hand-made directories, names that leave the directory, pickles never loaded, retention,
snapshot consistency with a slow stager, config validation, the health check and Ray Train pointers."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch
from dutycycle.engine import sealed
from dutycycle.engine.errors import ConfigError, CorruptArtifactError, DestinationError
from dutycycle.trainer.checkpoint import find_latest
from dutycycle.trainer.checkpoint import manifest as mf
from dutycycle.trainer.checkpoint.resume import CheckpointWarning, select
from dutycycle.trainer.checkpoint.saver import Saver
from dutycycle.trainer.checkpoint.state import TrainerState, capture_rng
from dutycycle.trainer.checkpoint.storage import read_state

from ..support import ckpt_worker as cw
from ..support.faulty import FaultyMatmul


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.full((32,), float(step))},
            "optim": {"m": torch.randn(64, 32, generator=g), "lr": 0.1 * step, "betas": (0.9, 0.999)}}


def save_steps(root, steps, keep=2, async_save=False) -> Saver:
    saver = Saver(str(root), rank=0, world_size=1, keep=keep, async_save=async_save)
    for step in steps:
        saver.save(step, state_for(step), TrainerState(step=step, epoch=0, loader={}, rng=[], world_size=1),
                   capture_rng())
        saver.wait()
    saver.close()
    return saver


def load(sel) -> dict:
    want = state_for(sel.step)
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
           "optim": {"m": torch.zeros(64, 32), "lr": 0.0, "betas": (0.0, 0.0)}}
    read_state(got, sel.uri, set(sel.manifest.files))
    return got


def test_a_commit_holds_every_file_with_size_and_checksum_and_loads_exactly(tmp_path):
    save_steps(tmp_path, [1, 2], async_save=True)
    sel = find_latest(str(tmp_path))
    assert sel.step == 2 and sel.fallbacks == []
    names = set(os.listdir(tmp_path / "step-00000002"))
    assert names == {"__0_0.distcp", ".metadata", "metadata.json", "trainer_state.json", "manifest.json"}
    for name, rec in sel.manifest.files.items():  # checksums taken while writing match the files on disk
        assert mf.file_digest(str(tmp_path / "step-00000002" / name)) == rec and "blake3" in rec.to_json()
    got, want = load(sel), state_for(2)
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    assert got["optim"]["lr"] == pytest.approx(0.2) and tuple(got["optim"]["betas"]) == (0.9, 0.999)


def test_saves_reuse_dcps_plans_per_saver_and_each_commit_holds_its_own_values(tmp_path):
    """From the second save on, DCP reuses the first save's plans (kept under this Saver's own key, dropped on
    close); values are still read at each save (the step's lr), and a save whose tensors differ is planned anew."""
    from torch.distributed.checkpoint.planner import SavePlanner

    saver = Saver(str(tmp_path), rank=0, world_size=1, keep=5, async_save=True)
    other = Saver(str(tmp_path / "other"), rank=0, world_size=1, keep=2, async_save=False)
    assert saver.plan_cache != other.plan_cache

    def save(step, state):
        saver.save(step, state, TrainerState(step=step, epoch=0, loader={}, rng=[], world_size=1), capture_rng())
        saver.wait()

    save(1, state_for(1))
    planned = SavePlanner._cached_metadata[saver.plan_cache]
    save(2, state_for(2))
    assert SavePlanner._cached_metadata[saver.plan_cache] is planned  # the same plan: not made again
    grown = state_for(3)
    grown["model"]["extra"] = torch.arange(5.0)
    save(3, grown)
    assert SavePlanner._cached_metadata[saver.plan_cache] is not planned  # a new tensor: planned anew
    assert "model.extra" in SavePlanner._cached_metadata[saver.plan_cache].state_dict_metadata
    for step, want in ((2, state_for(2)), (3, grown)):
        sel = select(str(tmp_path / mf.step_name(step)), rank=0, world=1)
        got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
               "optim": {"m": torch.zeros(64, 32), "lr": 0.0, "betas": (0.0, 0.0)}}
        read_state(got, sel.uri, set(sel.manifest.files))
        assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
        assert torch.equal(got["optim"]["m"], want["optim"]["m"]) and got["optim"]["lr"] == pytest.approx(0.1 * step)
    saver.close()
    other.close()
    assert saver.plan_cache not in SavePlanner._cached_metadata


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice values are a Linux feature")
def test_the_background_save_thread_runs_below_training_and_the_default_lowers_it():
    """The write, checksums and commit run ``background_nice`` steps below the training thread (the config's
    default: 10), which keeps its own priority."""
    import threading

    from dutycycle.trainer.config import CheckpointSection

    assert CheckpointSection().background_nice == 10
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    saver = Saver("memory://nice", rank=0, world_size=1, keep=2, async_save=True,
                  background_nice=CheckpointSection().background_nice)
    try:
        theirs = saver.pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    finally:
        saver.close()
    assert theirs == min(19, mine + 10)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


@pytest.mark.parametrize("damage, words", [
    ("flip", "__0_0.distcp has blake3"), ("truncate", "__0_0.distcp is"), ("missing", "__0_0.distcp is missing"),
    ("manifest", "manifest.json is not valid JSON"), ("trainer_state", "trainer_state.json has blake3"),
])
def test_a_damaged_commit_falls_back_to_the_previous_one_naming_the_file(tmp_path, damage, words):
    save_steps(tmp_path, [1, 2, 3], keep=3)
    newest = tmp_path / "step-00000003"
    target = newest / ("trainer_state.json" if damage == "trainer_state" else "__0_0.distcp")
    if damage == "flip":  # 64 bytes flipped in the middle of a tensor: DCP alone would load a wrong tensor
        data = bytearray(target.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "missing":
        target.unlink()
    elif damage == "manifest":
        (newest / "manifest.json").write_text('{"format": 1, "files": {')
    else:
        target.write_text(target.read_text().replace('"step": 3', '"step": 9'))
    with pytest.warns(CheckpointWarning, match=words):
        sel = find_latest(str(tmp_path))
    assert sel.step == 2 and len(sel.fallbacks) == 1 and "step-00000003" in sel.fallbacks[0]
    got = load(sel)
    assert torch.equal(got["model"]["w"], state_for(2)["model"]["w"])
    # asked for by name, the damaged checkpoint is refused outright, naming the file
    from dutycycle.trainer.checkpoint.resume import select

    with pytest.raises(CorruptArtifactError, match=words.split(" ")[0]):
        select(str(newest), 0, 1)


def test_torn_and_hand_made_directories_are_ignored(tmp_path):
    save_steps(tmp_path, [4])
    (tmp_path / "step-00000009").mkdir()  # a save killed before its manifest
    (tmp_path / "step-00000009" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "step-00000010").mkdir()  # hand-made, with DCP's own index but no manifest
    (tmp_path / "step-00000010" / ".metadata").write_bytes(b"junk")
    (tmp_path / "notes").mkdir()
    (tmp_path / "step-7").write_text("a file, not a step directory")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ignored quietly: they never were checkpoints
        sel = find_latest(str(tmp_path))
    assert sel.step == 4
    assert find_latest(str(tmp_path / "nowhere")) is None


def test_names_outside_the_directory_are_refused(tmp_path):
    save_steps(tmp_path, [1, 2])
    newest = tmp_path / "step-00000002"
    data = json.loads((newest / "manifest.json").read_text())
    data["files"]["../step-00000001/__0_0.distcp"] = data["files"]["__0_0.distcp"]
    data[mf.DIGEST] = sealed.digest(data, mf.DIGEST)  # a writer that can rewrite the manifest can redo its checksum
    (newest / "manifest.json").write_text(json.dumps(data))
    with pytest.warns(CheckpointWarning, match=r"names the file '\.\./step-00000001/__0_0\.distcp'"):
        assert find_latest(str(tmp_path)).step == 1
    # DCP's index may only point at files the manifest lists
    (newest / "manifest.json").unlink()
    save_steps(tmp_path, [3])
    meta = tmp_path / "step-00000003" / "metadata.json"
    index = json.loads(meta.read_text())
    index["storage"][0]["file"] = "elsewhere.distcp"
    _rewrite(tmp_path / "step-00000003", "metadata.json", json.dumps(index).encode())
    sel = find_latest(str(tmp_path))
    assert sel.step == 3
    with pytest.raises(CorruptArtifactError, match="elsewhere.distcp"):
        load(sel)


def test_a_manifest_changed_after_its_commit_or_in_another_step_directory_is_refused(tmp_path):
    """The manifest carries a sha256 of its own content: a changed size, step or timing is refused naming it (the
    files it lists still verify, so nothing else would notice a changed timing). A manifest whose step is not its
    directory's is refused even with a matching checksum."""
    save_steps(tmp_path, [1, 2])
    newest = tmp_path / "step-00000002" / "manifest.json"
    data = json.loads(newest.read_text())
    assert data[mf.DIGEST] == sealed.digest(data, mf.DIGEST)
    newest.write_text(json.dumps(dict(data, created=data["created"] + 1.0), indent=2))
    with pytest.warns(CheckpointWarning, match=r"step-00000002/manifest.json fails its own checksum"):
        assert find_latest(str(tmp_path)).step == 1
    moved = dict(data, step=7)
    moved[mf.DIGEST] = sealed.digest(moved, mf.DIGEST)
    newest.write_text(json.dumps(moved))
    with pytest.warns(CheckpointWarning, match=r"manifest.json says step 7 but lies in the directory of step 2"):
        assert find_latest(str(tmp_path)).step == 1
    unsealed = {k: v for k, v in data.items() if k != mf.DIGEST}  # a manifest without its checksum is refused
    newest.write_text(json.dumps(unsealed))
    with pytest.warns(CheckpointWarning, match=r"step-00000002/manifest.json has no checksum"):
        assert find_latest(str(tmp_path)).step == 1


def _rewrite(step_dir, name: str, data: bytes) -> None:
    """Replace a file and record it in the manifest, as a writer with access to both could."""
    (step_dir / name).write_bytes(data)
    m = json.loads((step_dir / "manifest.json").read_text())
    m["files"][name] = {"size": len(data), "blake3": mf.hasher().update(data).hexdigest()}
    m[mf.DIGEST] = sealed.digest(m, mf.DIGEST)
    (step_dir / "manifest.json").write_text(json.dumps(m))


class _Boom:
    def __reduce__(self):
        return (open, ("/tmp/dutycycle-pickle-ran", "w"))


def test_loading_never_unpickles(tmp_path):
    """DCP's .metadata is a pickle: replaced by one that would create a file when unpickled (and recorded in the
    manifest, so verification passes), the load still works from metadata.json and runs nothing."""
    marker = "/tmp/dutycycle-pickle-ran"
    if os.path.exists(marker):
        os.unlink(marker)
    save_steps(tmp_path, [1])
    _rewrite(tmp_path / "step-00000001", ".metadata", pickle.dumps(_Boom()))
    got = load(find_latest(str(tmp_path)))
    assert torch.equal(got["model"]["w"], state_for(1)["model"]["w"])
    assert not os.path.exists(marker)


def test_non_tensor_values_load_without_unpickling_code(tmp_path):
    """DCP's default load planner unpickles non-tensor values (optimizer hyperparameters) with the weights-only
    guard off: a value that runs code when unpickled, saved as a hyperparameter, is refused by dutycycle's planner
    with an error naming the checkpoint, and runs nothing (this fails if storage._SafeLoadPlanner is removed)."""
    marker = "/tmp/dutycycle-pickle-ran"
    if os.path.exists(marker):
        os.unlink(marker)
    state = state_for(1)
    state["optim"]["evil"] = _Boom()
    saver = Saver(str(tmp_path), rank=0, world_size=1, keep=2, async_save=False)
    saver.save(1, state, TrainerState(step=1, epoch=0, loader={}, rng=[], world_size=1), capture_rng())
    saver.wait()
    saver.close()
    sel = find_latest(str(tmp_path))
    got = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
           "optim": {"m": torch.zeros(64, 32), "lr": 0.0, "betas": (0.0, 0.0), "evil": None}}
    with pytest.raises(CorruptArtifactError, match="step-00000001"):
        read_state(got, sel.uri, set(sel.manifest.files))
    assert not os.path.exists(marker)


def test_metadata_json_round_trips_dcps_index(tmp_path):
    from dutycycle.trainer.checkpoint.storage import metadata_from_json, metadata_to_json
    from torch.distributed.checkpoint import FileSystemReader

    save_steps(tmp_path, [1])
    original = FileSystemReader(str(tmp_path / "step-00000001")).read_metadata()  # DCP's own reader: a pickle
    again = metadata_from_json(json.loads(json.dumps(metadata_to_json(original))), "x")
    assert again.state_dict_metadata == original.state_dict_metadata
    assert again.storage_data == original.storage_data
    assert {k: tuple(v) for k, v in again.planner_data.items()} == original.planner_data


def test_every_index_is_fsynced_with_all_its_bytes_before_write_state_returns(tmp_path, monkeypatch):
    """A real dcp save through write_state on a local disk: os.fsync is wrapped only to record which file each
    descriptor names and how many of its bytes were on disk then. metadata.json must be fsynced (it was not), and
    so must .metadata with all its bytes (DCP fsynced its buffered file before the pickle left the buffer)."""
    from dutycycle.trainer.checkpoint.storage import write_state

    real_fsync, synced = os.fsync, {}

    def recording_fsync(fd):
        synced[os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))] = os.fstat(fd).st_size
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    records = write_state(state_for(3), str(tmp_path / "ck"))
    monkeypatch.undo()
    on_disk = {f: os.path.getsize(tmp_path / "ck" / f) for f in os.listdir(tmp_path / "ck")}
    assert mf.METADATA_JSON in records and synced.get(mf.METADATA_JSON) == on_disk[mf.METADATA_JSON] > 0
    assert synced.get(".metadata.tmp") == on_disk[".metadata"] > 0
    for name, size in on_disk.items():
        if name.endswith(".distcp"):
            assert synced.get(name) == size


def test_a_commit_is_durable_files_then_the_step_directory_then_the_manifest_then_the_root(tmp_path, monkeypatch):
    """Durable commits on a local disk. A power cut cannot be simulated here (nor is strace installed), so the
    test observes the calls that make a commit survive one, in the order the protocol needs them: os.fsync is
    wrapped to record the path each descriptor names, and os.replace / os.rename / os.remove / os.unlink to place
    renames and removals in the same sequence (each call goes on to the real one). Every file of a commit is
    fsynced (under its name, or a temporary name renamed to it) and renamed before the step directory is
    fsynced; that is before the manifest is renamed into place; after it, the step directory, the root and the
    root's parent are fsynced. A retention removal syncs the step directory right after removing its manifest,
    before any of its files goes."""
    events: list[tuple] = []
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename", "remove", "unlink")}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real["fsync"](fd)

    def moving(name):
        def call(src, dst, *args, **kwargs):
            events.append(("rename", os.fspath(src), os.fspath(dst)))
            return real[name](src, dst, *args, **kwargs)
        return call

    def removing(name):
        def call(path, *args, **kwargs):
            events.append(("remove", os.fspath(path)))
            return real[name](path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "fsync", fsync)
    for name in ("replace", "rename"):
        monkeypatch.setattr(os, name, moving(name))
    for name in ("remove", "unlink"):
        monkeypatch.setattr(os, name, removing(name))
    save_steps(tmp_path, [1, 2], keep=1)  # the second save's retention removes the first
    monkeypatch.undo()

    root = os.path.realpath(tmp_path)
    step = os.path.join(root, "step-00000002")
    manifest = os.path.join(step, mf.MANIFEST)
    ev = events[next(i for i, e in enumerate(events) if step in " ".join(e[1:])):]  # the second save's
    commit = next(i for i, e in enumerate(ev) if e[0] == "rename" and e[2] == manifest)
    synced = {e[1]: i for i, e in enumerate(ev[:commit]) if e[0] == "fsync"}  # path -> its last fsync before
    renamed = {e[2]: (i, e[1]) for i, e in enumerate(ev[:commit]) if e[0] == "rename"}
    assert step in synced, "the step directory is not fsynced before the manifest names its files"
    for name in sorted(set(os.listdir(step)) - {mf.MANIFEST}):
        path = os.path.join(step, name)
        at, src = renamed.get(path, (-1, path))
        assert src in synced, f"{name} is not fsynced before the commit"
        assert max(synced[src], at) < synced[step], f"{name} is fsynced or renamed after its directory"
    assert ev[commit][1] in synced, "the manifest's bytes are not fsynced before its rename"
    after = [e[1] for e in ev[commit:] if e[0] == "fsync"]
    for directory in (step, root, os.path.dirname(root)):  # the commit's name, the step's, the root's
        assert directory in after, f"{directory} is not fsynced after the manifest's rename"

    old = os.path.join(root, "step-00000001")
    gone = next(i for i, e in enumerate(events) if e == ("remove", os.path.join(old, mf.MANIFEST)))
    assert events[gone + 1] == ("fsync", old), events[gone:gone + 3]
    assert not os.path.exists(old)


def test_retention_keeps_the_newest_k_and_clears_torn_directories(tmp_path):
    (tmp_path / "step-00000002").mkdir(parents=True)  # torn, older than what comes
    (tmp_path / "step-00000099").mkdir()  # torn, newer: left alone
    save_steps(tmp_path, [1, 3, 5, 7], keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000005", "step-00000007", "step-00000099"]
    assert mf.retention(str(tmp_path), 2, 7) == []


def test_the_optimizer_waits_for_a_slow_snapshot_and_the_wait_is_stall(tmp_path, monkeypatch):
    """An asynchronous snapshot that copies slowly (1 s, far longer than a step of this model) while training goes
    on: the next optimizer step waits for it (otherwise the commit would hold a later state: resumed weights would
    differ), and the wait shows as checkpoint time (saves at steps 4 and 8 make steps 5 and 9 wait; the last
    save's copy is waited for after the last step)."""
    import time

    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    a = cw.train(cw.small_cfg(tmp_path / "a", "run.max_steps=10"))
    slow = StateDictStager.stage

    def stage(self, *args, **kwargs):
        time.sleep(1.0)
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(StateDictStager, "stage", stage)
    b = cw.train(cw.small_cfg(tmp_path / "b", "run.max_steps=10", "checkpoint.every=4"))
    assert b["checkpoint"]["committed"] == [4, 8, 10]
    assert b["time_breakdown"]["seconds"]["checkpoint"] >= 2 * 0.7
    # one name, one number: the checkpointer's stall is the loop's "checkpoint" phase (one rank: its mean), up to
    # the few microseconds between the timer's clock reads and the save call's
    assert b["checkpoint"]["stall_s"]["total"] == pytest.approx(b["time_breakdown"]["seconds"]["checkpoint"],
                                                                abs=5e-3)
    monkeypatch.setattr(StateDictStager, "stage", slow)
    (tmp_path / "b" / "checkpoints" / "step-00000010" / "manifest.json").unlink()  # resume from step 8
    c = cw.train(cw.small_cfg(tmp_path / "b", "run.max_steps=10", "checkpoint.every=4"))
    assert c["checkpoint"]["resumed"]["step"] == 8
    assert c["weights_sha256"] == a["weights_sha256"]


def test_a_failed_background_save_is_raised_naming_the_location(tmp_path):
    (tmp_path / "file").write_text("a file where the checkpoint directory should be")
    with pytest.raises(DestinationError, match="could not be saved|could not clear"):
        cw.train(cw.small_cfg(tmp_path / "run", f"checkpoint.dir={tmp_path / 'file' / 'ckpt'}"))


def test_a_checkpoint_of_another_model_is_refused_naming_the_key(tmp_path):
    cw.train(cw.small_cfg(tmp_path / "run", "run.max_steps=4"))
    with pytest.raises(ConfigError, match=r"model\.width = 8, this run has 16"):
        cw.train(cw.small_cfg(tmp_path / "run", "run.max_steps=8", "model.width=16"))
    fresh = cw.train(cw.small_cfg(tmp_path / "run", "run.max_steps=4", "model.width=16",
                                  "checkpoint.resume=none", "checkpoint.dir=" + str(tmp_path / "other")))
    assert fresh["checkpoint"]["resumed"] is None


@pytest.mark.parametrize("override, key", [
    ("checkpoint.keep=1", "checkpoint.keep"), ("checkpoint.every=-1", "checkpoint.every"),
    ("checkpoint.on_nonfinite=ignore", "checkpoint.on_nonfinite"), ("ray.max_failures=-2", "ray.max_failures"),
    ("checkpoint.resume=", "checkpoint.resume"), ("run.health_timeout_s=0", "run.health_timeout_s"),
    ("checkpoint.max_rollbacks=-1", "checkpoint.max_rollbacks"),
    ("checkpoint.background_nice=20", "checkpoint.background_nice"),
    ("checkpoint.dir=memory://ck --set checkpoint.every=2 --set parallel.num_workers=2", "checkpoint.dir"),
])
def test_bad_checkpoint_config_names_the_key(override, key):
    from dutycycle.trainer.config import load_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["data.source=synthetic", *override.split(" --set ")])


def test_health_check_names_a_wrong_or_slow_device(tmp_path):
    from dutycycle.trainer.cluster import health

    records = health.preflight(0, 1, torch.device("cpu"), 30.0, str(tmp_path))
    assert records[0]["problems"] == [] and records[0]["matmul_max_error"] < 1e-3
    assert json.loads((tmp_path / "health.json").read_text())["workers"][0]["pid"] == os.getpid()
    with pytest.raises(health.HealthCheckError, match=r"rank 0 .*matmul took"):
        health.preflight(0, 1, torch.device("cpu"), 1e-9)
    wrong_row = FaultyMatmul(lambda c: c.index_fill_(0, torch.tensor([3]), 0.0))
    with wrong_row, pytest.raises(health.HealthCheckError, match=r"matmul wrong in \d+ of 65536 entries"):
        health.preflight(0, 1, torch.device("cpu"), 30.0)


def test_ray_train_pointer_resolves_to_the_commit(tmp_path):
    from dutycycle.trainer.checkpoint import checkpoint_uri
    from dutycycle.trainer.checkpoint.raytrain import POINTER
    from ray.train import Checkpoint

    commit = tmp_path / "run" / "checkpoints" / "step-00000008"
    commit.mkdir(parents=True)
    (commit / "manifest.json").write_text("{}")
    pointer = tmp_path / "pointer"
    pointer.mkdir()
    (pointer / POINTER).write_text(json.dumps({"format": 1, "uri": str(commit), "step": 8}))
    assert checkpoint_uri(Checkpoint.from_directory(str(pointer))) == {"uri": str(commit), "step": 8}
    (pointer / POINTER).unlink()
    assert checkpoint_uri(Checkpoint.from_directory(str(pointer))) is None


def test_checkpoint_async_is_accepted_as_a_key(tmp_path):
    """``async`` is a Python keyword, so the field is ``async_save``; the natural key works in TOML and --set."""
    from dutycycle.trainer.config import load_config

    assert load_config(None, ["data.source=synthetic", "checkpoint.async=false"]).checkpoint.async_save is False
    path = tmp_path / "c.toml"
    path.write_text('[data]\nsource = "synthetic"\n[checkpoint]\nasync = false\nevery = 3\n')
    cfg = load_config(str(path))
    assert cfg.checkpoint.async_save is False and cfg.checkpoint.every == 3


def test_a_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    save_steps(tmp_path / "ckpt", [1, 2])
    shard = tmp_path / "ckpt" / "step-00000002" / "__0_0.distcp"
    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes(shard.read_bytes())  # same bytes, so only the link's target can give it away
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.warns(CheckpointWarning, match="through a symlink"):
        assert find_latest(str(tmp_path / "ckpt")).step == 1
