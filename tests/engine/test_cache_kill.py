"""A materialization killed with SIGKILL mid-run resumes: committed shards are kept, nothing partial is exposed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from dutycycle.engine.cache import format as cf
from dutycycle.engine.cache.materialize import materialize, open_cache
from dutycycle.engine.errors import SourceError
from dutycycle.engine.transform import TransformSpec

from ..support.tablemaker import make_shapes_table

SPEC = TransformSpec(size=16)
ROWS_PER_SHARD = 6

# The child is the real materialize (files decoded in batches of 4 on Daft's threads, shards written as their
# rows stream in). Reading one image of the last shard never returns (like a stalled network read: the child's
# capped reader waits on that one file), so the kill always lands while that shard is unfinished, however fast
# the others are. A FIFO used to play that part; the reader now refuses FIFOs before opening them.
CHILD = textwrap.dedent(
    """
    import sys, time
    from dutycycle.engine import io
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.transform import TransformSpec

    stalled, read_capped = sys.argv[4], io.read_capped

    def stalling_read(uri, max_bytes):
        if uri.endswith(stalled):
            time.sleep(3600)
        return read_capped(uri, max_bytes)

    io.read_capped = stalling_read
    materialize(sys.argv[1], sys.argv[2], TransformSpec(size=16), rows_per_shard=int(sys.argv[3]), batch_size=4,
                log=lambda msg: print(msg, flush=True))
    """
)


def _stat(p: Path) -> tuple[int, int]:
    s = p.stat()
    return s.st_ino, s.st_mtime_ns


@pytest.mark.parametrize("kill_after_records", [1, 3])
def test_sigkill_then_rerun_finishes_without_redoing_committed_shards(tmp_path, kill_after_records):
    table, rows = make_shapes_table(str(tmp_path / "data"), n=42, seed=kill_after_records)
    stalled = max(rows, key=lambda r: r["sample_id"])["uri"]  # sorted last: in the last shard
    root = tmp_path / "cache"
    env = {**os.environ, "DAFT_ANALYTICS_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    # Its own process group: SIGKILL reaches the worker processes too, as when a machine dies.
    child = subprocess.Popen([sys.executable, "-c", CHILD, table, str(root), str(ROWS_PER_SHARD), stalled],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    deadline = time.time() + 120
    try:
        while len(list(root.glob("*/shards/*.json"))) < kill_after_records:
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "materialize made no progress"
            time.sleep(0.02)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    # Killed: no manifest, so no reader can open it; every shard file present is complete Arrow.
    (folder,) = [p for p in root.iterdir() if p.is_dir() and p.name != "_index"]
    assert not (folder / cf.MANIFEST).exists() and not (root / cf.LATEST).exists()
    with pytest.raises(SourceError):
        open_cache(str(root))
    records = sorted((folder / "shards").glob("*.json"))
    assert kill_after_records <= len(records) < 7
    for shard in (folder / "shards").glob("*.arrow"):
        assert pa.ipc.open_file(str(shard)).read_all().num_rows == ROWS_PER_SHARD
    committed = {r.with_suffix(".arrow").name: _stat(r.with_suffix(".arrow")) for r in records}

    res = materialize(table, str(root), SPEC, rows_per_shard=ROWS_PER_SHARD)
    assert res.uri == str(folder) and res.shards_resumed == len(records)
    assert res.shards_written == 7 - len(records)
    for name, st in committed.items():  # committed shards were verified, not rewritten
        assert _stat(folder / "shards" / name) == st

    # Exactly what an uninterrupted run produces.
    clean = materialize(table, str(tmp_path / "clean"), SPEC, rows_per_shard=ROWS_PER_SHARD)
    assert clean.manifest.fingerprint == res.manifest.fingerprint
    assert [s.sha256 for s in clean.manifest.shards] == [s.sha256 for s in res.manifest.shards]
    reader = open_cache(str(root))
    ids = np.concatenate([reader.column(i, "sample_id") for i in range(reader.num_shards)]).tolist()
    assert ids == sorted(r["sample_id"] for r in rows)
