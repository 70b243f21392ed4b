"""BatchNorm under data parallelism (``model.sync_batchnorm``, trainer/parallel/batchnorm.py).

In one process: the conversion (every kind of BatchNorm, the layer's own tensors, BatchNorm's state-dict names),
the layer's combination of the ranks' statistics, no warning at one rank, running statistics updated once per
forward under activation checkpointing and untouched by the FLOP count, the config key.

On real gloo ranks, float64: 2 ranks x half batch with synced BatchNorm train the weights, losses and running
statistics of one process on the whole batch (DDP; FSDP2 with micro-batches, whose statistics are per global
micro-batch; through the Trainer); unsynced they do not, and rank 0 warns once; a stop and resume continues bit
for bit with the running statistics from the checkpoint. At 4 ranks: tensor parallelism (statistics over the data
dimension only) and hybrid sharding (over every rank).

Tolerance of the parity checks: 1e-12 absolute on weights, running statistics and losses (all O(1)). The synced
run reorders sums: each rank sums its half, and the halves' statistics are combined, where one process sums the
whole batch at once; float64 rounds each operation by at most 2^-53 = 1.1e-16 relative, and a step's statistics,
forward and backward through 4 BatchNorm layers take a few hundred roundings in sequence at most, which SGD
(no Adam, whose division amplifies tiny gradients) carries linearly through 3-8 steps of lr <= 0.1. Measured:
<= 2.3e-15. Unsynced, the same runs differ by ~0.1.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.cluster.world import World
from dutycycle.trainer.config import ParallelSection, load_config
from dutycycle.trainer.parallel.apply import parallelize
from dutycycle.trainer.parallel.batchnorm import (
    BatchNormWarning,
    CollectiveBatchNorm,
    batchnorm_layers,
    combine,
    convert_batchnorm,
    unsynced_warning,
)
from torch import nn

from ..support import bn_worker as bw
from ..support.harness import run_distributed

TOL = 1e-12  # module docstring
CPU = torch.device("cpu")


class MyNorm(nn.BatchNorm2d):
    """A plug-in's own BatchNorm subclass."""


def zoo() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.one = nn.BatchNorm1d(3)
    m.two = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, momentum=None), MyNorm(3, affine=False))
    m.three = nn.BatchNorm3d(3, track_running_stats=False)
    m.lazy = nn.LazyBatchNorm2d()
    m.lazy(torch.randn(4, 3, 2, 2))  # initialized: 3 features
    m.synced = nn.SyncBatchNorm(3)
    m.nobias = nn.BatchNorm2d(3, bias=False)
    for bn in (m.one, m.two[1], m.synced):  # running statistics away from their initial values
        with torch.no_grad():
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return m


def names(m: nn.Module) -> dict[str, type]:
    return {n: type(x) for n, x in m.named_modules()}


def test_every_batchnorm_is_converted_keeping_its_tensors_and_names():
    plain, model = zoo(), zoo()
    tensors = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    out = convert_batchnorm(model, device=CPU)
    assert out is model
    assert sorted(n for n, t in names(out).items() if t is CollectiveBatchNorm) == \
        ["lazy", "nobias", "one", "synced", "three", "two.1", "two.2"]
    assert batchnorm_layers(out, per_rank=True) == [] and len(batchnorm_layers(plain, per_rank=True)) == 6
    # the same tensors (parameters and buffers), under BatchNorm's names: files load either way, strictly
    after = out.state_dict(keep_vars=True)
    assert list(after) == list(plain.state_dict()) and all(after[k] is tensors[k] for k in after)
    assert out.nobias.bias is None and out.two[2].weight is None and out.three.running_mean is None
    assert out.two[1].momentum is None and out.one.input_ranks == (2, 3) and out.two[2].input_ranks == (4,)
    zoo().load_state_dict(out.state_dict(), strict=True)
    out.load_state_dict(plain.state_dict(), strict=True)
    # eval mode, and training in a process without a group (one rank), are nn.BatchNorm's own forward, bit for bit
    x2, x4, x5 = torch.randn(6, 3), torch.randn(6, 3, 4, 4), torch.randn(6, 3, 2, 2, 2)
    for mode in ("eval", "train"):
        for m in (plain, out):
            m.train(mode == "train")
        for a, b, x in ((plain.one, out.one, x2), (plain.two, out.two, x4), (plain.three, out.three, x5),
                        (plain.one, out.one, x2[:, :, None].expand(6, 3, 5))):
            assert torch.equal(a(x), b(x)), mode
    assert all(torch.equal(v, out.state_dict()[k]) for k, v in plain.state_dict().items())
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        out.two[1](torch.randn(2, 3, 4))
    # a BatchNorm as the model itself comes back as a new module, as torch's converter returns it
    root = convert_batchnorm(nn.BatchNorm2d(3), device=CPU)
    assert type(root) is CollectiveBatchNorm
    # on CUDA: torch's SyncBatchNorm (the conversion itself touches no device)
    cuda = convert_batchnorm(zoo(), device=torch.device("cuda"))
    assert {n for n, t in names(cuda).items() if t is nn.SyncBatchNorm} == \
        {"lazy", "nobias", "one", "synced", "three", "two.1", "two.2"}


