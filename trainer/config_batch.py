"""The global batch at every world size a run may train at (``parallel.num_workers = [min, max]``), checked at
config time, and the numbers a worker takes at the size it actually runs at.

``data.global_batch_size`` (B) is samples per optimizer step, fixed for the run. At any world size each of the D
data-parallel ranks (workers / ``parallel.tensor``) takes the contiguous B / D samples of every global batch
(loader/plan.py: ``rank_slice``), so step N trains on the same samples in the same order at every size.

``data.micro_batches`` (M) keeps its meaning at the largest size: there each rank runs M micro-batches of at most
``m = ceil(B / (D_max * M))`` samples. At a smaller size a rank holds more samples and runs
``ceil(B / (D * m))`` micro-batches, cut as evenly as they go (sizes differ by at most one: step/loop.py uses
``torch.tensor_split``), so no micro-batch is larger than at the largest size and a shrink does not raise the
memory a step needs. Each micro-batch's loss is weighted by its share of the rank's samples and the gradient
exchange averages the ranks' equal shares, so every step is the mean over the global batch at every size; only
the order of the sums differs. Example: B = 12, ``num_workers = [2, 3]``, M = 2: m = 2; at 3 workers 4 samples
each in 2 micro-batches of 2; at 2 workers 6 samples each in 3 micro-batches of 2.

A size whose data-parallel rank count does not divide B would give ranks unequal shares, which the averaging
exchange would weigh wrongly: such a size is refused at config time, naming the sizes that work and global batch
sizes that work at every size. Every size must also form the parallel layout (``parallel.tensor``,
``node_size``, ``replicate``, ``hpz``): each is checked as the fixed-size config it becomes.
"""

from __future__ import annotations

import dataclasses
import math

from dutycycle.engine.errors import ConfigError
from dutycycle.loader.plan import default_partitions


def _range_text(par) -> str:
    return f"[{par.min_workers}, {par.num_workers}]" if par.elastic else str(par.num_workers)


def data_ranks(par, world_size: int) -> int:
    """Data-parallel ranks at ``world_size`` workers: a tensor-parallel group's ranks share one slice."""
    return world_size // max(1, par.tensor)


