"""The foundation: packaging, the CLI entry point, the harness fixtures and the shared cache format."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ..support.harness import run_distributed


@pytest.mark.parametrize(
    "stmt",
    [
        "import dutycycle.engine",
        "import dutycycle.engine.cache, dutycycle.engine.table",
        "import dutycycle.loader",
        "import dutycycle.trainer",
        "from dutycycle.trainer.app.cli import build_parser; build_parser()",  # what `dutycycle --help` loads
    ],
)
def test_imports_are_light(stmt):
    code = f"import sys; {stmt}; print([m for m in ('daft', 'ray', 'torch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_help_lists_commands():
    out = subprocess.run(
        [sys.executable, "-m", "dutycycle.trainer", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "usage: dutycycle" in out


def _allreduce(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_distributed_harness_runs_gloo():
    assert run_distributed(_allreduce, 2, timeout=60) == [3.0, 3.0]


def _fail_on_rank1(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


def test_distributed_harness_reports_rank_failure():
    with pytest.raises(AssertionError, match="rank 1 failed"):
        run_distributed(_fail_on_rank1, 2, timeout=60)


def test_ray_cluster_fixture(ray_cluster):
    assert ray_cluster.cluster_resources()["CPU"] == 2


def _write_cache(uri):
    from dutycycle.engine.cache import format as cf

    imgs = np.arange(5 * 4 * 4 * 3, dtype=np.uint8).reshape(5, 4, 4, 3)
    s0 = cf.write_shard(uri, 0, ["a", "b", "c"], [0, 1, 0], ["train"] * 3, imgs[:3])
    s1 = cf.write_shard(uri, 1, ["d", "e"], [1, 1], ["val"] * 2, imgs[3:])
    m = cf.CacheManifest(
        fingerprint="f" * 16, shape=[4, 4, 3], layout="HWC", dtype="uint8", num_samples=5, shards=[s0, s1],
        classes=["x", "y"], split_counts={"train": 3, "val": 2}, spec={},
    )
    return imgs, m


def test_cache_format_roundtrip_and_commit(tmp_path):
    import pyarrow as pa
    from dutycycle.engine.cache import format as cf
    from dutycycle.engine.cache.reader import CacheReader
    from dutycycle.engine.errors import CorruptArtifactError, SourceError

    uri = str(tmp_path / "cache")
    imgs, m = _write_cache(uri)
    with pytest.raises(SourceError, match="manifest.json is missing"):
        CacheReader(uri)
    cf.commit(uri, m)
    r = CacheReader(uri)
    assert np.array_equal(np.concatenate([r.images(0), r.images(1)]), imgs)
    assert list(r.column(1, "sample_id")) == ["d", "e"]
    shard, row = r.locate(np.array([0, 2, 3, 4]))
    assert shard.tolist() == [0, 0, 1, 1] and row.tolist() == [0, 2, 0, 1]
    # plain pyarrow reads a shard without dutycycle
    t = pa.ipc.open_file(str(tmp_path / "cache" / "shards" / "shard-00001.arrow")).read_all()
    assert t.column("label").to_pylist() == [1, 1]
    # a flipped byte is refused, naming the shard
    p = tmp_path / "cache" / "shards" / "shard-00001.arrow"
    data = bytearray(p.read_bytes())
    data[-100] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptArtifactError, match="shard-00001.arrow"):
        CacheReader(uri).images(1)


def test_cache_format_on_s3(s3):
    from dutycycle.engine.cache import format as cf
    from dutycycle.engine.cache.reader import CacheReader

    uri = f"{s3}/cache"
    imgs, m = _write_cache(uri)
    cf.commit(uri, m)
    r = CacheReader(uri)
    assert np.array_equal(r.images(1), imgs[3:])


def test_cli_help_loads_no_numeric_or_image_stack():
    """`dutycycle --help` builds every subparser; it must not pay for numpy, PIL or pyarrow imports."""
    code = ("import sys; from dutycycle.trainer.app.cli import build_parser; build_parser(); "
            "print([m for m in ('numpy', 'PIL', 'pyarrow', 'daft', 'ray', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
