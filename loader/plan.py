"""The sample plan: which samples form each global batch, as pure functions of (seed, epoch, fingerprint, ...).

Nothing here touches files, processes or clocks, so the plan can be tested, printed (``dutycycle plan``) and
recomputed anywhere: a resumed run, another rank, or a run at another world size all derive the same batches.

The shuffle (``epoch_order``) is a block shuffle followed by a window shuffle:

1. **Key.** ``sha256("dutycycle-plan:v1:{seed}:{epoch}:{fingerprint}")`` seeds a NumPy ``PCG64`` generator. A new
   epoch, seed or cache gives an unrelated order; nothing else (world size, rank, wall clock) enters it.
2. **Block shuffle.** The split's sample indices ``0..N-1`` (cache order: sorted by sample id) are cut into blocks
   of ``block_size`` consecutive indices (the last block may be short), or, with ``block_size = 0``, where the
   cache's checksum chunks start (``block_starts``: a block is the split's rows in one chunk, so a reader that
   fetches by chunk uses each chunk it fetches for one block), and the blocks are permuted. Each block is a run
   of neighbouring rows of one shard, so reads stay sequential within a block.
3. **Window shuffle.** The block-shuffled sequence is cut into windows of ``window`` consecutive positions and each
   window is permuted independently. A batch therefore mixes samples from ``window / block_size`` randomly chosen
   blocks, while a reader that works a window at a time touches only those blocks.

Because the cache is ordered by sample id (a content hash), neighbouring rows are already unrelated in label and
source, so blocks of 64 lose little randomness compared with a full permutation; the window shuffle removes the
remaining in-block order.

**Canonical partitions** (``partitions``, MosaicML Streaming's "canonical nodes"). The split's indices are cut
into ``partitions`` contiguous ranges, and each range is shuffled on its own (steps 1-3, keyed by its number as
well). Global batch ``s`` is the concatenation, partition by partition, of ``counts[p]`` consecutive positions of
partition ``p``'s order (``counts`` splits the global batch as evenly as it goes; each range's size is in
proportion, so every partition lasts exactly the epoch). A rank's batch is a contiguous slice of the global batch
(``rank_slice``), so the sequence of global batches, and every sample's place in it, is the same at any world
size; and a node whose ranks hold the global batch's positions ``[n * B / nodes, (n + 1) * B / nodes)`` reads
only partitions ``[n * P / nodes, (n + 1) * P / nodes)`` when the node count divides both ``P`` and ``B``: a
contiguous run of cache rows, so a few shards. With one partition (the default) this is the plain shuffle of the
whole split; the order does not depend on the physical layout, only on the partition count, which is why that
count is a plan input (fixed for a run) and the node count is not.

The epoch is cut into ``N // global_batch_size`` full global batches; with ``drop_last`` the rest is dropped,
otherwise it forms a final short batch (every partition's remaining positions, in partition order).

**Cost.** ``rank_plan`` computes only the partitions a rank's slice touches: with at least as many partitions as
ranks that is O(N / world size) time and memory per rank, not O(N) (``plan_epoch``, every global batch, is for
tests, the CLI and whole-epoch tools).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from dutycycle.engine.errors import ConfigError

from .config import DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW

# The plan's own version: bump it whenever the same inputs would give other batches (a new shuffle, key or cut).
# It enters the shuffle key and every loader state, so a state saved under another plan is refused, not misread.
PLAN_VERSION = 1


def plan_key(seed: int, epoch: int, fingerprint: str) -> int:
    """The 64-bit key of one epoch's shuffle: a hash of (seed, epoch, fingerprint), independent of world size."""
    digest = hashlib.sha256(f"dutycycle-plan:v{PLAN_VERSION}:{int(seed)}:{int(epoch)}:{fingerprint}".encode())
    return int.from_bytes(digest.digest()[:8], "little")


def partition_key(seed: int, epoch: int, fingerprint: str, partition: int, partitions: int) -> int:
    """The shuffle key of one canonical partition; with one partition it is ``plan_key`` (the unpartitioned plan)."""
    if partitions == 1:
        return plan_key(seed, epoch, fingerprint)
    text = f"dutycycle-plan:v{PLAN_VERSION}:{int(seed)}:{int(epoch)}:{fingerprint}:partition:{partition}/{partitions}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _check_shuffle(block_size: int, window: int, block_starts=None) -> None:
    if block_size == 0 and block_starts is None:
        raise ConfigError("block_size=0 cuts shuffle blocks at a cache's checksum chunks, and no chunk boundaries "
                          "were given (block_starts); use a block_size >= 1, or a cache loader")
    if block_size < 0 or window < 1:
        raise ConfigError(f"block_size={block_size} must be at least 0 and window={window} at least 1")