def test_a_lazy_batchnorm_not_yet_sized_is_refused_by_name():
    m = nn.Sequential(nn.LazyConv2d(3, 1), nn.LazyBatchNorm2d())  # a lazy layer of another kind is no concern
    with pytest.raises(ConfigError, match=r"model\.sync_batchnorm = true: 1 is a lazy BatchNorm"):
        convert_batchnorm(m, device=CPU)
    m(torch.randn(2, 3, 4, 4))  # sized by a forward: converted
    assert type(convert_batchnorm(m, device=CPU)[1]) is CollectiveBatchNorm
    convert_batchnorm(nn.Sequential(nn.LazyLinear(3), nn.BatchNorm1d(3)), device=CPU)


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_the_ranks_statistics_combine_into_the_whole_batchs(offset):
    """The rows ``[mean, centred sum of squares, count]`` of uneven slices (one of them empty) give the mean and
    the biased variance of the whole batch, also far from zero. Tolerance: the mean within 4 float64 spacings of
    the largest value (2^-52 relative each; measured 2); the variance, whose centring carries that error of the
    mean, within twice it relative to the standard deviation (3), plus a few roundings."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, 5, generator=g, dtype=torch.float64) * 3 + offset
    rows = []
    for part in (x[:3], x[3:3], x[3:14], x[14:]):
        n = part.shape[0]
        mean = part.sum(0) / max(n, 1)
        rows.append(torch.cat([mean, ((part - mean) ** 2).sum(0), torch.tensor([float(n)], dtype=x.dtype)]))
    mean, var, total = combine(torch.stack(rows), 5)
    want_var, want_mean = torch.var_mean(x, dim=0, unbiased=False)
    assert total == 23
    mean_tol = 4 * 2 ** -52 * float(x.abs().max())
    torch.testing.assert_close(mean, want_mean, rtol=0, atol=mean_tol)
    torch.testing.assert_close(var, want_var, rtol=2 * mean_tol / 3 + 1e-15, atol=0)


def test_one_rank_neither_converts_nor_warns():
    for sync in (True, False):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            strategy = parallelize(bw.BNNet(), ParallelSection(), World(), device=CPU, sync_batchnorm=sync)
        assert strategy.synced_batchnorm == [] and not [w for w in seen if w.category is BatchNormWarning]
        assert type(strategy.module.stem[1]) is nn.BatchNorm2d


def test_the_warning_is_one_line_naming_the_key():
    text = unsynced_warning(bw.BNNet(), batchnorm_layers(bw.BNNet()), 4)
    assert "\n" not in text and "set model.sync_batchnorm = true" in text and "4 data-parallel ranks" in text
    assert "stem.1, blocks.0.1, blocks.1.1, ... (4 in all)" in text


def _steps(checkpointing: bool) -> dict[str, torch.Tensor]:
    from dutycycle.trainer.step.loop import optimizer_step
    from dutycycle.trainer.step.timing import StepTimer

    torch.manual_seed(0)
    strategy = parallelize(bw.BNNet().double(), ParallelSection(activation_checkpointing=checkpointing), World(),
                           device=CPU, precision="fp64", micro_batches=2)
    optimizer = torch.optim.SGD(strategy.module.parameters(), lr=0.1, momentum=0.9)
    for x, y in bw.batches(2):
        optimizer_step(strategy, optimizer, x, y, micro_batches=2, timer=StepTimer(), autocast=contextlib.nullcontext,
                       grad_clip=0.0, lr=0.1)
    return strategy.module.state_dict()


def test_activation_checkpointing_updates_running_statistics_once_per_forward():
    """torch's checkpoint recomputes a block's forward in backward, and a BatchNorm in training mode would update
    its running statistics again there; the recomputation holds them: the same state, bit for bit, as without
    checkpointing (2 steps of 2 micro-batches: 4 updates)."""
    plain, checkpointed = _steps(False), _steps(True)
    assert list(plain) == list(checkpointed)
    assert all(torch.equal(plain[k], checkpointed[k]) for k in plain)
    assert int(checkpointed["blocks.0.1.num_batches_tracked"]) == 4


def test_the_flop_count_leaves_running_statistics_alone():
    from dutycycle.trainer.step.loop import flops_per_sample

    model = bw.BNNet()  # its BatchNorm1d would refuse the one-sample batch in training mode
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert flops_per_sample(model, 3, 8, CPU) > 0
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_config_key():
    assert load_config(None, ["data.source=synthetic"]).model.sync_batchnorm is False
    assert load_config(None, ["data.source=synthetic", "model.sync_batchnorm=true"]).model.sync_batchnorm is True
    with pytest.raises(ConfigError, match=r"model\.sync_batchnorm"):
        load_config(None, ["data.source=synthetic", 'model.sync_batchnorm="yes"'])


# ---------------------------------------------------------------------------------------------- 2 real ranks


def _close(got: dict, want: dict, tol: float = TOL) -> float:
    """The largest difference over every tensor of two state dicts (as lists), asserted under ``tol``."""
    assert sorted(got) == sorted(want)
    worst = max(float((torch.tensor(got[k], dtype=torch.float64) - torch.tensor(want[k], dtype=torch.float64))
                      .abs().max()) for k in want)
    assert worst <= tol, worst
    return worst


def _apart(got: dict, want: dict) -> float:
    """The largest difference over the tensors of ``got`` (as lists)."""
    return max(float((torch.tensor(got[k], dtype=torch.float64) - torch.tensor(want[k], dtype=torch.float64))
                     .abs().max()) for k in got)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("bn")
    reference = {"whole": bw.train_steps(0, 1),
                 # one process's micro-batch i = micro-batch i of both ranks (statistics per global micro-batch)
                 "micro": bw.train_steps(0, 1, micro_batches=2, reorder_for=(2, 2)),
                 "micro_in_order": bw.train_steps(0, 1, micro_batches=2),
                 "trainer": bw.run_trainer(str(root / "one"))}
    ranks = run_distributed(bw.two_ranks, 2, str(root), timeout=280)
    return root, reference, ranks


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_synced_batchnorm_at_two_ranks_trains_as_one_process(two):
    root, ref, ranks = two
    r = ranks[0]
    # DDP, one micro-batch: losses, weights and running statistics of one process on the whole batch
    assert r["ddp"]["types"] == ["CollectiveBatchNorm"] and r["ddp"]["synced"] == ["stem.1", "blocks.0.1",
                                                                                    "blocks.1.1", "norm"]
    _close(r["ddp"]["state"], ref["whole"]["state"])
    assert r["ddp"]["losses"] == pytest.approx(ref["whole"]["losses"], rel=0, abs=TOL)
    # the statistics' traffic, per layer and step: the all-gather of 2 rows of 8 means, 8 sums, 1 count (float64)
    # sends one row to the peer, backward's all-reduce of both rows twice that
    assert r["ddp"]["traffic"] == 4 * bw.STEPS * (17 * 8 + 2 * 17 * 8)
    # FSDP2 with 2 micro-batches: micro-batch i is normalized over micro-batch i of both ranks, and the running
    # statistics are updated once per micro-batch; not with the whole batch's statistics, nor in another grouping
    _close(r["fsdp_micro"]["state"], ref["micro"]["state"])
    assert r["fsdp_micro"]["losses"] == pytest.approx(ref["micro"]["losses"], rel=0, abs=TOL)
    assert r["fsdp_micro"]["state"]["norm.num_batches_tracked"] == 2 * bw.STEPS
    assert _apart(r["fsdp_micro"]["state"], ref["micro_in_order"]["state"]) > 1e-3
    assert _apart({k: v for k, v in r["fsdp_micro"]["state"].items() if "num_batches" not in k},
                  ref["whole"]["state"]) > 1e-3
    # unsynced: each rank's own statistics, another result; rank 0 warned once, rank 1 not, nor the synced runs
    assert _apart(r["ddp_unsynced"]["state"], ref["whole"]["state"]) > 1e-2
    assert [x["ddp_unsynced"]["warnings"] for x in ranks] == [1, 0]
    assert all(x[k]["warnings"] == 0 for x in ranks for k in ("ddp", "fsdp_micro"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_trainer_with_synced_batchnorm_matches_one_process_and_resumes_bit_for_bit(two):
    from safetensors.torch import load_file

    root, ref, ranks = two
    r = ranks[0]
    one = bw.loss_rows(str(root / "one"))
    synced, resumed = bw.loss_rows(str(root / "synced")), bw.loss_rows(str(root / "resumed"))
    assert list(one) == list(synced) == list(resumed) == list(range(1, 9))
    assert all(abs(synced[s] - one[s]) <= TOL for s in one)
    assert r["synced"]["val_loss"] == pytest.approx(ref["trainer"]["val_loss"], rel=0, abs=TOL)  # running stats
    assert r["synced"]["synced"] and ref["trainer"]["synced"] == []  # one process: nothing to synchronize
    # model.safetensors: BatchNorm's names with the running statistics, loading into the plain model strictly
    files = {name: load_file(str(root / name / "model.safetensors")) for name in ("one", "synced", "resumed")}
    _close({k: v.tolist() for k, v in files["synced"].items()}, {k: v.tolist() for k, v in files["one"].items()})
    bw.BNNet().double().load_state_dict(files["synced"], strict=True)
    assert int(files["synced"]["norm.num_batches_tracked"]) == 8
    # stopped by a crash at step 7, started again: resumed from step 6; every loss, the running statistics and
    # the validation (which normalizes with them) bit for bit
    assert r["crashed"] and r["resumed"]["resumed"]["step"] == 6
    assert resumed == synced
    assert files["resumed"].keys() == files["synced"].keys()
    assert all(torch.equal(files["resumed"][k], files["synced"][k]) for k in files["synced"])
    assert r["resumed"]["val_loss"] == r["synced"]["val_loss"]
    # the running statistics are training state: in the checkpoint it resumed from (not re-counted from zero:
    # num_batches_tracked is 8 at the end only because steps 1-6 came from there)
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(r["resumed"]["resumed"]["uri"]).read_metadata().state_dict_metadata
    for layer in r["synced"]["synced"]:
        assert {f"model.{layer}.{b}" for b in ("running_mean", "running_var", "num_batches_tracked")} <= set(saved)
    # unsynced through the Trainer: one warning for the whole run, on rank 0, naming the key
    assert [len(x["unsynced"]["warnings"]) for x in ranks] == [1, 0]
    assert "model.sync_batchnorm = true" in ranks[0]["unsynced"]["warnings"][0]
    assert not ranks[0]["synced"]["warnings"] and not ranks[0]["resumed"]["warnings"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_low_precision_statistics_are_summed_in_float32(two):
    """Channels at mean 1000, std 1. float32: the mean itself is a float32 near 1000, spaced 2^-14 = 6.1e-5, so
    its rounding alone moves outputs by up to 3.1e-5 (std 1); 1e-4 leaves room for the variance's and the
    output's roundings (~1e-7), and torch's own layer in one process errs as much. bf16 inputs: statistics in
    float32, so only the output's rounding to bf16 remains (8 significant bits: 2^-8 of the largest output),
    where torch's own bf16 layer errs 10x more."""
    for rank in two[2]:
        f32, bf16 = rank["precision"]["torch.float32"], rank["precision"]["torch.bfloat16"]
        assert f32["dtype"] == "torch.float32" and f32["error"] < 1e-4 and f32["error"] < 2 * f32["torch_error"]
        assert bf16["dtype"] == "torch.bfloat16" and bf16["error"] <= bf16["largest"] * 2 ** -8
        assert bf16["torch_error"] > 5 * bf16["error"]


