"""The Trainer: one rank's run, the same in every launch mode (local, Ray Train worker, torchrun).

    with Trainer(config, ctx) as trainer:   # builds, in order: the world and its checks, the data, the model,
        summary = trainer.train()           # its parallel wrapping, the optimizer, the checkpointer; then resumes

``__init__`` builds every part once and restores from the newest verified checkpoint (``checkpoint.resume``).
``train()`` runs the steps to ``run.max_steps`` / ``run.epochs``, evaluating every ``run.eval_every`` steps and
saving when the checkpointer says a save is due, then evaluates once more, waits for the last save and returns
the summary (rank 0 also writes ``summary.json``). On a non-finite loss the checkpointer rolls back (or stops)
and the steps continue from the restored one. ``train_step(batch)`` is one optimizer step over one global batch
(its micro-batches inside); ``evaluate()`` one validation pass; ``state_dict()`` / ``load_state_dict()``
everything a checkpoint holds, in memory; ``close()`` releases the checkpointer's thread and the offload files.

The data opens before the model: the model's shape (channels, classes, image size) comes from the data.
Every clock read is the time account's (timing.py: ``TimeAccount``): the trainer sends it events.
"""

from __future__ import annotations

import faulthandler
import math

from dutycycle.engine import io
from dutycycle.engine.errors import DutycycleError, TrainingDiverged
from dutycycle.trainer.checkpoint.checkpointer import make_checkpointer, trainer_state, training_tensors
from dutycycle.trainer.checkpoint.manifest import check_shared, checkpoint_root
from dutycycle.trainer.checkpoint.resume import apply_state
from dutycycle.trainer.checkpoint.state import TrainerState, capture_rng
from dutycycle.trainer.cluster.health import preflight
from dutycycle.trainer.cluster.topology import observe
from dutycycle.trainer.cluster.world import all_gather
from dutycycle.trainer.parallel import nvme
from dutycycle.trainer.parallel.apply import parallelize
from dutycycle.trainer.parallel.check import ParityCheck
from dutycycle.trainer.parallel.dims import ParallelDims
from dutycycle.trainer.parallel.memory import MemorySampler, host_memory

from . import metrics as M
from .data import make_sources, take
from .loop import (
    WorkerContext,
    autocast_for,
    broadcast_parameters,
    flops_per_sample,
    lr_at,
    optimizer_step,
    resolve_precision,
    validation_pass,
)
from .models import build_model, count_parameters
from .optim import fused_choice, implementation, make_optimizer, optimizer_state_tensors
from .provenance import SampleLosses, attempt_number, start_record
from .steplog import StepLog
from .summary import summarize_run
from .timing import TimeAccount

__all__ = ["Trainer", "WorkerContext"]