def shuffled(num_samples: int, key: int, block_size: int = DEFAULT_BLOCK_SIZE,
             window: int = DEFAULT_WINDOW, starts: np.ndarray | None = None) -> np.ndarray:
    """A permutation of ``0..num_samples-1`` (int64): the block shuffle then the window shuffle, keyed by ``key``.
    Blocks are ``block_size`` positions each, or start at ``starts`` (sorted, the first 0) when given."""
    _check_shuffle(block_size, window, starts)
    if num_samples == 0:
        return np.arange(0, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(key))
    if starts is None:
        num_blocks = -(-num_samples // block_size)
        starts = rng.permutation(num_blocks).astype(np.int64) * block_size
        lengths = np.minimum(block_size, num_samples - starts)
    else:
        bounds = np.append(np.asarray(starts, dtype=np.int64), num_samples)
        assert bounds[0] == 0 and np.all(np.diff(bounds) > 0), "block starts must rise from 0 inside the range"
        perm = rng.permutation(len(bounds) - 1)
        starts, lengths = bounds[:-1][perm], np.diff(bounds)[perm]
    # Concatenate the permuted blocks: position p belongs to block b and is offset p - first[b] into it.
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    within = np.arange(num_samples, dtype=np.int64) - np.repeat(first, lengths)
    order = np.repeat(starts, lengths) + within
    # Window shuffle: sort by (window id, random key), i.e. an independent permutation of every window.
    keys = rng.random(num_samples)
    windows = np.arange(num_samples, dtype=np.int64) // window
    return order[np.lexsort((keys, windows))]


def epoch_order(
    num_samples: int,
    seed: int,
    epoch: int,
    fingerprint: str,
    shuffle: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    window: int = DEFAULT_WINDOW,
    block_starts: np.ndarray | None = None,
) -> np.ndarray:
    """All ``num_samples`` indices in this epoch's order, unpartitioned (a permutation of ``0..num_samples-1``)."""
    if num_samples < 0:
        raise ConfigError(f"num_samples={num_samples} is negative; pass the size of the split")
    _check_shuffle(block_size, window, block_starts)
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return shuffled(num_samples, plan_key(seed, epoch, fingerprint), block_size, window, block_starts)


# ------------------------------------------------------------------------------------------- canonical partitions


def check_partitions(partitions: int, global_batch_size: int) -> None:
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        auto = (" (0, sized for the world, is resolved by a Loader or the trainer: default_partitions gives the "
                "number for a plan made here)") if partitions == 0 else ""
        raise ConfigError(f"partitions={partitions!r} is invalid; use an integer >= 1{auto}")
    if partitions > global_batch_size:
        raise ConfigError(
            f"partitions={partitions} is more than global_batch_size={global_batch_size}: every global batch takes at "
            "least one sample from every partition; use at most as many partitions as the global batch has samples"
        )


def default_partitions(sizes, global_batch_size: int) -> int:
    """The canonical partition count a training plan takes by default, for a run that may train at any world
    size in ``sizes`` (a fixed run: one size). A plan input, so it follows from the largest size the run may
    reach, never from the size it happens to run at.

    The rule: the least common multiple of every size, when the global batch holds that many samples (each
    global batch takes at least one sample from every partition); otherwise the multiple of the largest size,
    at most the global batch, that the most sizes divide (the smallest of those). So ``[2, 3]`` gives 6,
    ``[2, 4]`` 12, a fixed 4 gives 4 and one worker 1 (the unpartitioned plan). Why: a rank touches at most
    ``P / W + 1`` partitions, so its planning cost is O(N / W + N / P) instead of O(N), within twice the least
    it can be at every size (``P >= max``); and a node count that divides ``P`` (and the global batch) reads
    only its own partitions, which every node count does when every world size divides ``P``."""
    sizes = sorted({int(w) for w in sizes})
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"sizes={sizes} must be world sizes >= 1")
    lcm = math.lcm(*sizes)
    if lcm <= global_batch_size:
        return lcm
    top = sizes[-1]
    if top > global_batch_size:
        raise ConfigError(f"global_batch_size={global_batch_size} is smaller than the largest world size {top}: "
                          "every rank needs at least one sample of each global batch")
    best, most = top, -1
    for p in range(top, global_batch_size + 1, top):
        divides = sum(p % w == 0 for w in sizes)
        if divides > most:
            best, most = p, divides
    return best


