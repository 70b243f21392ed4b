"""Choosing a checkpoint to continue from, verifying it, and loading it into a parallelized model.

Selection (``checkpoint.resume = "auto"``): rank 0 lists the step directories, newest first; each is a candidate
only with a manifest. The ranks verify a candidate together (each checks the sizes and checksums of every W-th file
of the manifest) and agree on the verdict; the first candidate that verifies is loaded. A candidate that fails
is reported loudly, naming the file and what is wrong with it, and the next older commit is tried. A directory
without a manifest (a killed save, a hand-made folder) is skipped quietly: it was never a checkpoint.

Loading reshards: the state is read with DCP into this run's own sharded state dict (any world size, any ZeRO
stage) and applied with ``set_state_dict``; the loader position loads at any world size; each rank takes its own
saved RNG state (rank 0's where the saving run had fewer ranks).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError, CorruptArtifactError
from dutycycle.trainer.cluster.world import all_gather, broadcast
from dutycycle.trainer.parallel import residuals
from dutycycle.trainer.parallel.state import sharded_state_dict

from . import manifest as mf
from .state import TrainerState, restore_rng
from .storage import read_state


class CheckpointWarning(UserWarning):
    """A committed checkpoint failed verification and an older one is used instead."""


@dataclass
class Selected:
    step: int
    uri: str
    manifest: mf.Manifest
    fallbacks: list[str]  # why newer commits were passed over


def verify(uri: str, rank: int, world: int) -> tuple[mf.Manifest | None, list[str]]:
    """Read the manifest and verify this rank's share of its files; the ranks' problems are combined, so every
    rank returns the same verdict. ``(None, [])``: not committed."""
    try:
        manifest = mf.read_manifest(uri)
        problems = [] if manifest is None else mf.verify_files(uri, manifest, sorted(manifest.files)[rank::world])
    except CorruptArtifactError as e:
        manifest, problems = None, [str(e)]
    except OSError as e:
        manifest, problems = None, [f"it could not be read ({type(e).__name__}: {e})"]
    gathered = all_gather((manifest is not None, problems), world)
    problems = [p for _, ps in gathered for p in ps]
    if not gathered[0][0] and not problems:
        return None, []
    return manifest, problems


def select(target: str, rank: int, world: int, below: int | None = None) -> Selected | None:
    """The checkpoint to load: ``target`` is a step directory (it must verify) or a root to search newest
    first (``below``: only steps before it). None when the root holds no verified commit."""
    if mf.parse_step(target) is not None:
        manifest, problems = verify(target, rank, world)
        if manifest is None or problems:
            why = "; ".join(problems) if problems else f"it has no {mf.MANIFEST} (the save never committed)"
            raise CorruptArtifactError(f"checkpoint.resume = {target!r} cannot be used: {why}")
        return Selected(manifest.step, target, manifest, [])
    candidates = broadcast(mf.list_steps(target) if rank == 0 else None, world)
    fallbacks = []
    for step, uri in candidates:
        if below is not None and step >= below:
            continue
        manifest, problems = verify(uri, rank, world)
        if manifest is None and not problems:
            continue  # never committed: not a checkpoint
        if problems:
            msg = f"checkpoint {uri} fails verification: {'; '.join(problems)}; falling back to an older commit"
            fallbacks.append(msg)
            if rank == 0:
                warnings.warn(msg, CheckpointWarning, stacklevel=2)
                print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)
            continue
        return Selected(step, uri, manifest, fallbacks)
    return None


def read_trainer_state(selected: Selected) -> TrainerState:
    uri = io.join(selected.uri, mf.TRAINER_STATE)
    return TrainerState.from_json(mf.read_json_bounded(uri), uri)


def check_compatible(saved: TrainerState, cfg, fingerprint: str, uri: str) -> None:
    """Refuse a checkpoint made for another model or optimizer (the state would not fit), naming the key; and
    one made for another dataset or batch size (it would resume another plan), unless
    ``checkpoint.force_loader_state`` accepts that (``dutycycle train --resume --force`` sets it): the loader then
    continues this run's own plan from the saved position."""
    mine = cfg.to_dict()
    theirs = saved.config
    forced = cfg.checkpoint.force_loader_state
    keys = [("model", k) for k in mine["model"]] + [("optim", "name")]
    if not forced:
        keys.append(("data", "global_batch_size"))
    for section, key in keys:
        a, b = theirs.get(section, {}).get(key), mine[section][key]
        if a is not None and a != b:
            raise ConfigError(f"checkpoint {uri} was saved with {section}.{key} = {a!r}, this run has {b!r}; use the "
                              "same setting, another checkpoint.dir, or checkpoint.resume = \"none\" to start fresh")
    if not forced and saved.data.get("fingerprint") and saved.data["fingerprint"] != fingerprint:
        raise ConfigError(f"checkpoint {uri} was saved for data with fingerprint {saved.data['fingerprint']!r}, this "
                          f"run reads {fingerprint!r}; point data.cache at the same cache, or set checkpoint.resume = "
                          "\"none\" to start fresh (or checkpoint.force_loader_state = true to continue this "
                          "run's own plan on it from the saved position)")


def load(selected: Selected, strategy, optimizer, source, *, rank: int, world: int = 1, device=None,
         state: TrainerState | None = None, force_loader_state: bool = False, reader=None) -> TrainerState:
    """Load model, optimizer, error-feedback residuals (residuals.py), loader position and this rank's RNG from a
    verified checkpoint (every rank).
    ``state``: its trainer state when the caller has already read it. ``force_loader_state``: load the loader
    position even when the saved plan inputs differ from this run's (``checkpoint.force_loader_state``).
    ``reader(uri, allowed)``: the DCP storage reader to read through (peer.py: memory), else storage's."""
    if state is None:
        state = read_trainer_state(selected)
    model_sd, optim_sd = sharded_state_dict(strategy, optimizer)
    comm, dropped = residuals.load_targets(strategy, state.strategy.get("residuals"), rank, world, device)
    allowed = set(selected.manifest.files)
    read_state({"model": model_sd, "optim": optim_sd, **residuals.tensors(comm)}, selected.uri, allowed,
               reader=reader(selected.uri, allowed) if reader is not None else None)
    apply_state(strategy, optimizer, source, {"model": model_sd, "optim": optim_sd, **comm}, state,
                rank=rank, device=device, dropped=dropped, where=selected.uri, force_loader_state=force_loader_state)
    return state


def apply_state(strategy, optimizer, source, tensors: dict, state: TrainerState, *, rank: int, device=None,
                dropped: str = "", where: str = "", force_loader_state: bool = False) -> None:
    """Install loaded state: model and optimizer tensors, error-feedback residuals, the loader's position and this
    rank's RNG (a resume from files and ``Trainer.load_state_dict`` alike)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(strategy.module, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optim"])
    residuals.apply(strategy, tensors, rank, dropped, where)
    try:
        source.load_state_dict(state.loader, force=force_loader_state)
    except ConfigError as e:  # the loader names the differing field; say how a trainer user accepts it
        raise ConfigError(f"{e} [resuming from {where}: set checkpoint.force_loader_state = true to "
                          "continue this run's own sample order from the saved position]") from None
    restore_rng(state.rng_for(rank), device)
