"""Four loader processes on one node share the cache through the page cache: no private copy of the split each.

Measured with real processes and the kernel's own accounting (``/proc/self/status`` and ``smaps``): ``RssAnon``
is memory private to a process (a copy of the split would land there); the ``Pss`` of the shard mappings
charges every shared page to the processes mapping it in equal parts, so the four figures add up to what the
node really holds for the cache.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..support.cachemaker import make_cache

CHILD = r"""
import json, sys
import torch  # noqa: F401  (everything is imported before the baseline: libraries are not the loader's memory)
import pyarrow.compute  # noqa: F401
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig
import dutycycle.loader.cache_loader, dutycycle.loader.augment, dutycycle.loader.budget  # noqa: F401,E401

def mem():
    out = {"CachePss": 0, "CacheRss": 0}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    in_cache = False  # smaps: a header line per mapping (ending in its file), then its fields
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and not head[0].endswith(":"):
            in_cache = head[-1].startswith(uri)
        elif in_cache and head[0] in ("Pss:", "Rss:"):
            out["Cache" + head[0][:-1]] += int(head[1]) * 1024
    return out

uri, warmup, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = LoaderConfig(global_batch_size=256, mode="auto",
                   augment=AugmentConfig(crop_padding=0, flip=False, normalize=False))
# A loader over a tiny cache first: torch, numpy and Arrow set up their lazy state (allocator pools, code pages
# of the shared libraries) on a first batch, which would otherwise count as the loader's memory.
sum(len(b["label"]) for b in CacheLoader(warmup, "train", 0, 1, cfg))
before = mem()
loader = CacheLoader(uri, "train", rank, 4, cfg)
seen = sum(len(b["label"]) for b in loader)
after = mem()
print("ready", flush=True)
sys.stdin.readline()  # every rank has read its epoch: measure while all four map the cache
final = mem()
print(json.dumps({"seen": seen, "execution": loader.execution, "before": before, "after": after, "final": final}),
      flush=True)
sys.stdin.readline()  # every rank has measured: exit
"""


def run_ranks(uri: str, warmup: str) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, uri, warmup, str(r)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
    # Every rank reads its epoch and waits; then all measure at once (while all four map the cache, so the
    # kernel divides the shared pages among them), report, and exit together.
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
        for p in procs:
            p.stdin.write("measure\n")
            p.stdin.flush()
        lines = [p.stdout.readline() for p in procs]
        outs = [p.communicate("exit\n", timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(line) for line in lines]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_loader_processes_share_the_split_through_the_page_cache(tmp_path):
    uri = str(tmp_path / "cache")
    n, per = 8192, 64 * 64 * 3
    make_cache(uri, n, shape=(64, 64, 3), shards=8)
    make_cache(str(tmp_path / "warmup"), 512, shape=(64, 64, 3), shards=2, fingerprint="warmup")
    split = n * per  # 96 MiB of pixels
    ranks = run_ranks(uri, str(tmp_path / "warmup"))
    assert sum(r["seen"] for r in ranks) == n and all("memory-mapped shards" in r["execution"] for r in ranks)
    anon = sum(r["final"]["RssAnon"] - r["before"]["RssAnon"] for r in ranks)
    cache_pss = sum(r["final"]["CachePss"] for r in ranks)
    # Measured here: private memory grew by 1.9, 1.9, 1.9 and -4.1 MiB (0.016 of one split in all: batch
    # buffers come and go); each rank maps the whole 96.4 MiB of shards (its quarter of every batch is spread
    # over all of them), and the four Pss shares of those pages add up to 96.4 MiB: 1.00 split for the node,
    # where summed RSS would say 4.
    assert anon < 0.1 * split, (anon / 2**20, split / 2**20)
    assert cache_pss < 1.1 * split, (cache_pss / 2**20, split / 2**20)
    for r in ranks:  # nor does any one rank hold a private copy, even briefly before its epoch ended
        assert r["after"]["RssAnon"] - r["before"]["RssAnon"] < 0.05 * split


