"""The data path at cluster scale, simulated from the plan and a shard layout: what one rank's plan costs, how many
shards a node touches, how many bytes a ranged reader fetches per byte it uses, and what locality costs in shuffle
quality. Nothing is read from storage; the reads are counted from the plan, with the product's own cache sizes.

    python benchmarks/scale.py     # 100M samples, 1,000 ranks on 125 nodes of 8: about 3-5 minutes on 2 cores
    python benchmarks/scale.py --quick --no-peers-venv --out /tmp/scale.json
    python benchmarks/scale.py --elastic   # an elastic run's plan per rank at 10M samples: about a minute

Rows: ``partitioned`` is the product's plan as docs/loader.md sets it up for a cluster: ``--partitions`` canonical
partitions (default: one per rank) and shuffle blocks cut at the cache's checksum chunks (``block_size = 0``);
``partitioned-blocks-64`` the same with the default blocks; ``partitioned-chunk-sized`` with blocks a chunk long
that start where partitions start; ``unpartitioned`` the plan before partitions (one partition: the whole split
shuffled as one), the baseline.

- **Plan cost** (``plan_s_per_rank``, ``plan_peak_mib_per_rank``): ``rank_plan`` for one rank's epoch in a fresh
  process; the peak is that process's high-water resident set minus its level before planning (Python and NumPy
  loaded, nothing planned).
- **Locality** at ``--ranks-per-node``: for the first, middle and last node, the shards its ranks' samples live
  in over an epoch, against the ideal ``total shards / nodes`` (``shards_per_node_vs_ideal``, the worst node);
  the bytes of those shards against the node's share of the dataset (``disk_copy_vs_share``: what node-local
  copies need).
- **Range reads** (``range_amplification``): each rank of the first node replays its epoch through a chunk cache
  like the product's ranged reader (``ReadConfig.range_chunk_bytes`` chunks, least recently used dropped beyond
  ``range_cache_bytes``), chunks of a batch fetched together; bytes fetched per byte of the samples used. And the
  shard views a ranged reader reopens per batch beyond its open limit (``reopens_per_batch``).
- **Elastic plan** (``--elastic``, its own results file ``scale_elastic.json``): what one rank's epoch plan costs
  at ``--elastic-samples`` for a run at ``--elastic-workers MIN,MAX`` (``parallel.num_workers = [min, max]``),
  at every size of the range, with the trainer's default partitions for it (``loader.plan.default_partitions``:
  the least common multiple of the sizes) against one partition (the default before: every rank plans the
  whole epoch), each in a fresh process, the first and the last rank of each size; the trainer's default
  blocks and window, a global batch of ``--elastic-batch`` (default: 8 x the least common multiple).
- **Shuffle quality** at ``--quality-samples``, two epochs: ``batchmate_repeat`` is the share of a sample's
  batch-mates in epoch 0 that are its batch-mates again in epoch 1 (a true permutation gives about
  ``(B - 1) / (N - 1)``), and ``label_entropy_bits`` the mean per-batch entropy of labels drawn uniformly over
  ``--classes`` (cache rows are sorted by content hash, so a row's label is independent of its place). Each
  against a true global permutation of the same size, and against MosaicML Streaming's ``py1e`` shuffle with
  ``--partitions`` canonical nodes and a shuffle block of ``--window`` samples (the same samples held at once as
  the product's window), batches cut from its canonical nodes as the product cuts its partitions; ``py1e`` runs
  in the peers' venv (``benchmarks/loader_peers.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks._common import (  # noqa: E402
    default_out,
    emit,
    machine,
    markdown_table,
    run_row,
    write_result,
)
from benchmarks.scale_elastic import elastic_plan  # noqa: E402
from tests.support.memory import peak_rss_bytes  # noqa: E402

HERE = Path(__file__).resolve().parent
FP = "scale-benchmark"
SEED = 0
TARGETS = {"plan_s_per_rank": 1.0, "plan_peak_mib_per_rank": 64.0, "shards_per_node_vs_ideal": 1.25,
           "range_amplification": 1.25, "disk_copy_vs_share": 1.25}
KEYS = ("plan_s_per_rank", "plan_peak_mib_per_rank", "shards_per_node_vs_ideal", "range_amplification",
        "disk_copy_vs_share", "reopens_per_batch")  # the product's figures, beside the baseline's


# ---------------------------------------------------------------------------------------------- the plan


def chunk_starts(samples: int, shard_samples: int, chunk_rows: int) -> np.ndarray:
    """Where the simulated layout's checksum chunks start, as sample indices (a train-only cache: split index ==
    cache row): every ``chunk_rows`` rows within each shard of ``shard_samples`` rows."""
    shards = np.arange(0, samples, shard_samples, dtype=np.int64)
    within = np.arange(0, shard_samples, chunk_rows, dtype=np.int64)
    starts = (shards[:, None] + within[None, :]).ravel()
    return starts[starts < samples]


def plan_kwargs(args, partitions: int, block_size: int) -> dict:
    starts = chunk_starts(args.samples, args.shard_samples, args.chunk_rows) if block_size == 0 else None
    return dict(num_samples=args.samples, seed=SEED, fingerprint=FP, global_batch_size=args.global_batch,
                drop_last=True, block_size=block_size, window=args.window, partitions=partitions,
                block_starts=starts)


def row_plan_cost(argv: list[str]) -> None:
    """In a fresh process: plan one rank's epoch; emit wall seconds and the resident-set growth."""
    from dutycycle.loader.plan import rank_plan

    samples, world, rank, batch, block, window, partitions, shard_samples, chunk_rows = (int(a) for a in argv)
    before = peak_rss_bytes()
    # the chunk boundaries are the cache manifest's, read from it once per process (not counted as planning)
    starts = chunk_starts(samples, shard_samples, chunk_rows) if block == 0 else None
    t0, c0 = time.perf_counter(), time.process_time()  # planning only
    plan = rank_plan(samples, SEED, 0, FP, batch, True, rank, world, block_size=block, window=window,
                     partitions=partitions, block_starts=starts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # CPU seconds beside the wall: on a shared machine the wall also counts the other processes' turns
    emit({"plan_s": wall, "plan_cpu_s": cpu, "peak_mib": (peak_rss_bytes() - before) / 2**20, "steps": len(plan),
          "per_step": int(plan.full.shape[1])})


def node_ranks(args, node: int) -> range:
    return range(node * args.ranks_per_node, (node + 1) * args.ranks_per_node)


class Planner:
    """Rank plans for one row; the unpartitioned plan is one global order, computed once and sliced."""

    def __init__(self, args, partitions: int, block_size: int):
        self.args, self.partitions, self.block_size = args, partitions, block_size
        self._global = None

    def rank_steps(self, rank: int) -> np.ndarray:
        """``(steps, per rank)`` split indices of ``rank``'s epoch 0."""
        from dutycycle.loader.plan import rank_bounds, rank_plan

        a = self.args
        if self.partitions > 1:
            kw = plan_kwargs(a, self.partitions, self.block_size)
            return rank_plan(epoch=0, rank=rank, world_size=a.world_size, **kw).full
        if self._global is None:
            self._global = rank_plan(epoch=0, rank=0, world_size=1, **plan_kwargs(a, 1, self.block_size)).full
        lo, hi = rank_bounds(a.global_batch, rank, a.world_size)
        return self._global[:, lo:hi]


def locality(args, planner: Planner) -> dict:
    shard_rows = args.shard_samples
    total_shards = -(-args.samples // shard_rows)
    nodes = args.world_size // args.ranks_per_node
    ideal = total_shards / nodes
    share_bytes = args.samples * args.sample_bytes / nodes
    per_node = {}
    for node in sorted({0, nodes // 2, nodes - 1}):
        rows = np.concatenate([planner.rank_steps(r).ravel() for r in node_ranks(args, node)])
        shards = np.unique(rows // shard_rows)
        per_node[node] = len(shards)
    worst = max(per_node.values())
    return {"shards_per_node": per_node, "shards_ideal": ideal, "shards_per_node_vs_ideal": worst / ideal,
            "disk_copy_vs_share": worst * shard_rows * args.sample_bytes / share_bytes}


def replay_reads(args, steps: np.ndarray) -> dict:
    """One rank's epoch through an LRU chunk cache and an LRU of open shard views, as the ranged reader keeps."""
    per_chunk = max(1, args.chunk_bytes // args.sample_bytes)  # whole rows per chunk (the reader rounds so)
    capacity = max(1, args.cache_bytes // (per_chunk * args.sample_bytes))
    chunks: OrderedDict = OrderedDict()
    views: OrderedDict = OrderedDict()
    fetched_rows = used = reopens = 0
    for batch in steps:
        shard, row = np.divmod(batch, args.shard_samples)
        keys = set(zip(shard.tolist(), (row // per_chunk).tolist(), strict=True))
        for s in set(shard.tolist()):
            if s in views:
                views.move_to_end(s)
            else:
                reopens += 1
                views[s] = True
                if len(views) > args.max_open_shards:
                    views.popitem(last=False)
        for k in keys:
            if k in chunks:
                chunks.move_to_end(k)
            else:
                last = -(-args.shard_samples // per_chunk) - 1
                fetched_rows += per_chunk if k[1] < last else args.shard_samples - last * per_chunk
                chunks[k] = True
        while len(chunks) > max(capacity, len(keys)):  # a batch's chunks always fit (as in the product)
            chunks.popitem(last=False)
        used += len(batch)
    steps_n = max(1, len(steps))
    return {"fetched_bytes": fetched_rows * args.sample_bytes, "used_bytes": used * args.sample_bytes,
            "reopens_per_batch": reopens / steps_n}


def range_reads(args, planner: Planner) -> dict:
    fetched = used = 0
    reopens = []
    for rank in node_ranks(args, 0):
        r = replay_reads(args, planner.rank_steps(rank))
        fetched, used = fetched + r["fetched_bytes"], used + r["used_bytes"]
        reopens.append(r["reopens_per_batch"])
    return {"range_amplification": fetched / used, "reopens_per_batch": max(reopens)}


# ---------------------------------------------------------------------------------------------- quality


def batch_ids(order_batches: np.ndarray, n: int) -> np.ndarray:
    """Each sample's batch number (-1 where dropped), from ``(steps, B)`` batches."""
    out = np.full(n, -1, np.int64)
    out[order_batches.ravel()] = np.repeat(np.arange(len(order_batches)), order_batches.shape[1])
    return out


def batchmate_repeat(e0: np.ndarray, e1: np.ndarray, n: int) -> float:
    """Share of a sample's epoch-0 batch-mates that are batch-mates again in epoch 1 (samples in both epochs)."""
    a, b = batch_ids(e0, n), batch_ids(e1, n)
    keep = (a >= 0) & (b >= 0)
    _, together = np.unique(a[keep] * (b.max() + 1) + b[keep], return_counts=True)
    pairs_again = float((together.astype(np.float64) ** 2).sum() - keep.sum())
    return pairs_again / (keep.sum() * (e0.shape[1] - 1))


def label_entropy(batches: np.ndarray, labels: np.ndarray, classes: int) -> float:
    lab = labels[batches]
    counts = np.zeros((len(batches), classes))
    np.add.at(counts, (np.repeat(np.arange(len(batches)), batches.shape[1]), lab.ravel()), 1)
    p = counts / batches.shape[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)
    return float(h.mean())


def cut_partitions(order: np.ndarray, bounds: np.ndarray, counts: np.ndarray, steps: int) -> np.ndarray:
    """Global batches from an order whose partition ``p`` fills ``order[bounds[p]:bounds[p + 1]]``."""
    parts = [order[bounds[p]: bounds[p] + steps * counts[p]].reshape(steps, counts[p]) for p in range(len(counts))]
    return np.concatenate(parts, axis=1)


def quality(args, py1e_python: str | None) -> dict:
    from dutycycle.loader.plan import partition_counts, plan_epoch

    n, b = args.quality_samples, args.global_batch
    steps = n // b
    labels = np.random.default_rng(1).integers(0, args.classes, n)
    rows = {}

    def record(name, epochs):
        rows[name] = {"batchmate_repeat": batchmate_repeat(epochs[0], epochs[1], n),
                      "label_entropy_bits": label_entropy(epochs[0], labels, args.classes)}

    rng = np.random.default_rng(2)
    record("permutation", [rng.permutation(n)[: steps * b].reshape(steps, b) for _ in range(2)])
    for name, parts, block in row_specs(args):
        starts = chunk_starts(n, args.shard_samples, args.chunk_rows) if block == 0 else None
        record(name, [np.stack(plan_epoch(n, SEED, e, FP, b, True, block_size=block, window=args.window,
                                          partitions=parts, block_starts=starts)) for e in range(2)])
    if py1e_python:
        shard_sizes = np.full(-(-n // args.shard_samples), args.shard_samples, np.int64)
        shard_sizes[-1] = n - args.shard_samples * (len(shard_sizes) - 1)
        counts = partition_counts(b, args.partitions)
        epochs = []
        for e in range(2):
            order = run_py1e(py1e_python, shard_sizes, args.partitions, e, args.window)
            # py1e gives canonical node c the contiguous slice of the order divide_spans made (sizes N / P): cut
            # as the product cuts its partitions
            bounds = np.linspace(0, n, args.partitions + 1).astype(np.int64)
            epochs.append(cut_partitions(order, bounds, counts, min(steps, int(np.min(np.diff(bounds) // counts)))))
        steps_py1e = min(len(epochs[0]), len(epochs[1]))
        record("py1e", [ep[:steps_py1e] for ep in epochs])
    base = rows["permutation"]
    out = {"samples": n, "rows": rows}
    for name in rows:
        if name != "permutation":
            out[f"batchmate_repeat_{name}_vs_permutation"] = rows[name]["batchmate_repeat"] / base["batchmate_repeat"]
            out[f"label_entropy_{name}_vs_permutation"] = rows[name]["label_entropy_bits"] / base["label_entropy_bits"]
    return out


def run_py1e(python: str, shard_sizes: np.ndarray, canonical: int, epoch: int, block: int) -> np.ndarray:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "sizes.npy"), os.path.join(tmp, "order.npy")
        np.save(src, shard_sizes)
        code = ("import sys, numpy as np; sys.path.insert(0, sys.argv[1]); "
                "from benchmarks.loader_peers import import_streaming; import_streaming(); "
                "from streaming.base.shuffle.py1e import get_shuffle_py1e; "
                "np.save(sys.argv[3], get_shuffle_py1e(np.load(sys.argv[2]), int(sys.argv[4]), 0, int(sys.argv[5]), "
                "int(sys.argv[6])))")
        subprocess.run([python, "-c", code, str(HERE.parent), src, dst, str(canonical), str(epoch), str(block)],
                       check=True, capture_output=True)
        return np.load(dst, allow_pickle=False)


# ---------------------------------------------------------------------------------------------- driver


def row_specs(args) -> list[tuple[str, int, int]]:
    """(name, partitions, block size) of each row. ``partitioned`` is the cluster set-up docs/loader.md recommends:
    ``partitions`` canonical partitions and blocks cut at the cache's checksum chunks (``block_size = 0``). Then
    the same partitions with the default blocks of 64; with blocks a chunk long cut where partitions start, not
    where chunks do (the same size, not aligned: what alignment itself buys); and the unpartitioned baseline."""
    return [("partitioned", args.partitions, 0),
            ("partitioned-blocks-64", args.partitions, args.block_size),
            ("partitioned-chunk-sized", args.partitions, args.chunk_rows),
            ("unpartitioned", 1, args.block_size)]


def measure_row(args, name: str, partitions: int, block_size: int) -> dict:
    t0 = time.perf_counter()
    costs = []
    for rank in (0, args.world_size // 2):
        res, _ = run_row([__file__, "--plan-cost", str(args.samples), str(args.world_size), str(rank),
                          str(args.global_batch), str(block_size), str(args.window), str(partitions),
                          str(args.shard_samples), str(args.chunk_rows)],
                         timeout=args.timeout)
        if "error" in res:
            raise SystemExit(f"{name}: planning failed: {res['error']}")
        costs.append(res)
    planner = Planner(args, partitions, block_size)
    row = {"name": name, "partitions": partitions, "block_size": block_size,
           "plan_s_per_rank": max(c["plan_s"] for c in costs),
           "plan_peak_mib_per_rank": max(c["peak_mib"] for c in costs),
           **locality(args, planner), **range_reads(args, planner)}
    row["measure_s"] = time.perf_counter() - t0
    print(f"{name}: plan {row['plan_s_per_rank']:.3f} s, {row['plan_peak_mib_per_rank']:.1f} MiB; shards/node "
          f"{row['shards_per_node_vs_ideal']:.2f}x ideal; range amplification {row['range_amplification']:.2f}",
          file=sys.stderr)
    return row


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan-cost", nargs=9, help=argparse.SUPPRESS)  # a row process
    p.add_argument("--samples", type=int, default=100_000_000)
    p.add_argument("--world-size", type=int, default=1000)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--partitions", type=int, default=None, help="canonical partitions (default: the world size)")
    p.add_argument("--global-batch", type=int, default=None, help="default: 4 samples per rank")
    p.add_argument("--block-size", type=int, default=None, help="default: the loader's")
    p.add_argument("--window", type=int, default=None, help="default: the loader's")
    p.add_argument("--shard-samples", type=int, default=2048, help="rows per shard (100M: ~49k shards)")
    p.add_argument("--sample-bytes", type=int, default=32 * 32 * 3, help="pixel bytes per sample")
    p.add_argument("--quality-samples", type=int, default=4_000_000)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--peers-venv", default=str(HERE / ".peers-venv"))
    p.add_argument("--no-peers-venv", action="store_true", help="leave out py1e (it runs in the peers' venv)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="1M samples, 64 ranks: seconds, for the smoke test")
    p.add_argument("--elastic", action="store_true", help="only the elastic run's plan per rank (scale_elastic)")
    p.add_argument("--elastic-samples", type=int, default=10_000_000)
    p.add_argument("--elastic-workers", type=lambda v: tuple(int(x) for x in v.split(",")), default=(6, 8),
                   help="MIN,MAX workers of the elastic run (default 6,8)")
    p.add_argument("--elastic-batch", type=int, default=None, help="default: 8 x the sizes' least common multiple")
    p.add_argument("--out", default=None, help="default: benchmarks/results/scale.json (scale_elastic.json)")
    args = p.parse_args(argv)
    if args.plan_cost:
        return args
    args.out = args.out or default_out("scale_elastic" if args.elastic else "scale")
    # imported past the row processes' return: a --plan-cost process measures its memory from a small start
    from dutycycle.engine.cache.shards import ReadConfig
    from dutycycle.loader.config import LoaderConfig

    if args.quick:
        args.samples, args.world_size, args.quality_samples = 1_000_000, 64, 200_000
    args.partitions = args.partitions or args.world_size
    args.global_batch = args.global_batch or 4 * args.world_size
    args.block_size = args.block_size or LoaderConfig.block_size
    args.window = args.window or LoaderConfig.window
    read = ReadConfig()
    # the replay is of a ranged reader: its default open limit is the ranged one
    args.chunk_bytes, args.cache_bytes, args.max_open_shards = (read.range_chunk_bytes, read.range_cache_bytes,
                                                                read.open_limit(mapped=False))
    args.chunk_rows = max(1, args.chunk_bytes // args.sample_bytes)  # as materialize records and the reader fetches
    if args.world_size % args.ranks_per_node:
        raise SystemExit(f"--world-size {args.world_size} is not a multiple of --ranks-per-node {args.ranks_per_node}")
    return args


def run(args) -> dict:
    py1e = None
    if not args.no_peers_venv:
        from benchmarks.loader_peers import ensure_venv

        py1e = str(ensure_venv(Path(args.peers_venv)))
    t0 = time.perf_counter()
    rows = [measure_row(args, *spec) for spec in row_specs(args)]
    q = quality(args, py1e)
    product, baseline = rows[0], rows[-1]
    return {
        "benchmark": "scale", "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "plan_cost"},
        **{k: product[k] for k in KEYS},
        "range_amplification_blocks_64": rows[1]["range_amplification"],
        "batchmate_repeat_vs_permutation": q["batchmate_repeat_partitioned_vs_permutation"],
        "batchmate_repeat_blocks_64_vs_permutation": q["batchmate_repeat_partitioned-blocks-64_vs_permutation"],
        "batchmate_repeat_py1e_vs_permutation": q.get("batchmate_repeat_py1e_vs_permutation"),
        "label_entropy_vs_permutation": q["label_entropy_partitioned_vs_permutation"],
        "baseline": {**{k: baseline[k] for k in KEYS},
                     "batchmate_repeat_vs_permutation": q["batchmate_repeat_unpartitioned_vs_permutation"],
                     "label_entropy_vs_permutation": q["label_entropy_unpartitioned_vs_permutation"]},
        "rows": rows, "quality": q, "targets": TARGETS, "wall_s": time.perf_counter() - t0,
    }


# -- the docs' blocks (benchmarks/render_docs.py writes them between a page's render markers) --------------------------


def render(d: dict) -> str:
    st = d["settings"]
    caption = (f"{fmt.count(st['samples'])} samples in shards of {fmt.count(st['shard_samples'])}, {fmt.count(st['world_size'])} "
               f"ranks on {fmt.count(st['world_size'] // st['ranks_per_node'])} nodes of {st['ranks_per_node']}, global "
               f"batch {fmt.count(st['global_batch'])}, {fmt.nbytes(st['sample_bytes'])} per sample; ranged reads in "
               f"{fmt.nbytes(st['chunk_bytes'])} chunks through a {fmt.nbytes(st['cache_bytes'])} chunk cache. Shuffle "
               f"quality from {fmt.count(d['quality']['samples'])} samples over two epochs.")
    def blocks(n: int) -> str:
        return "blocks at the cache's chunks" if n == 0 else f"blocks of {fmt.count(n)}"

    rows = [[f"{r['name']} ({fmt.count(r['partitions'])} partition{'s' if r['partitions'] > 1 else ''}, "
             f"{blocks(r['block_size'])})",
             fmt.secs(r["plan_s_per_rank"]), fmt.mib(r["plan_peak_mib_per_rank"]), fmt.times(r["shards_per_node_vs_ideal"]),
             fmt.times(r["disk_copy_vs_share"]), fmt.times(r["range_amplification"]), f"{r['reopens_per_batch']:.3g}"]
            for r in d["rows"]]
    headers = ["plan", "plan per rank", "plan memory per rank", "shards per node vs ideal",
               "node-local copy vs share", "range bytes fetched per used", "shard reopens per batch"]
    q = d["quality"]["rows"]
    qrows = [[name, f"{v['batchmate_repeat']:.3g}", f"{v['label_entropy_bits']:.4g}"] for name, v in q.items()]
    return "\n\n".join([fmt.para(caption), fmt.table(headers, rows),
                         fmt.table(["shuffle", "batch-mates met again next epoch", "label entropy per batch (bits)"],
                               qrows), fmt.source("scale")])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan_cost:
        row_plan_cost(args.plan_cost)
        return 0
    if args.elastic:
        write_result(args.out, elastic_plan(args), ("partitions", "plan_s_per_rank", "plan_cpu_s_per_rank",
                                                    "plan_peak_mib_per_rank", "plan_cpu_s_vs_baseline",
                                                    "plan_mib_vs_baseline"))
        return 0
    result = run(args)
    rows, q = result["rows"], result["quality"]
    print(markdown_table(["row", "plan s/rank", "plan MiB/rank", "shards/node vs ideal", "range amplification",
                          "reopens/batch"],
                         [[r["name"], r["plan_s_per_rank"], r["plan_peak_mib_per_rank"], r["shards_per_node_vs_ideal"],
                           r["range_amplification"], r["reopens_per_batch"]] for r in rows]), file=sys.stderr)
    print(json.dumps(q["rows"], indent=1), file=sys.stderr)
    write_result(args.out, result, KEYS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