def partition_counts(global_batch_size: int, partitions: int) -> np.ndarray:
    """Samples each partition gives every global batch: ``global_batch_size`` split as evenly as it goes, with
    partition ``p``'s share starting at position ``floor(p * B / P)``. So whenever the node count divides both
    ``B`` and ``P``, node ``n``'s positions ``[n * B / nodes, (n + 1) * B / nodes)`` are exactly partitions
    ``[n * P / nodes, (n + 1) * P / nodes)``, even when ``P`` does not divide ``B``."""
    check_partitions(partitions, global_batch_size)
    cum = (np.arange(partitions + 1, dtype=np.int64) * global_batch_size) // partitions
    return np.diff(cum)


def partition_bounds(num_samples: int, global_batch_size: int, partitions: int) -> np.ndarray:
    """``partitions + 1`` split indices: partition ``p`` holds ``[bounds[p], bounds[p + 1])``.

    Sizes are in proportion to the counts: with ``N = k * B + r``, partition ``p`` holds ``k * counts[p]``
    samples plus its share of the ``r`` left over, so each lasts the ``k`` full batches exactly."""
    counts = partition_counts(global_batch_size, partitions)
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    k, r = divmod(int(num_samples), int(global_batch_size))
    return k * cum + (r * cum) // global_batch_size


def partition_order(num_samples: int, seed: int, epoch: int, fingerprint: str, global_batch_size: int,
                    partitions: int, partition: int, shuffle: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
                    window: int = DEFAULT_WINDOW, block_starts: np.ndarray | None = None) -> np.ndarray:
    """Partition ``partition``'s split indices in this epoch's order (a permutation of its range). With
    ``block_starts`` (split indices where blocks start: a cache's chunk boundaries) the partition's blocks are
    those, cut at the partition's own ends too."""
    bounds = partition_bounds(num_samples, global_batch_size, partitions)
    lo, hi = int(bounds[partition]), int(bounds[partition + 1])
    _check_shuffle(block_size, window, block_starts)
    if not shuffle:
        return np.arange(lo, hi, dtype=np.int64)
    local = None
    if block_starts is not None:
        inside = block_starts[np.searchsorted(block_starts, lo, "right"):np.searchsorted(block_starts, hi, "left")]
        local = np.concatenate([[0], inside - lo]).astype(np.int64)
    key = partition_key(seed, epoch, fingerprint, partition, partitions)
    return lo + shuffled(hi - lo, key, block_size, window, local)


def plan_epoch(
    num_samples: int,
    seed: int,
    epoch: int,
    fingerprint: str,
    global_batch_size: int,
    drop_last: bool,
    shuffle: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    window: int = DEFAULT_WINDOW,
    partitions: int = 1,
    block_starts: np.ndarray | None = None,
) -> list[np.ndarray]:
    """The epoch's global batches: a list of int64 arrays of sample indices within the split. O(N): for tests,
    the CLI and whole-epoch tools; a rank's loader uses ``rank_plan``."""
    plan = rank_plan(num_samples, seed, epoch, fingerprint, global_batch_size, drop_last, rank=0, world_size=1,
                     shuffle=shuffle, block_size=block_size, window=window, partitions=partitions,
                     block_starts=block_starts)
    return [plan.indices(step) for step in range(len(plan))]


class RankPlan:
    """One rank's samples for every step of one epoch. ``indices(step)`` is ``rank_slice`` of that global batch.

    The full steps are one ``(steps, global_batch_size // world_size)`` array, built from the partitions this
    rank's slice touches; the short last batch (``drop_last=False``) is built when it is first asked for."""

    def __init__(self, full: np.ndarray, tail_len: int, tail_fn):
        self.full, self.tail_len, self._tail_fn, self._tail = full, tail_len, tail_fn, None

    def __len__(self) -> int:
        return len(self.full) + (self.tail_len > 0)

    def indices(self, step: int) -> np.ndarray:
        if step < len(self.full):
            return self.full[step]
        if step == len(self.full) and self.tail_len > 0:
            if self._tail is None:
                self._tail = self._tail_fn()
            return self._tail
        raise IndexError(f"step {step} is outside this epoch's {len(self)} steps")