class Trainer:
    """One rank's training run. ``parallelize_fn`` (same signature as ``parallel.apply.parallelize``) replaces
    how the model is wrapped: benchmarks run a baseline strategy through the same steps. ``checkpointer``
    replaces the one the config asks for (``loop.NoCheckpoint`` is the interface)."""

    def __init__(self, config, ctx: WorkerContext, checkpointer=None, parallelize_fn=None):
        import torch

        if not faulthandler.is_enabled():  # a rank that dies of a signal (SIGSEGV in a collective) names its stack
            faulthandler.enable()
        self.config, self.ctx = config, ctx
        self.device = ctx.device or torch.device("cpu")
        self.account = TimeAccount(self.device, ctx.started)
        self._check_world()
        self._open_data()
        self._build_model()
        self._parallelize(parallelize_fn or parallelize)
        self._build_optimizer()
        self._plan_steps()
        self._build_checkpointer(checkpointer)
        self._closed = False
        self._restore()

    # ------------------------------------------------------------------------------------------ building

    def _check_world(self) -> None:
        """Where every rank runs, as the ranks report it (a collective), the parallel degrees on that layout
        (validated once: parallel/dims.py), and the pre-flight health check of every worker."""
        cfg, ctx = self.config, self.ctx
        self.world = observe(ctx.rank, ctx.world_size, cfg.parallel.node_size, labels=ctx.node_labels)
        self.dims = ParallelDims.build(cfg.parallel, self.world)
        check_shared(cfg, self.world, checkpoint_root(cfg, ctx.run_dir))
        self.precision = resolve_precision(self.device, cfg.run.precision)
        self.health = None
        if cfg.run.health_check:
            self.health = preflight(self.world.rank, self.world.size, self.device, cfg.run.health_timeout_s,
                                    ctx.attempt_dir or ctx.run_dir)
        self.account.setup_done("health_check")

    def _open_data(self) -> None:
        import torch

        torch.manual_seed(self.config.run.seed)
        self.train_src, self.val_src, self.info = make_sources(self.config, self.world, self.dims, self.device)
        self.account.setup_done("data_open")

    def _build_model(self) -> None:
        import torch

        info, device = self.info, self.device
        model = build_model(self.config.model, info.channels, info.num_classes, info.size).to(device)
        if self.precision == "fp64":
            model = model.double()
        self.num_params = count_parameters(model)
        is_cuda = device.type == "cuda"
        self.fps = flops_per_sample(model, info.channels, info.size, device) if is_cuda else None
        self.peak = M.peak_flops(torch.cuda.get_device_name(device)) if is_cuda else None
        broadcast_parameters(model, self.world.size)
        self._model = model

    def _parallelize(self, parallelize_fn) -> None:
        cfg = self.config
        self.strategy = parallelize_fn(self._model, cfg.parallel, self.world, device=self.device,
                                       precision=self.precision, micro_batches=cfg.data.micro_batches,
                                       sync_batchnorm=cfg.model.sync_batchnorm)
        del self._model
        self.autocast = autocast_for(self.device, self.precision, fsdp=self.strategy.plan.fsdp)
        self.parity = None  # parallel.check_every: the parity check of the gradient exchange (parallel/check.py)
        if cfg.parallel.check_every:
            self.parity = ParityCheck(self.strategy, cfg.parallel.check_every, micro_batches=cfg.data.micro_batches,
                                      describe=_describe_path(cfg.parallel, self.precision), device=self.device)

    def _build_optimizer(self) -> None:
        cfg = self.config
        self.optimizer = make_optimizer(self.strategy.module.parameters(), cfg.optim)
        trainable = [p for p in self.strategy.module.parameters() if p.requires_grad]
        # which optimizer kernel runs and why, for the run's log and summary (``optim.fused``)
        self.optimizer_info = {"name": cfg.optim.name, "implementation": implementation(self.optimizer),
                               "why": fused_choice(trainable, cfg.optim)[1]}
        self.offload_store = None
        self.offload_stats = None
        if self.dims.nvme:  # the optimizer state in files on local disk (parallel/nvme.py)
            self.offload_store = nvme.FileStore(nvme.offload_root(cfg.parallel), nvme.run_key(self.ctx.run_dir),
                                                self.world.rank)
            nvme.attach(self.optimizer, self.offload_store, state_per_param=optimizer_state_tensors(cfg.optim) or 2)

    def _plan_steps(self) -> None:
        cfg = self.config
        self.steps_per_epoch = len(self.train_src)
        if self.steps_per_epoch == 0:
            raise DutycycleError(
                f"the training split has fewer samples ({self.info.train_samples}) than one global batch "
                f"(data.global_batch_size = {cfg.data.global_batch_size}); lower it or add data"
            )
        self.total = cfg.run.max_steps or max(1, math.ceil(cfg.run.epochs * self.steps_per_epoch))

    def _build_checkpointer(self, checkpointer) -> None:
        cfg, ctx, rank = self.config, self.ctx, self.world.rank
        self.writer = M.MetricsWriter(ctx.run_dir, enabled=(rank == 0 and bool(ctx.run_dir)))
        if checkpointer is None:
            checkpointer = make_checkpointer(cfg, ctx, total_steps=self.total, data_info=self.info,
                                             writer=self.writer)
        self.checkpointer = checkpointer
        self.log = StepLog(self.account.timer, self.writer, log_every=cfg.run.log_every, base_lr=cfg.optim.lr,
                           progress=ctx.progress if rank == 0 else None)
        self.sampler = MemorySampler()
        self.val, self.val_samples = (None, None), 0

    def _restore(self) -> None:
        attempt = self.account.loop_started()
        with self.account.span("restore"):
            restored = self.checkpointer.restore(self.strategy, self.optimizer, self.train_src)
        # every attempt's record, kept across restarts (its step is where it began): the job's account reads them,
        # and ``dutycycle trace`` the plan this start's steps were drawn from (trainer/trace/record.py)
        self.writer.log({"step": restored.step if restored else 0, "event": "attempt", **attempt,
                         "input": self.train_src.delivery(), "optimizer": self.optimizer_info,
                         # the size and placement this attempt trained at (an elastic run's change between
                         # attempts is a resize: launch/account.py)
                         "world_size": self.world.size, "nodes": self.world.num_nodes,
                         "trace": self._trace_record()})
        self.sample_losses = None  # run.record_sample_loss: each sample's loss per step (provenance.py)
        if self.config.run.record_sample_loss and self.ctx.run_dir:
            # every rank gathers its rows to rank 0, which writes them under its attempt and start
            self.sample_losses = SampleLosses(self.ctx.run_dir, rank=self.dims.data_ranks(self.world.rank)[0],
                                              world_size=self.world.size, start=attempt["loop_started"],
                                              attempt=attempt_number(self.ctx.attempt_dir),
                                              log_every=self.config.run.log_every,
                                              # a tensor-parallel group's ranks trained the same samples
                                              records=self.strategy.tensor_rank == 0, writer=self.world.rank == 0)
        self.step, self.epoch = (restored.step, restored.epoch) if restored else (0, 0)
        self.first_step = self.step
        self.log.event("start", step=self.step, epoch=self.epoch, total=self.total, world_size=self.world.size,
                       global_batch=self.config.data.global_batch_size, resumed=restored is not None,
                       input=self.train_src.delivery(), optimizer=self.optimizer_info,
                       data={"fingerprint": self.info.fingerprint, "lineage": self.info.lineage})

    def _trace_record(self) -> dict:
        """What this start plans its steps from, for ``dutycycle trace`` (trace/record.py)."""
        _, data_world = self.dims.data_ranks(self.world.rank)
        return start_record(loader_state=self.train_src.state_dict(), world_size=self.world.size,
                            data_world=data_world, data_groups=self.dims.tensor_groups() if self.dims.tp_enabled else None,
                            micro_batches=self.config.data.micro_batches, attempt_dir=self.ctx.attempt_dir,
                            data={"source": self.config.data.source, **self.info.lineage,
                                  "fingerprint": self.info.fingerprint, "spec": self.info.spec})

    # -------------------------------------------------------------------------------------------- steps

    def batches(self):
        """This rank's batches from the current step to the last, epoch after epoch, with their global batch
        index; each one opens a step in the time account (its data wait is the step's)."""
        while self.step < self.total:
            with self.account.span("loader_start"):
                self.train_src.set_epoch(self.epoch)
                it = iter(self.train_src)
            while self.step < self.total:
                self.account.start_step()
                with self.account.phase("data_wait", host=True):
                    batch, index = take(it, self.train_src, self.checkpointer.skipped)
                if batch is None:
                    break
                yield batch, index
            self.epoch += 1

    def train_step(self, batch: dict, index: int = -1):
        """One optimizer step over this rank's share of one global batch (``index``: its place in the epoch, for
        the step log). Returns the rank's mean loss, a device tensor."""
        cfg, timer = self.config, self.account.timer
        with self.account.phase("h2d"):
            x = batch["image"].to(self.device, dtype=self.strategy.compute_dtype, non_blocking=True)
            y = batch["label"].to(self.device, non_blocking=True)
        lr = lr_at(self.step, self.total, cfg.optim)
        per_sample = [] if self.sample_losses is not None else None
        loss, grad_norm = optimizer_step(self.strategy, self.optimizer, x, y, micro_batches=cfg.data.micro_batches,
                                         timer=timer, autocast=self.autocast, grad_clip=cfg.optim.grad_clip, lr=lr,
                                         sampler=self.sampler if self.step == self.first_step else None,
                                         inject_comm_s=cfg.parallel.inject_comm_ms / 1000.0,
                                         check=self.parity.at(self.step + 1, self._record_check) if self.parity else None,
                                         per_sample=per_sample)
        self.checkpointer.account(timer)
        self.step += 1
        if per_sample is not None:
            self.sample_losses.add(self.step, self.epoch, index, batch.get("sample_id"), per_sample)
        # samples weigh each rank's loss in the global one: a tensor-parallel group's are counted once
        own = int(y.shape[0]) if self.strategy.tensor_rank == 0 else 0
        self.log.add(self.step, self.epoch, lr, loss, own, self.account.end_step(), grad_norm, batch=index,
                     sample_ids=batch.get("sample_id"))
        return loss

    def _record_check(self, result) -> None:
        """A parity check's row in the metrics (rank 0 writes it) and the step log's event; flushed at once, so a
        failed check's row is on disk before the run stops."""
        self.parity.record(result)
        self.writer.log(result.row())
        self.writer.flush()
        self.log.event("parity_check", step=result.step, passed=result.passed, max_rel_error=result.max_rel_error,
                       bound=result.bound, seconds=result.seconds)

    def _after_step(self) -> None:
        """A save when one is due, an evaluation when one is scheduled."""
        if self.checkpointer.due(self.step):
            # Every loss up to this step is checked and this step's row written (a collective: a rank lost here
            # leaves no row and no commit) before the save starts, so a commit never holds an unchecked update
            # and a resume from it finds its row. The save stalls the next step.
            self.log.flush()
            if self.sample_losses is not None:  # the commit's steps' sample losses on disk before it
                self.sample_losses.flush()
            with self.account.between("checkpoint"):
                saved = self.checkpointer.maybe_save(self.step, self.strategy, self.optimizer,
                                                     self.train_src.state_dict())
            if saved:  # (else a peer-memory copy only: its own row)
                self.writer.log({"step": self.step, "checkpoint_saved": True})
        every = self.config.run.eval_every
        if every and self.step % every == 0 and self.step < self.total:
            self.evaluate()

    def _run_steps(self) -> None:
        for batch, index in self.batches():
            self.train_step(batch, index)
            self._after_step()
        self.log.flush()
        if self.sample_losses is not None:
            self.sample_losses.flush()
        self.account.close_steps()

    def _train_until_done(self) -> dict | None:
        """The steps to the end, rolling back on a non-finite loss (or raising, per checkpoint.on_nonfinite).
        Returns this rank's host memory after the steps."""
        while True:
            try:
                self._run_steps()
                break
            except TrainingDiverged as err:
                with self.account.span("rollback"):
                    restored = self.checkpointer.recover(err, self.strategy, self.optimizer, self.train_src)
                self.step, self.epoch = restored.step, restored.epoch
                if self.sample_losses is not None:  # steps trained again: their rows come with the redo
                    self.sample_losses.pending.clear()
        # between steps, after the last: what this rank holds in host memory (the offload files' pages). Reading
        # smaps walks every mapping (10-20 ms with torch loaded): a result of the run, counted under "results"
        with self.account.span("memory_probe"):
            return host_memory(self.offload_store.dir if self.offload_store is not None else None)

    # ------------------------------------------------------------------------------------- public calls

    def train(self) -> dict:
        """Train to the end, evaluate, wait for the last save; the summary (every rank calls it: it gathers)."""
        self.strategy.module.train()
        try:
            host = self._train_until_done()
            self.evaluate()
            self.account.begin("final_save")
            self.checkpointer.finalize()
        finally:
            self.close()
        self.account.end("final_save")  # the last save, its background write, the close
        self.account.loop_ended()
        self.log.event("end", step=self.step)
        return self._results(host)

    def evaluate(self) -> tuple[float, float]:
        """One validation pass over every rank's share (a collective); logged, shown and reported."""
        cfg, ctx = self.config, self.ctx
        self.log.flush()
        with self.account.span("eval") as span:
            acc, loss, n_val = validation_pass(self.strategy, self.val_src, self.device, self.autocast,
                                               cfg.run.eval_max_batches)
        self.val, self.val_samples = (acc, loss), n_val
        self.writer.log({"step": self.step, "epoch": self.epoch, "val_accuracy": acc, "val_loss": loss,
                         "val_samples": n_val, "eval_s": span.seconds})
        self.writer.flush()
        self.log.event("eval", step=self.step, val_accuracy=acc, val_loss=loss, val_samples=n_val,
                       eval_s=span.seconds)
        if ctx.report is not None:
            ctx.report({"step": self.step, "val_accuracy": acc, "val_loss": loss, "loss": self.log.last_loss})
        return acc, loss

    def close(self) -> None:
        """Release the checkpointer (a save in flight finishes first) and the offload files; safe to repeat."""
        if self._closed:
            return
        self._closed = True
        self.checkpointer.close()
        if self.offload_store is not None:
            self.offload_stats = {"dir": self.offload_store.dir, "state_bytes": self.offload_store.file_bytes(),
                                  "bytes_written": self.offload_store.bytes_written}
            self.offload_store.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict:
        """What a checkpoint of this step holds, in memory: ``model``, ``optim`` (sharded as the strategy holds
        them), error-feedback ``residuals`` when there are any, ``trainer`` (checkpoint/state.py's fields: step,
        epoch, loader position, skipped batches, schedule, config, data, layout) and ``rng`` (this rank's).
        The live tensors: copy them to keep them past the next step."""
        state = trainer_state(self.config, self.strategy, step=self.step, loader_state=self.train_src.state_dict(),
                              world=self.world.size, skipped=self.checkpointer.skipped, total_steps=self.total,
                              data={"fingerprint": self.info.fingerprint, "lineage": self.info.lineage})
        return {**training_tensors(self.strategy, self.optimizer, self.world.rank), "trainer": state.to_json(),
                "rng": capture_rng(self.device)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s content (this run's layout): tensors, loader position, RNG, step."""
        saved = TrainerState.from_json({**state["trainer"], "rng": [state["rng"]]}, "a trainer state dict")
        apply_state(self.strategy, self.optimizer, self.train_src, state, saved, rank=self.world.rank,
                    device=self.device,
                    where="a trainer state dict", force_loader_state=self.config.checkpoint.force_loader_state)
        self.checkpointer.skipped = {(e, b) for e, b in saved.skipped}
        # the loader's epoch: after an epoch's last batch it is already the next one
        self.step, (self.epoch, _) = saved.step, self.train_src.position()

    # ------------------------------------------------------------------------------------------ results

    def _results(self, host) -> dict:
        """The summary gathered (collectives), the model written, ``summary.json`` on rank 0."""
        cfg, ctx = self.config, self.ctx
        summary = summarize_run(cfg, ctx, self.strategy, self.optimizer, self.sampler, self.account.timer,
                                self.log, M, info=self.info, wall=self.account.loop_s,
                                eval_s=self.account.spans["eval"], steps=self.step, epochs=self.epoch,
                                steps_per_epoch=self.steps_per_epoch, num_params=self.num_params,
                                precision=self.precision, fps=self.fps, peak=self.peak, val=self.val,
                                once=self.account.once)
        summary["checkpoint"] = self.checkpointer.summary()
        summary["health"] = self.health
        summary["val_samples"] = self.val_samples  # the last validation pass's samples, each counted once
        summary["memory"]["host_after_steps"] = host
        if self.offload_stats is not None:  # this rank's state files: their size, and what the steps wrote
            summary["parallel"]["offload_files"] = self.offload_stats
        if self.parity is not None:  # parallel.check_every: this attempt's parity checks (parallel/check.py)
            timer = self.account.timer
            summary["parity_check"] = self.parity.summary(timer.totals["step"] / timer.steps if timer.steps else None)
        summary["data_reads"] = all_gather(self.train_src.reads(), self.world.size)  # what locality gave
        # how this rank's batches reached the model (normalized where, pinned, copied ahead on a side stream) and
        # the mean bytes one sent host -> device; which optimizer kernel ran
        summary["input"] = self.train_src.delivery()
        summary["optimizer"] = self.optimizer_info
        self.writer.close()
        # after the loop: the summary gathered and the model written (the write of summary.json itself left out)
        summary["attempt"] = self.account.attempt()
        if self.world.rank == 0 and ctx.run_dir:
            if cfg.run.save_model:
                summary["model"] = io.join(ctx.run_dir, "model.safetensors")
            io.write_json_atomic(io.join(ctx.run_dir, "summary.json"), summary)
        ctx.state = {"strategy": self.strategy, "model": self.strategy.module, "optimizer": self.optimizer}
        return summary


def _describe_path(parallel, precision: str) -> str:
    """The gradient path in config words, for a failed parity check's message."""
    return (f"parallel.zero_stage = {parallel.zero_stage}, quant_grads = {parallel.quant_grads!r}, error_feedback "
            f"= {str(parallel.error_feedback).lower()}, reduce_scatter = {parallel.reduce_scatter!r}, replicate = "
            f"{parallel.replicate}, tensor = {parallel.tensor}, precision {precision}")
