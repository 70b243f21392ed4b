"""`materialize` on a multi-node Ray cluster builds shards in Ray tasks on both nodes, byte-identical to native.

Daft fixes its runner per process, so the Ray run happens in a subprocess that starts its own two-node cluster
(``ray.cluster_utils.Cluster``: two raylets of 1 CPU each on this machine) and compares with a native run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache.materialize import materialize
from dutycycle.engine.transform import TransformSpec

from ..support.fullfs import fill, tmpfs
from ..support.tablemaker import add_file, make_shapes_table, write_table

SPEC = TransformSpec(size=32)
ROWS_PER_SHARD = 4

CHILD = r"""
import glob, json, sys
import ray
from ray.cluster_utils import Cluster

table, root, rows_per_shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False)
try:
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.transform import TransformSpec

    res = materialize(table, root, TransformSpec(size=32), runner="ray", ray_address=cluster.address,
                      rows_per_shard=rows_per_shard)
    nodes = [json.load(open(p))["worker"].rsplit("node=", 1)[-1] for p in glob.glob(res.uri + "/shards/*.json")]
    print("RESULT " + json.dumps({"uri": res.uri, "nodes": nodes, "alive": len(ray.nodes())}), flush=True)
    # a cache root on a full file system: what the workers' writes (Daft's Parquet staging, the shards) report
    from dutycycle.engine.errors import NoSpaceError
    try:
        materialize(table, sys.argv[4], TransformSpec(size=32), runner="ray", ray_address=cluster.address,
                    rows_per_shard=rows_per_shard)
        full = {"error": None}
    except NoSpaceError as e:
        full = {"error": str(e), "path": e.path, "device": e.device}
    print("FULL " + json.dumps(full), flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.slow
@pytest.mark.ray
def test_two_node_ray_cluster_builds_the_same_bytes_as_native(tmp_path):
    table, rows = make_shapes_table(str(tmp_path / "data"), n=38, n_errors=2)
    images = str(tmp_path / "data" / "images")
    cut = add_file(images, "circle/cut.jpg", open(rows[0]["uri"], "rb").read()[:300], "circle", error="-")
    cut["error"] = None  # the table believes it is fine; the decode finds it cut short
    copy = add_file(images, "square/copy.jpg", open(rows[1]["uri"], "rb").read(), "square")  # duplicate
    write_table(table, [*rows, cut, copy])
    native = materialize(table, str(tmp_path / "native"), SPEC, rows_per_shard=ROWS_PER_SHARD)

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0", "DAFT_PROGRESS_BAR": "0"}
    with tmpfs(tmp_path / "full") as mnt:
        fill(mnt, 8 << 10)
        proc = subprocess.run([sys.executable, "-c", CHILD, table, str(tmp_path / "ray"), str(ROWS_PER_SHARD),
                               str(mnt / "cache")], capture_output=True, text=True, env=env, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # a full disk under a Ray build is named (it came back as Ray's and Daft's error text), and the build
        # leaves no temporary file and no staging folder
        full = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("FULL "))[len("FULL "):])
        assert full["error"] and full["error"].startswith(f"no space left on {mnt} (tmpfs) at "), full
        assert full["path"].startswith(str(mnt / "cache")) and full["device"].startswith(str(mnt))
        left = [str(p.relative_to(mnt)) for p in mnt.rglob("*")]
        assert not [n for n in left if ".tmp-" in n or ".plan" in n or n.endswith(cf.MANIFEST)], left
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    ray_m = cf.read_manifest(out["uri"])
    assert ray_m.fingerprint == native.manifest.fingerprint and ray_m.options["runner"] == "ray"
    assert ray_m.skipped == native.manifest.skipped == {"table_error": 2, "truncated": 1, "duplicate": 1}
    assert ray_m.split_counts == native.manifest.split_counts and len(ray_m.shards) == 10
    assert ray_m.channel_stats == native.manifest.channel_stats is not None  # exact sums from both nodes' shards
    for a, b in zip(ray_m.shards, native.manifest.shards, strict=True):
        assert a == b  # path, rows, bytes, sha256
        assert (Path(out["uri"]) / a.path).read_bytes() == (Path(native.uri) / b.path).read_bytes()
    # the planned selection was staged under the cache root for the workers, and removed after the build
    assert not (tmp_path / "ray" / ".plan").exists()
    # Shards were built in Ray tasks on both nodes (each record names the node that wrote its shard).
    assert out["alive"] == 2 and len(out["nodes"]) == 10 and len(set(out["nodes"])) == 2, out["nodes"]