def _overlaps(starts: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(p, a, b)`` for each segment ``p`` (segments ``[starts[p], starts[p + 1])``) overlapping ``[lo, hi)``,
    with ``[a, b)`` the overlap in the segment's own positions."""
    out = []
    for p in range(len(starts) - 1):
        a, b = max(int(starts[p]), lo), min(int(starts[p + 1]), hi)
        if a < b:
            out.append((p, a - int(starts[p]), b - int(starts[p])))
    return out


def rank_plan(
    num_samples: int,
    seed: int,
    epoch: int,
    fingerprint: str,
    global_batch_size: int,
    drop_last: bool,
    rank: int,
    world_size: int,
    shuffle: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    window: int = DEFAULT_WINDOW,
    partitions: int = 1,
    block_starts: np.ndarray | None = None,
) -> RankPlan:
    """``rank``'s part of every global batch of the epoch, computing only the partitions it reads."""
    if num_samples < 0:
        raise ConfigError(f"num_samples={num_samples} is negative; pass the size of the split")
    if global_batch_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size} must be at least 1")
    _check_shuffle(block_size, window, block_starts)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} is outside world_size={world_size}; use 0 <= rank < world_size")
    counts = partition_counts(global_batch_size, partitions)
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    k = num_samples // global_batch_size
    orders: dict[int, np.ndarray] = {}

    def order(p: int) -> np.ndarray:
        if p not in orders:
            orders[p] = partition_order(num_samples, seed, epoch, fingerprint, global_batch_size, partitions, p,
                                        shuffle, block_size, window, block_starts)
        return orders[p]

    # Full batches: this rank's positions of every global batch, partition segment by segment.
    lo, hi = rank_bounds(global_batch_size, rank, world_size)
    parts = [order(p)[: k * counts[p]].reshape(k, int(counts[p]))[:, a:b] for p, a, b in _overlaps(cum, lo, hi)]
    full = np.concatenate(parts, axis=1) if parts else np.zeros((k, 0), dtype=np.int64)
    full = np.ascontiguousarray(full)
    orders.clear()  # the tail (rare: drop_last=False) recomputes what it needs
    # The short last batch: what each partition has left after k batches, in partition order.
    tail_len = 0 if drop_last else num_samples - k * global_batch_size
    bounds = partition_bounds(num_samples, global_batch_size, partitions)
    left = (bounds[1:] - bounds[:-1]) - k * counts
    tail_starts = np.concatenate([[0], np.cumsum(left)]).astype(np.int64)

    def tail() -> np.ndarray:
        a, b = rank_bounds(tail_len, rank, world_size)
        pieces = [order(p)[k * counts[p]:][x:y] for p, x, y in _overlaps(tail_starts, a, b)]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    return RankPlan(full, tail_len, tail)