# ---------------------------------------------------------------------------------------------- 4 real ranks


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_data_parallel_group_under_tensor_parallelism_and_hybrid_sharding():
    """Tensor parallel 2 x data parallel 2: the BatchNorm on the ViT's patch embedding synchronizes over its data
    column only (a tensor group's two ranks read the same slice; over all 4 the running variance's n/(n-1) and
    the gradients through the statistics would count each sample twice), so the traffic is that of a group of
    2. Hybrid sharding, 2 replica groups of 2: all 4 ranks read their own slice and synchronize together."""
    ref = {"tensor": bw.train_steps(0, 1, model="vit"), "hybrid": bw.train_steps(0, 1)}
    ranks = run_distributed(bw.layouts, 4, timeout=380)
    for layout in ("tensor", "hybrid"):
        got = ranks[0][layout]
        _close(got["state"], ref[layout]["state"])
        assert got["losses"] == pytest.approx(ref[layout]["losses"], rel=0, abs=TOL)
    assert ranks[0]["tensor"]["synced"] == ["patch.1"]
    row = (2 * 16 + 1) * 8  # one rank's statistics of 16 channels, float64
    assert [x["tensor"]["traffic"] for x in ranks] == [bw.STEPS * (row + 2 * row)] * 4  # 1 peer
    assert [x["hybrid"]["traffic"] for x in ranks] == [4 * bw.STEPS * 3 * (17 * 8 + 2 * 17 * 8)] * 4  # 3 peers

