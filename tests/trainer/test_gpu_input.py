"""The GPU input path, checked on a CPU: batches that cross to the device as uint8 and are
normalized there (``normalize_on = "device"``) hold the very values the host's float32 path made, bit for bit,
in the loader and in a trainer's losses (fp32 and fp64); the prefetch thread that would start the next batch's
copy hands out every batch once, in order, the last one included, also after a resume mid-epoch; a batch sends
a quarter of the image bytes; and the optimizer takes torch's fused kernel only where it is supported.

The copy itself (pinned memory, a side stream, ``non_blocking``) needs CUDA and is not run here: on a CPU the
trainer's loaders neither pin nor copy (``delivery``), which is today's path, and ``normalize_on = "device"``
normalizes on the CPU after the (absent) copy, which is the arithmetic a GPU runs.
"""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
import torch
from dutycycle.engine.errors import ConfigError
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig
from dutycycle.trainer.config import load_config
from dutycycle.trainer.step import optim as O
from dutycycle.trainer.step.data import delivery
from dutycycle.trainer.step.loop import WorkerContext
from dutycycle.trainer.step.trainer import Trainer

from ..support.cachemaker import make_cache


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns (so -0.0 and 0.0, or two NaNs, are told apart)."""
    return x.contiguous().view(torch.int32 if x.dtype == torch.float32 else torch.int64)


def _pass(loader) -> list[dict]:
    return [{"image": b["image"], "label": b["label"], "ids": list(b["sample_id"])} for b in loader]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["ids"] == y["ids"] and torch.equal(x["label"], y["label"])
        assert y["image"].dtype == torch.float32 and y["image"].is_contiguous()
        assert torch.equal(_bits(x["image"]), _bits(y["image"]))


@pytest.mark.parametrize("layout, shape", [("HWC", (8, 8, 3)), ("CHW", (3, 6, 5))])
def test_device_normalization_matches_the_host_bit_for_bit_in_order_and_on_resume(tmp_path, layout, shape):
    uri = str(tmp_path / "cache")
    make_cache(uri, 70, shape=shape, shards=3, layout=layout)  # 70 = 4 batches of 16 and a last one of 6
    # a prefetch thread collating two batches ahead (what would start the next copies), crop and flip, and the
    # cache's own per-channel statistics as mean and std (not round numbers)
    host_cfg = LoaderConfig(global_batch_size=16, drop_last=False, mode="thread", prefetch=2, seed=3,
                            augment=AugmentConfig(crop_padding=2, flip=True), normalize_on="host")
    dev_cfg = dataclasses.replace(host_cfg, normalize_on="device")
    host, dev = CacheLoader(uri, "train", config=host_cfg), CacheLoader(uri, "train", config=dev_cfg)
    assert (host.normalize_on, dev.normalize_on) == ("host", "device")
    assert dev.background and dev.config.augment.mean == host.config.augment.mean
    assert len(set(host.config.augment.mean)) == 3  # the statistics, one per channel

    want = _pass(host)
    assert [len(b["ids"]) for b in want] == [16, 16, 16, 16, 6]
    got = _pass(dev)
    _same(want, got)  # every batch once, in order, the short last one included
    assert len({i for b in got for i in b["ids"]}) == 70

    # bytes a batch sends host -> device: uint8 images are a quarter of float32 ones (labels: 8 bytes a sample)
    labels = 70 * 8
    assert dev.stats.sent_batches == host.stats.sent_batches == 5
    assert host.stats.sent_bytes == 70 * int(np.prod(shape)) * 4 + labels
    assert dev.stats.sent_bytes == 70 * int(np.prod(shape)) + labels
    assert dev.delivery["bytes_per_batch"] == dev.stats.sent_bytes / 5
    assert dev.delivery["normalize_on"] == "device" and not dev.delivery["pinned"]  # no pinning without CUDA

    # the next epoch, stopped after two batches with the prefetch thread ahead, resumed in another loader
    it = iter(dev)
    first = [next(it) for _ in range(2)]
    state = dev.state_dict()
    assert (state["epoch"], state["step"]) == (1, 2)  # handed out, not prefetched
    del it
    resumed = CacheLoader(uri, "train", config=dev_cfg)
    resumed.load_state_dict(state)
    rest = _pass(resumed)
    _same(_pass(host), [{"image": b["image"], "label": b["label"], "ids": list(b["sample_id"])} for b in first] + rest)
    assert resumed.state_dict()["epoch"] == 2  # the pass ran to the end: the next epoch

    # peek and the eval config normalize the same way
    _same([{**want[0]}], [{"image": (p := CacheLoader(uri, "train", config=dev_cfg).peek())["image"],
                           "label": p["label"], "ids": list(p["sample_id"])}])


def test_normalize_on_is_validated_and_auto_follows_the_device():
    with pytest.raises(ConfigError, match=r"normalize_on='gpu'.*auto, host, device"):
        LoaderConfig(normalize_on="gpu")
    with pytest.raises(ConfigError, match="normalize_on"):
        load_config(None, ["data.normalize_on=gpu"])
    from dutycycle.loader.loader import normalize_where

    assert normalize_where(LoaderConfig()) == "host"  # auto without a device
    assert normalize_where(LoaderConfig(device="cuda:1")) == "device"
    assert normalize_where(LoaderConfig(device="cpu")) == "host"
    assert normalize_where(LoaderConfig(normalize_on="device")) == "device"
    assert normalize_where(LoaderConfig(augment=AugmentConfig(normalize=False), normalize_on="device")) == "off"
    # the trainer's loaders on a CPU: no pinning (it raises without an accelerator), no copy; on CUDA both
    assert delivery(None) == delivery(torch.device("cpu")) == {"device": None, "pin_memory": False}
    assert delivery(torch.device("cuda", 0)) == {"device": torch.device("cuda", 0), "pin_memory": True}


def _cfg(run_dir, cache, *extra):
    return load_config(None, [
        "data.source=cache", f"data.cache={cache}", "data.global_batch_size=16", "data.eval_batch_size=16",
        "data.loader_mode=thread", "data.prefetch=2", "data.augment.crop_padding=2", "data.augment.flip=true",
        "model.width=8", "run.max_steps=6", "run.eval_every=0", "run.log_every=1", f"run.dir={run_dir}",
        "checkpoint.every=0", "parallel.threads_per_worker=1", "optim.warmup_steps=0", *extra])


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_trainer_losses_are_bit_identical_and_resume_mid_epoch(tmp_path, precision):
    """Six steps over 4 steps per epoch: the host path, the device path (its losses and final weights the
    same bits), and the device path stopped at step 3 (mid-epoch, the prefetch thread ahead) and resumed."""
    torch.set_num_threads(1)
    cache = str(tmp_path / "cache")
    make_cache(cache, 80, shape=(12, 12, 3), shards=2, splits={"train": 0.8, "val": 0.2})
    runs = {}
    for where in ("host", "device"):
        with Trainer(_cfg(tmp_path / where, cache, f"run.precision={precision}", f"data.normalize_on={where}"),
                     WorkerContext(run_dir=str(tmp_path / where))) as t:
            runs[where] = t.train()
    want = _losses(tmp_path / "host")
    assert sorted(want) == list(range(1, 7))
    assert _losses(tmp_path / "device") == want
    host, dev = runs["host"], runs["device"]
    assert dev["weights_sha256"] == host["weights_sha256"] and dev["val_loss"] == host["val_loss"]
    assert (host["input"]["normalize_on"], dev["input"]["normalize_on"]) == ("host", "device")
    # 16 samples of 12x12x3: float32 images 27,648 bytes and 128 of labels, against 6,912 + 128
    assert host["input"]["bytes_per_batch"] == 16 * 432 * 4 + 128
    assert dev["input"]["bytes_per_batch"] == 16 * 432 + 128
    assert dev["optimizer"] == {"name": "adamw", "implementation": "for-loop",
                                "why": "parameters on cpu: fused kernels are taken on cuda only"}

    cfg = _cfg(tmp_path / "b", cache, f"run.precision={precision}", "data.normalize_on=device")
    with Trainer(cfg, WorkerContext(run_dir=str(tmp_path / "b"))) as first:
        batches = first.batches()
        losses = [float(first.train_step(*next(batches))) for _ in range(3)]
        saved = first.state_dict()
    assert losses == [want[s] for s in (1, 2, 3)]
    with Trainer(_cfg(tmp_path / "c", cache, f"run.precision={precision}", "data.normalize_on=device"),
                 WorkerContext(run_dir=str(tmp_path / "c"))) as second:
        second.load_state_dict(saved)
        assert (second.step, second.epoch) == (3, 0)
        resumed = second.train()
    assert _losses(tmp_path / "c") == {s: want[s] for s in (4, 5, 6)}
    assert resumed["weights_sha256"] == host["weights_sha256"]


def _params(*specs):
    """Stand-ins for parameters on a device this machine lacks (CUDA): only ``device`` and ``dtype`` are read."""
    return [types.SimpleNamespace(device=torch.device(d), dtype=dt) for d, dt in specs]


def test_fused_optimizer_only_where_supported(monkeypatch):
    cfg = load_config(None, ["data.source=synthetic"])
    cuda32 = _params(("cuda", torch.float32), ("cuda", torch.bfloat16), ("cuda", torch.float64))
    assert O.fused_choice(cuda32, cfg.optim) == (True, "fused AdamW on cuda")
    for name, cls in (("adam", "Adam"), ("sgd", "SGD")):
        assert O.fused_choice(cuda32, dataclasses.replace(cfg.optim, name=name))[0], cls
    for name in ("rmsprop", "adagrad", "adamax", "nadam", "radam", "adafactor"):
        assert O.fused_choice(cuda32, dataclasses.replace(cfg.optim, name=name))[0] is False, name
    assert O.fused_choice(cuda32, dataclasses.replace(cfg.optim, fused=False)) == (False, "optim.fused = false")
    # an offloaded shard (on the CPU) next to CUDA parameters, CPU alone, integer parameters, none at all
    assert O.fused_choice(_params(("cuda", torch.float32), ("cpu", torch.float32)), cfg.optim) == (
        False, "parameters on cpu, cuda: fused kernels are taken on cuda only")
    assert O.fused_choice(_params(("cpu", torch.float32)), cfg.optim)[0] is False
    assert O.fused_choice(_params(("cuda", torch.int8)), cfg.optim) == (
        False, "parameters of dtype int8: fused kernels take floating point only")
    assert O.fused_choice([], cfg.optim)[0] is False

    # the plumbing, run for real: with the CPU admitted, make_optimizer builds torch's fused AdamW (torch 2.13
    # has CPU kernels) and it steps; without, torch's loop, as before
    model = torch.nn.Linear(4, 3)
    plain = O.make_optimizer(model.parameters(), cfg.optim)
    assert O.implementation(plain) == "for-loop" and not plain.param_groups[0]["fused"]
    monkeypatch.setattr(O, "FUSED_DEVICES", ("cuda", "cpu"))
    fused = O.make_optimizer(model.parameters(), cfg.optim)
    assert O.implementation(fused) == "fused" and all(g["fused"] for g in fused.param_groups)
    model(torch.ones(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    fused.step()
    assert not torch.equal(before, model.weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the pinned side-stream copy runs there only")
def test_on_cuda_uint8_crosses_pinned_on_a_side_stream_and_matches_the_host(tmp_path):
    """On a GPU machine: the trainer's loader configuration pins, copies ahead on a side stream and normalizes
    on the device, every batch the host's bits moved to the device; AdamW is fused there."""
    uri = str(tmp_path / "cache")
    make_cache(uri, 70, shape=(8, 8, 3), shards=3)
    device = torch.device("cuda", torch.cuda.current_device())
    host_cfg = LoaderConfig(global_batch_size=16, drop_last=False, mode="thread", prefetch=2, normalize_on="host",
                            augment=AugmentConfig(crop_padding=2, flip=True))
    dev = CacheLoader(uri, "train", config=dataclasses.replace(host_cfg, normalize_on="auto", **delivery(device)))
    assert dev.delivery | {"bytes_per_batch": 0} == {
        "normalize_on": "device", "device": str(device), "pinned": True, "side_stream": True, "copy_ahead": True,
        "bytes_per_batch": 0}
    want = _pass(CacheLoader(uri, "train", config=host_cfg))
    got = _pass(dev)
    assert all(b["image"].device == device for b in got)
    _same(want, [{**b, "image": b["image"].cpu(), "label": b["label"].cpu()} for b in got])
    model = torch.nn.Linear(4, 3).to(device)
    opt = O.make_optimizer(model.parameters(), load_config(None, ["data.source=synthetic"]).optim)
    assert O.implementation(opt) == "fused"