def num_steps(num_samples: int, global_batch_size: int, drop_last: bool) -> int:
    """How many global batches ``plan_epoch`` returns, without computing the order."""
    if drop_last:
        return num_samples // global_batch_size
    return -(-num_samples // global_batch_size)


def rank_bounds(batch_len: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s contiguous slice of a global batch of ``batch_len`` samples.

    A full batch splits evenly (the loader checks divisibility). A short last batch (``drop_last=False``) is
    split as evenly as possible: the first ``batch_len % world_size`` ranks get one sample more, and a rank may
    get none when the batch is shorter than the world size.
    """
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} is outside world_size={world_size}; use 0 <= rank < world_size")
    base, extra = divmod(batch_len, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_slice(global_batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """``rank``'s contiguous part of ``global_batch``; concatenating all ranks' parts gives the global batch."""
    start, stop = rank_bounds(len(global_batch), rank, world_size)
    return global_batch[start:stop]


# ------------------------------------------------------------------------------------------ one batch, one sample
# What a trace asks of the plan: the samples of one global batch, and where one sample falls in an epoch, without
# building the epoch. ``shuffled`` draws the block permutation (O(N / block) draws) and then one uniform key per
# position; PCG64 spends exactly one 64-bit draw per key (``Generator.random``), so the keys of any window are
# reached by ``advance``-ing the generator past the positions before it, and only the windows a batch touches
# are sorted.


def shuffled_slice(num_samples: int, key: int, lo: int, hi: int, block_size: int = DEFAULT_BLOCK_SIZE,
                   window: int = DEFAULT_WINDOW, starts: np.ndarray | None = None) -> np.ndarray:
    """``shuffled(num_samples, key, ...)[lo:hi]``, computing only the windows that hold positions ``lo..hi-1``."""
    _check_shuffle(block_size, window, starts)
    lo, hi = max(0, int(lo)), min(int(num_samples), int(hi))
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(key))
    if starts is None:  # the same draws as ``shuffled``, in the same order
        num_blocks = -(-num_samples // block_size)
        block_first = rng.permutation(num_blocks).astype(np.int64) * block_size
        lengths = np.minimum(block_size, num_samples - block_first)
    else:
        bounds = np.append(np.asarray(starts, dtype=np.int64), num_samples)
        perm = rng.permutation(len(bounds) - 1)
        block_first, lengths = bounds[:-1][perm], np.diff(bounds)[perm]
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    w_lo, w_hi = (lo // window) * window, min(num_samples, -(-hi // window) * window)
    positions = np.arange(w_lo, w_hi, dtype=np.int64)
    block = np.searchsorted(first, positions, side="right") - 1
    order = block_first[block] + (positions - first[block])
    rng.bit_generator.advance(w_lo)  # skip the keys of the positions before the first window needed
    keys = rng.random(w_hi - w_lo)
    return order[np.lexsort((keys, positions // window))][lo - w_lo:hi - w_lo]


def _partition_slice(num_samples: int, seed: int, epoch: int, fingerprint: str, global_batch_size: int,
                     partitions: int, partition: int, a: int, b: int, shuffle: bool, block_size: int, window: int,
                     block_starts: np.ndarray | None) -> np.ndarray:
    """``partition_order(...)[a:b]`` without the rest of the partition's order."""
    bounds = partition_bounds(num_samples, global_batch_size, partitions)
    lo, hi = int(bounds[partition]), int(bounds[partition + 1])
    if not shuffle:
        return np.arange(lo, hi, dtype=np.int64)[a:b]
    local = None
    if block_starts is not None:
        inside = block_starts[np.searchsorted(block_starts, lo, "right"):np.searchsorted(block_starts, hi, "left")]
        local = np.concatenate([[0], inside - lo]).astype(np.int64)
    key = partition_key(seed, epoch, fingerprint, partition, partitions)
    return lo + shuffled_slice(hi - lo, key, a, b, block_size, window, local)


def global_batch(num_samples: int, seed: int, epoch: int, fingerprint: str, global_batch_size: int, drop_last: bool,
                 step: int, shuffle: bool = True, block_size: int = DEFAULT_BLOCK_SIZE, window: int = DEFAULT_WINDOW,
                 partitions: int = 1, block_starts: np.ndarray | None = None) -> np.ndarray:
    """``plan_epoch(...)[step]`` (the split indices of one global batch), computing only the windows it touches."""
    if not 0 <= step < num_steps(num_samples, global_batch_size, drop_last):
        raise ConfigError(f"step={step} is outside this epoch's {num_steps(num_samples, global_batch_size, drop_last)} "
                          "global batches")
    _check_shuffle(block_size, window, block_starts)
    counts = partition_counts(global_batch_size, partitions)
    k = num_samples // global_batch_size
    bounds = partition_bounds(num_samples, global_batch_size, partitions)
    pieces = []
    for p in range(partitions):
        c = int(counts[p])
        a, b = (step * c, (step + 1) * c) if step < k else (k * c, int(bounds[p + 1] - bounds[p]))
        pieces.append(_partition_slice(num_samples, seed, epoch, fingerprint, global_batch_size, partitions, p, a, b,
                                       shuffle, block_size, window, block_starts))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def sample_place(num_samples: int, seed: int, epoch: int, fingerprint: str, global_batch_size: int, drop_last: bool,
                 index: int, shuffle: bool = True, block_size: int = DEFAULT_BLOCK_SIZE, window: int = DEFAULT_WINDOW,
                 partitions: int = 1, block_starts: np.ndarray | None = None) -> tuple[int, int] | None:
    """Where split index ``index`` falls in ``epoch``: ``(global batch, position in it)``, or None when the epoch
    drops it (``drop_last``). Computes the order of the one partition that holds it."""
    if not 0 <= index < num_samples:
        raise ConfigError(f"index={index} is outside the split's {num_samples} samples")
    counts = partition_counts(global_batch_size, partitions)
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    bounds = partition_bounds(num_samples, global_batch_size, partitions)
    p = int(np.searchsorted(bounds, index, side="right") - 1)
    order = partition_order(num_samples, seed, epoch, fingerprint, global_batch_size, partitions, p, shuffle,
                            block_size, window, block_starts)
    q = int(np.flatnonzero(order == index)[0])
    k, c = num_samples // global_batch_size, int(counts[p])
    if q < k * c:
        return q // c, int(cum[p]) + q % c
    if drop_last:
        return None
    left = (bounds[1:] - bounds[:-1]) - k * counts  # each partition's share of the short last batch, in order
    return k, int(np.sum(left[:p])) + (q - k * c)