def micro_batch_size(cfg) -> int:
    """The largest micro-batch, in samples: ``ceil(B / (D_max * M))``, what one rank runs at the largest size."""
    per_rank = cfg.data.global_batch_size // data_ranks(cfg.parallel, cfg.parallel.num_workers)
    return -(-per_rank // cfg.data.micro_batches)


def micro_batches_at(cfg, world_size: int) -> int:
    """Micro-batches per optimizer step on each rank at ``world_size`` workers: ``data.micro_batches`` at the
    largest size, else as many as keep every micro-batch within ``micro_batch_size``."""
    if world_size == cfg.parallel.num_workers:
        return cfg.data.micro_batches
    per_rank = cfg.data.global_batch_size // data_ranks(cfg.parallel, world_size)
    return -(-per_rank // micro_batch_size(cfg))


def size_problem(cfg, world_size: int) -> str | None:
    """Why the global batch does not split over ``world_size`` workers, or None when it does."""
    par, b = cfg.parallel, cfg.data.global_batch_size
    if world_size % max(1, par.tensor):
        return f"parallel.tensor = {par.tensor} does not divide {world_size} workers"
    d = data_ranks(par, world_size)
    if b % d:
        ranks = f"{d} data-parallel ranks" if par.tensor > 1 else f"{d} workers"
        return f"{b} samples do not split evenly over {ranks}"
    return None


def check_batch(cfg) -> None:
    """The global batch against every size the run may take, and ``data.micro_batches`` at the largest."""
    par, d = cfg.parallel, cfg.data
    b, m = d.global_batch_size, d.micro_batches
    sizes = list(par.sizes)
    bad = {w: why for w in sizes if (why := size_problem(cfg, w))}
    if bad and not par.elastic:
        per_step = data_ranks(par, par.num_workers)
        raise ConfigError(f"data.global_batch_size = {b} does not split evenly over parallel.num_workers = "
                          f"{par.num_workers} ({bad[par.num_workers]}); choose a multiple of {per_step}")
    if bad:
        good = [w for w in sizes if w not in bad]
        step = math.lcm(*(data_ranks(par, w) for w in sizes if w % max(1, par.tensor) == 0))
        lower, upper = (b // step) * step, -(-b // step) * step
        batches = " or ".join(str(v) for v in dict.fromkeys((lower, upper)) if v > 0)
        works = "it splits at none of them"
        if good:
            runs: list[list[int]] = []
            for w in good:  # consecutive sizes that split; the widest (the larger on a tie) is suggested
                runs[-1:] = [runs[-1] + [w]] if runs and runs[-1][-1] == w - 1 else [*runs[-1:], [w]]
            lo, hi = max(runs, key=lambda r: (len(r), r[-1]))[0], max(runs, key=lambda r: (len(r), r[-1]))[-1]
            works = (f"it splits at {', '.join(map(str, good))} workers (parallel.num_workers = [{lo}, {hi}] "
                     "splits at every size)")
        raise ConfigError(
            f"data.global_batch_size = {b} does not split at every size of parallel.num_workers = "
            f"{_range_text(par)}: at {', '.join(f'{w} ({why})' for w, why in bad.items())}. Every size trains on "
            f"the same global batches, each rank an equal share; {works}. Or use a global batch every size "
            f"divides: {batches} (multiples of {step})")
    top = b // data_ranks(par, par.num_workers)
    if m > top:
        raise ConfigError(f"data.micro_batches = {m} is more than the {top} samples each rank takes at "
                          f"parallel.num_workers = {par.num_workers} (data.global_batch_size = {b}): a micro-batch "
                          f"would be empty; use at most {top}")
    if not d.drop_last and par.num_workers * m > 1:
        # A short last batch splits unevenly over ranks and micro-batches, and the gradient sync averages equal
        # shares: the step would no longer be the mean over the global batch (or a rank could get no sample).
        raise ConfigError(
            f"data.drop_last = false needs parallel.num_workers x data.micro_batches = 1 (got "
            f"{par.num_workers * m}); keep data.drop_last = true for distributed or accumulated training"
        )


def check_layouts(cfg) -> None:
    """Each smaller size of an elastic run as the fixed-size parallel layout it becomes (tensor groups inside a
    node, ``node_size`` dividing the workers, hpZ's secondary group, ``replicate`` groups): refused naming the sizes
    that fail, why (the first), and the fix: the smallest ``min`` from which every size forms it, or the fixed
    sizes that do."""
    par = cfg.parallel
    failures = {}
    for w in par.sizes:
        if w == par.num_workers:
            continue  # the section's own check
        try:
            dataclasses.replace(par, num_workers=w, min_workers=0).check("parallel")
        except ConfigError as e:
            failures[w] = str(e)
    if not failures:
        return
    fine = [w for w in par.sizes if w not in failures]
    tail = [w for w in par.sizes if all(m not in failures for m in range(w, par.num_workers + 1))]
    fix = (f"raise the minimum: parallel.num_workers = [{tail[0]}, {par.num_workers}]" if tail[0] < par.num_workers
           else f"train at a fixed size ({' or '.join(map(str, fine))} works) or change the layout")
    first = min(failures)
    raise ConfigError(f"parallel.num_workers = {_range_text(par)} cannot train at {len(failures)} of its sizes "
                      f"({', '.join(map(str, sorted(failures)))}); at {first} workers: {failures[first]}. "
                      f"{fix[0].upper() + fix[1:]}")


def with_partitions(cfg):
    """``cfg`` with ``data.partitions = 0`` (the default) resolved for every size the run may take
    (``plan.default_partitions``); a number already there is kept: it is a plan input, fixed for the run."""
    loader = cfg.data.loader
    if loader.partitions:
        return cfg
    par = cfg.parallel
    p = default_partitions([data_ranks(par, w) for w in par.sizes if w % max(1, par.tensor) == 0] or [1],
                           loader.global_batch_size)
    if cfg.data.source == "synthetic":
        p = 1  # arrays in memory, a few thousand samples: nothing to read locally, nothing to plan at scale
    data = dataclasses.replace(cfg.data, loader=dataclasses.replace(loader, partitions=p))
    return dataclasses.replace(cfg, data=data)


def keep_run_partitions(cfg, old: dict) -> int | None:
    """On a resume: ``data.partitions`` at its default for this config's sizes, where the run was planned with
    another count (its config ``old``, a tree), takes the run's count back into ``cfg`` (in place) and returns it;
    None when nothing was taken. The count is a plan input, fixed for the run: a resume at another fixed size
    (``--set parallel.num_workers=1``) continues the run's own plan instead of being refused as a data change.
    A count given on purpose that differs from the default is left as it is, for the resume's check."""
    saved = (old.get("data") or {}).get("partitions")
    loader = cfg.data.loader
    if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1 or saved == loader.partitions:
        return None
    if loader.partitions != with_partitions(_auto(cfg)).data.loader.partitions:
        return None
    cfg.data.loader = dataclasses.replace(loader, partitions=saved)
    return saved


def _auto(cfg):
    data = dataclasses.replace(cfg.data, loader=dataclasses.replace(cfg.data.loader, partitions=0))
    return dataclasses.replace(cfg, data=data)
