"""The step loop's checkpointer: when to save, resume at start, and recovery from a non-finite loss.

What the loop calls (``loop.NoCheckpoint`` is the same interface, doing nothing)::

    restored = checkpointer.restore(strategy, optimizer, source)   # resume: step and epoch, or None
    per step:  checkpointer.account(timer)                         # snapshot waits -> the checkpoint phase
               checkpointer.due(step) -> the step's row written first   # a commit never holds an unchecked loss
               checkpointer.maybe_save(step, strategy, optimizer, source.state_dict())  # True: a storage save
    on TrainingDiverged: restored = checkpointer.recover(err, strategy, optimizer, source)
    at the end: checkpointer.finalize(); checkpointer.summary()

A non-finite loss (or gradient norm) at step s means the update of step s may be garbage, and every commit at s
or later may hold it: those are uncommitted, the newest commit before s is loaded, and (``skip``) the global
batch of step s is left out from then on (recorded in later checkpoints, so a resume leaves it out too).
Because the loop flushes the step log before every save, all losses before a commit's step were checked when
it committed: at most the newest commit can hold a bad update, and keep >= 2 leaves the one before it.

Peer memory (``checkpoint.memory_every``, peer.py) is the other kind of save: every K steps the state is kept in
memory on this node and another, and ``restore`` takes it over storage when it is at least as new as the newest
commit (a resize or a restart of the worker group). A rollback forgets memory at or after the bad step, as it
uncommits storage.

The loop writes step s's own metrics row before it saves step s: that row comes from a collective across the
ranks, and a resumed run keeps the rows up to its step and trains on from there, so a commit whose row was never
written (a rank killed between the save and the row, while rank 0's saver thread went on) would leave that step
without a row for good. ``maybe_save`` makes the rows durable first (a run directory on an object store buffers
them).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from dutycycle.engine.errors import CorruptArtifactError, DutycycleError, SourceError, TrainingDiverged
from dutycycle.trainer.cluster.world import all_gather, broadcast
from dutycycle.trainer.parallel import residuals
from dutycycle.trainer.parallel.dims import ParallelDims
from dutycycle.trainer.parallel.state import sharded_state_dict

from . import manifest as mf
from . import peer, resume
from .manifest import checkpoint_root
from .saver import Commit, Saver
from .state import TrainerState, capture_rng


@dataclass
class Restored:
    step: int
    epoch: int


class Checkpointer:
    def __init__(self, cfg, ctx, *, total_steps: int, data_info=None, writer=None, on_phase=None):
        c = cfg.checkpoint
        self.cfg, self.c, self.total = cfg, c, total_steps
        self.rank, self.world, self.device = ctx.rank, ctx.world_size, ctx.device
        self.root = checkpoint_root(cfg, ctx.run_dir)
        self.on_commit = getattr(ctx, "on_commit", None)
        self.writer = writer
        self.data = {"fingerprint": getattr(data_info, "fingerprint", ""),
                     "lineage": getattr(data_info, "lineage", {})}
        self.saver = None
        if c.every > 0 and self.root:
            self.saver = Saver(self.root, rank=self.rank, world_size=self.world, keep=c.keep,
                               async_save=c.async_save, device=self.device, on_phase=on_phase,
                               keep_staging_buffers=not ParallelDims.from_config(cfg.parallel, validate=False).nvme,
                               background_nice=c.background_nice)
        self.skipped: set[tuple[int, int]] = set()
        self.stalls: list[float] = []
        self.report_s = 0.0  # reporting commits (Ray Train's barrier): inside a stall or the final save's wait
        self.commits: list[Commit] = []
        self.restored: dict | None = None
        self.events: list[dict] = []  # rollbacks and skips
        self._hooks = None
        self._blocked = {"optimizer": 0.0, "forward_backward": 0.0}
        # peer memory: needs Ray in this process (a Ray Train worker); the stores are named per run and launch
        under_ray = "ray" in sys.modules and sys.modules["ray"].is_initialized()
        every = peer.resolve_every(cfg, under_ray)
        self.memory = peer.PeerMemory(peer.run_key(ctx.run_dir, getattr(ctx, "attempt_dir", "") or ctx.run_dir),
                                      rank=self.rank, world=self.world, every=every, device=self.device) \
            if every > 0 else None

    # ------------------------------------------------------------------------------------------- saving

    def due(self, step: int) -> bool:
        """A save (storage or peer memory) is due after ``step``: the loop checks the losses first."""
        return self._storage_due(step) or self._memory_due(step)

    def _storage_due(self, step: int) -> bool:
        return self.saver is not None and (step % self.c.every == 0 or step == self.total)

    def _memory_due(self, step: int) -> bool:
        # not at the last step: the run ends there (its storage save, then the stores are freed)
        return self.memory is not None and self.memory.due(step) and step < self.total

    def maybe_save(self, step: int, strategy, optimizer, loader_state: dict | None) -> bool:
        """Save as ``step`` if one is due (the loop has written step ``step``'s metrics row): to peer memory, to
        storage or both. True when a storage save started."""
        if self._memory_due(step):
            self._save_memory(step, strategy, optimizer, loader_state)
        if not self._storage_due(step):
            return False
        # the loop's stall is all of this call (the rows flushed, the state gathered, the previous save waited for
        # and reported, the snapshot started), so this figure and the step timer's "checkpoint" are one number
        t0 = time.perf_counter()
        if self.writer is not None:
            self.writer.flush()  # the rows up to this step, durable before any commit of it
        self._arm(strategy, optimizer)
        tensors = training_tensors(strategy, optimizer, self.rank)
        state = trainer_state(self.cfg, strategy, step=step, loader_state=loader_state, world=self.world,
                              skipped=self.skipped, total_steps=self.total, data=self.data)
        _, commit = self.saver.save(step, tensors, state, capture_rng(self.device))
        self._committed(commit)
        self.stalls.append(time.perf_counter() - t0)
        return True

    def _save_memory(self, step: int, strategy, optimizer, loader_state: dict | None) -> None:
        if self.writer is not None:
            self.writer.flush()  # as before a commit: a resume from this step finds its row
        tensors = training_tensors(strategy, optimizer, self.rank)
        state = trainer_state(self.cfg, strategy, step=step, loader_state=loader_state, world=self.world,
                              skipped=self.skipped, total_steps=self.total, data=self.data)
        row = self.memory.save(step, tensors, state, capture_rng(self.device))
        if self.writer is not None:  # (what the background did: the summary's checkpoint.memory)
            self.writer.log({"step": step, "memory_saved": True, **row})

    def account(self, timer) -> None:
        """Move the time the step waited for a snapshot (in forward or the optimizer step) to "checkpoint"."""
        for phase, seconds in self._blocked.items():
            timer.move(phase, "checkpoint", seconds)
            if seconds and self.stalls:
                self.stalls[-1] += seconds  # a save's stall includes the waits it causes later
            self._blocked[phase] = 0.0

    def _arm(self, strategy, optimizer) -> None:
        """Asynchronous saves copy the state while training goes on, so whatever changes it must wait for the
        copy: the optimizer step (parameters and optimizer state), and forward too when the model has buffers
        (e.g. running statistics, updated in forward). Error-feedback residuals need no wait: the save takes them
        as copies in their parameters' shapes (residuals.state_dict)."""
        if self._hooks is not None or not self.c.async_save:
            return

        def waiter(phase):
            def hook(*_args, **_kwargs):
                self._blocked[phase] += self.saver.wait_staged()
            return hook

        self._hooks = [optimizer.register_step_pre_hook(waiter("optimizer"))]
        if any(True for _ in strategy.module.buffers()):
            self._hooks.append(strategy.model.register_forward_pre_hook(waiter("forward_backward")))

    def _committed(self, commit: Commit | None) -> None:
        if commit is None:
            return
        self.commits.append(commit)
        if self.writer is not None:
            self.writer.log({"step": commit.step, "checkpoint_committed": commit.uri, "bytes": commit.bytes,
                             "snapshot_s": commit.snapshot_s, "write_s": commit.write_s, "commit_s": commit.commit_s,
                             "snapshot_file_bytes": commit.snapshot_file_bytes})
        if self.on_commit is not None:  # every rank, in step order (Ray Train: a report is a barrier)
            t0 = time.perf_counter()
            self.on_commit(commit.step, commit.uri)
            self.report_s += time.perf_counter() - t0

    def _wait(self) -> None:
        if self.saver is not None:
            self._committed(self.saver.wait())

    def finalize(self) -> None:
        """Wait for the last save to commit (at the end of training; every rank); the run's peer memory freed."""
        self._wait()
        if self.memory is not None:
            self.memory.finish()
        self.close()

    def close(self) -> None:
        """Release the background thread (also on error paths: a save in flight still finishes first)."""
        if self.saver is not None:
            try:
                self.saver.wait()
            except Exception as e:  # noqa: BLE001 - already failing; say so and let the first error surface
                print(f"[checkpoint] the last save did not complete: {e}", file=sys.stderr, flush=True)
            self.saver.close()
        for h in self._hooks or []:
            h.remove()
        self._hooks = None
        if self.memory is not None:  # (the stores are not freed: a restarted group may resume from them)
            self.memory.close()

    # ------------------------------------------------------------------------------------------ resuming

    def restore(self, strategy, optimizer, source) -> Restored | None:
        """Resume per ``checkpoint.resume`` (every rank). None: start from step 0."""
        c = self.c
        target = {"none": "", "auto": self.root}.get(c.resume, c.resume)
        if not target:
            return None
        t0 = time.perf_counter()
        restored = self._restore_memory(strategy, optimizer, source) if c.resume == "auto" else None
        if restored is not None:
            restored, uri, fallbacks, source_name = restored, f"peer memory of step {restored.step}", [], "memory"
        else:
            selected = resume.select(target, self.rank, self.world)
            if selected is None:
                self._forget_memory(0)
                if c.resume != "auto":
                    raise SourceError(f"checkpoint.resume = {target!r} holds no committed checkpoint; use \"auto\" "
                                      "or \"none\", or the URI of a step directory")
                return None
            saved = resume.read_trainer_state(selected)
            resume.check_compatible(saved, self.cfg, self.data["fingerprint"], selected.uri)
            restored = self._load(selected, strategy, optimizer, source, saved)
            uri, fallbacks, source_name = selected.uri, selected.fallbacks, "storage"
            self._forget_memory(restored.step)
        steps_lost = self.writer.resume_from(restored.step) if self.writer is not None else 0
        self.restored = {"step": restored.step, "uri": uri, "source": source_name,
                         "restore_s": time.perf_counter() - t0, "steps_lost": steps_lost, "fallbacks": fallbacks,
                         **((self.writer.failure or {}) if self.writer is not None else {})}
        if self.writer is not None:
            self.writer.log({"step": restored.step, "event": "resume", **self.restored})
        if self.rank == 0:
            print(f"[checkpoint] resumed from {uri} (step {restored.step}, epoch {restored.epoch}) in "
                  f"{self.restored['restore_s']:.2f} s", flush=True)
        return restored

    def _restore_memory(self, strategy, optimizer, source) -> Restored | None:
        """The newest state the run's peer memory holds whole and verified, loaded when it is at least as new as
        the newest storage commit (every rank); None otherwise."""
        if self.memory is None:
            return None
        newest = 0
        if self.root and self.rank == 0:
            newest = next((step for step, uri in mf.list_steps(self.root) if mf.is_committed(uri)), 0)
        cand = self.memory.candidate(at_least=max(1, broadcast(newest, self.world)))
        if cand is None:
            return None

        def check(saved, where):
            resume.check_compatible(saved, self.cfg, self.data["fingerprint"], where)

        try:
            state = self.memory.load(cand, strategy, optimizer, source, device=self.device,
                                     force_loader_state=self.c.force_loader_state, check=check)
        except CorruptArtifactError as e:
            # no rank installed the loader position or RNG yet, but tensors may be partly loaded: only a load
            # from storage (which sets every tensor) may follow, never a fresh start
            self._forget_memory(cand.step - 1)
            if not newest:
                raise DutycycleError(f"{e}; and {self.root or 'storage'} holds no commit to fall back to, so this "
                                     "attempt cannot start from a clean state: the next restart starts from step 0 "
                                     "(the peer memory of that step is forgotten)") from None
            if self.rank == 0:
                print(f"[checkpoint] {e}; falling back to storage", file=sys.stderr, flush=True)
            return None
        self.skipped = {(e, b) for e, b in state.skipped}
        self._forget_memory(cand.step)
        epoch, _ = source.position()
        return Restored(step=state.step, epoch=epoch)

    def _forget_memory(self, keep: int) -> None:
        """(Rank 0) drop peer memory of every step but ``keep``: a (re)start goes on from ``keep``, so a newer
        one is a future that never happened and older ones are of no use."""
        if self.memory is not None and self.rank == 0:
            self.memory.drop(below=keep, above=keep)

    def _load(self, selected, strategy, optimizer, source, saved=None) -> Restored:
        state = resume.load(selected, strategy, optimizer, source, rank=self.rank, world=self.world,
                            device=self.device, state=saved,
                            force_loader_state=self.c.force_loader_state)
        self.skipped = {(e, b) for e, b in state.skipped}
        epoch, _ = source.position()  # after an epoch's last batch, the loader is already in the next epoch
        return Restored(step=state.step, epoch=epoch)

    # -------------------------------------------------------------------------------- non-finite losses

    def recover(self, err, strategy, optimizer, source) -> Restored:
        """Handle ``TrainingDiverged`` (every rank, at the same flush): roll back or raise, per
        ``checkpoint.on_nonfinite``."""

        # a tensor-parallel group's ranks read the same batch: its ids once, from the group's first rank
        mine = list(err.sample_ids or []) if getattr(strategy, "tensor_rank", 0) == 0 else []
        ids = [i for part in all_gather(mine, self.world) for i in part]
        shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
        what = f"{err} [global batch {err.batch} of epoch {err.epoch}: {len(ids)} samples, ids {shown}]"
        policy = self.c.on_nonfinite
        retry = policy == "rollback" and any(e["step"] == err.step for e in self.events)

        def stop(why: str) -> TrainingDiverged:
            if self.writer is not None:
                self.writer.log({"step": err.step, "event": "nonfinite", "action": "stop", "epoch": err.epoch,
                                 "batch": err.batch, "sample_ids": ids})
            return TrainingDiverged(f"{what}; {why}", step=err.step, epoch=err.epoch, batch=err.batch,
                                    sample_ids=ids)

        # commits at or after step s may hold its update: uncommit them whatever happens next (peer memory too)
        self._wait()
        if self.rank == 0 and self.root:
            for step, uri in mf.list_steps(self.root):
                if step >= err.step:
                    mf.remove(uri)
        if self.memory is not None:
            self.memory.settle()
            if self.rank == 0:
                self.memory.drop(above=err.step - 1)
        broadcast(None, self.world)  # every rank waits for the removal before looking for a commit
        if policy == "stop":
            raise stop("stopping (checkpoint.on_nonfinite = \"stop\")") from None
        if retry:
            raise stop("it happened again after rolling back, so the batch itself is bad: set "
                       "checkpoint.on_nonfinite = \"skip\" to leave it out") from None
        if len(self.events) >= self.c.max_rollbacks:
            raise stop(f"already rolled back {len(self.events)} times (checkpoint.max_rollbacks)") from None
        selected = resume.select(self.root, self.rank, self.world, below=err.step) if self.root else None
        if selected is None:
            raise stop(f"there is no committed checkpoint before step {err.step} to roll back to "
                       f"(checkpoint.every = {self.c.every})") from None
        restored = self._load(selected, strategy, optimizer, source)
        if policy == "skip":
            self.skipped.add((err.epoch, err.batch))
        event = {"step": err.step, "event": "nonfinite", "action": policy, "epoch": err.epoch, "batch": err.batch,
                 "rolled_back_to": restored.step, "sample_ids": ids}
        self.events.append(event)
        if self.writer is not None:
            self.writer.log(event)
        if self.rank == 0:
            action = "leaving its global batch out" if policy == "skip" else "training the same batches again"
            print(f"[checkpoint] {what}; rolled back to step {restored.step}, {action}", file=sys.stderr, flush=True)
        return restored

    # ------------------------------------------------------------------------------------------ summary

    def summary(self) -> dict:
        commits = self.commits
        write_s = sum(c.write_s for c in commits)
        written = sum(c.bytes for c in commits)
        return {
            "dir": self.root, "every": self.c.every, "async_save": self.c.async_save, "keep": self.c.keep,
            "saves": len(self.stalls), "committed": [c.step for c in commits],
            "stall_s": {"mean": sum(self.stalls) / len(self.stalls) if self.stalls else 0.0,
                        "max": max(self.stalls, default=0.0), "total": sum(self.stalls), "per_save": self.stalls},
            "waited_for_previous_save": self.saver.stalled_on_previous if self.saver else 0,
            "snapshot_s_mean": sum(c.snapshot_s for c in commits) / len(commits) if commits else 0.0,
            "write_s_mean": write_s / len(commits) if commits else 0.0, "write_s_total": write_s,
            "report_s": self.report_s,
            "bytes_per_save": written / len(commits) if commits else 0,
            # offload = "nvme": state snapshotted as copies of its files on disk, not in host memory (saver.py)
            "snapshot_file_bytes_per_save": max((c.snapshot_file_bytes for c in commits), default=0),
            "write_mb_per_s": written / write_s / 1e6 if write_s > 0 else None,
            "resumed": self.restored, "nonfinite": self.events,
            "memory": self.memory.summary() if self.memory is not None else None,
            "skipped_batches": sorted([e, b] for e, b in self.skipped),
        }


def training_tensors(strategy, optimizer, rank: int) -> dict:
    """The tensors a checkpoint holds: the model's and the optimizer's (sharded as the strategy holds them) and
    this rank's error-feedback residuals. The live tensors, not copies (the residuals aside: copies in their
    parameters' shapes)."""
    model_sd, optim_sd = sharded_state_dict(strategy, optimizer)
    return {"model": model_sd, "optim": optim_sd, **residuals.state_dict(strategy, rank)}


def trainer_state(cfg, strategy, *, step: int, loader_state: dict | None, world: int, skipped, total_steps: int,
                  data: dict) -> TrainerState:
    """What a checkpoint holds beside the tensors (state.py), the RNG states aside (the saver gathers them)."""
    plan = strategy.plan
    comm_layout = residuals.layout(strategy, world)
    return TrainerState(
        step=step, epoch=int((loader_state or {}).get("epoch", 0)), loader=dict(loader_state or {}), rng=[],
        world_size=world, skipped=sorted([e, b] for e, b in skipped),
        schedule={"total_steps": total_steps, "lr": cfg.optim.lr, "warmup_steps": cfg.optim.warmup_steps,
                  "schedule": cfg.optim.schedule, "min_lr_ratio": cfg.optim.min_lr_ratio},
        config=cfg.to_dict(), data=data,
        strategy={"name": strategy.name, "zero_stage": plan.zero_stage, "replicate": plan.replicate,
                  "tensor": plan.tensor, **({"residuals": comm_layout} if comm_layout else {})})


def make_checkpointer(cfg, ctx, *, total_steps: int, data_info=None, writer=None) -> Checkpointer:
    return Checkpointer(cfg, ctx, total_steps=total_steps, data_info=data_info, writer=writer)
