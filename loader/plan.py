"""The sample plan: which samples form each global batch, as pure functions of (seed, epoch, fingerprint, ...).

Nothing here touches files, processes or clocks, so the plan can be tested, printed (``dutycycle plan``) and
recomputed anywhere: a resumed run, another rank, or a run at another world size all derive the same batches.

The shuffle (``epoch_order``) is a block shuffle followed by a window shuffle:

1. **Key.** ``sha256("dutycycle-plan:v1:{seed}:{epoch}:{fingerprint}")`` seeds a NumPy ``PCG64`` generator. A new
   epoch, seed or cache gives an unrelated order; nothing else (world size, rank, wall clock) enters it.
2. **Block shuffle.** The split's sample indices ``0..N-1`` (cache order: sorted by sample id) are cut into blocks
   of ``block_size`` consecutive indices (the last block may be short), and the blocks are permuted. Each block is
   a run of neighbouring rows of one shard, so reads stay sequential within a block.
3. **Window shuffle.** The block-shuffled sequence is cut into windows of ``window`` consecutive positions and each
   window is permuted independently. A batch therefore mixes samples from ``window / block_size`` randomly chosen
   blocks, while a reader that works a window at a time touches only those blocks.

Because the cache is ordered by sample id (a content hash), neighbouring rows are already unrelated in label and
source, so blocks of 64 lose little randomness compared with a full permutation; the window shuffle removes the
remaining in-block order.

The epoch's order is cut into global batches of ``global_batch_size`` consecutive positions; with ``drop_last`` a
final short batch is dropped, otherwise it is kept. A rank's batch is a contiguous slice of the global batch
(``rank_slice``), so the sequence of global batches, and every sample's place in it, is the same at any world size.
"""

from __future__ import annotations

import hashlib

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


def epoch_order(
    num_samples: int,
    seed: int,
    epoch: int,
    fingerprint: str,
    shuffle: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    window: int = DEFAULT_WINDOW,
) -> np.ndarray:
    """All ``num_samples`` indices in this epoch's order (a permutation of ``0..num_samples-1``, int64)."""
    if num_samples < 0:
        raise ConfigError(f"num_samples={num_samples} is negative; pass the size of the split")
    if block_size < 1 or window < 1:
        raise ConfigError(f"block_size={block_size} and window={window} must both be at least 1")
    if not shuffle or num_samples == 0:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(plan_key(seed, epoch, fingerprint)))
    num_blocks = -(-num_samples // block_size)
    starts = rng.permutation(num_blocks).astype(np.int64) * block_size
    lengths = np.minimum(block_size, num_samples - starts)
    # Concatenate the permuted blocks: position p belongs to block b and is offset p - first[b] into it.
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    within = np.arange(num_samples, dtype=np.int64) - np.repeat(first, lengths)
    order = np.repeat(starts, lengths) + within
    # Window shuffle: sort by (window id, random key), i.e. an independent permutation of every window.
    keys = rng.random(num_samples)
    windows = np.arange(num_samples, dtype=np.int64) // window
    return order[np.lexsort((keys, windows))]


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
) -> list[np.ndarray]:
    """The epoch's global batches: a list of int64 arrays of sample indices within the split."""
    if global_batch_size < 1:
        raise ConfigError(f"global_batch_size={global_batch_size} must be at least 1")
    order = epoch_order(num_samples, seed, epoch, fingerprint, shuffle, block_size, window)
    stop = (num_samples // global_batch_size) * global_batch_size if drop_last else num_samples
    return [order[i : i + global_batch_size] for i in range(0, stop, global_batch_size)]


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
