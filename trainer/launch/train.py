"""Launching a run: locally in this process, on Ray Train (TorchTrainer, the V2 API), or under torchrun.

All three run the same ``Trainer`` (step/trainer.py). Before any worker starts (before Ray starts), the driver
checks the data and the model's module (inputs.py) and the run directory, which a new run never clobbers, and
saves the config in this launch's attempt folder (rundir.py); after the run it reads ``summary.json`` and draws
``report.png``.

Placement on Ray: workers are gang-scheduled in one placement group. ``PACK`` (the default) puts them on as
few nodes as possible; ``STRICT_PACK`` insists on one node. ``ray.label_selector`` (e.g. ``{zone = "a"}``)
restricts every worker's bundle to nodes carrying those labels, so a run never straddles slow links between
zones. Nodes get labels with ``ray start --labels`` (or ``Cluster.add_node(labels=...)``).

CPU budget inside a worker: each Ray Train worker reserves ``parallel.cpus_per_worker`` CPUs (default 1). On a
2-core machine two workers hold both CPUs, so the loader runs in process inside the worker (``auto``: the split
held in RAM, in the node's object store when it fits, with a prefetch thread for augmentation; no Ray read
tasks that would wait for CPUs that are all reserved), and torch uses cores/workers
intra-op threads so two workers do not oversubscribe the cores.
"""

from __future__ import annotations

import os

from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError, DutycycleError
from dutycycle.trainer.checkpoint.raytrain import latest_reported, report_commit, set_aside_damaged_run_state
from dutycycle.trainer.cluster.local import start_local_ray
from dutycycle.trainer.cluster.topology import node_label
from dutycycle.trainer.config import TrainConfig, from_dict, use_gpu
from dutycycle.trainer.step.loop import WorkerContext, set_threads
from dutycycle.trainer.step.metrics import read_metrics, read_summary
from dutycycle.trainer.step.report import write_report
from dutycycle.trainer.step.trainer import Trainer

from . import rundir
from .account import job_time
from .fits import alive_nodes, check_fits, describe_nodes, request_text
from .inputs import check_inputs
from .results import report_results, results_from, runtime_env
from .rundir import Attempt
from .runpage import write_run_page
from .usermodule import worker_runtime_env


def resolve_run_dir(cfg: TrainConfig) -> str:
    """Local run, checkpoint and data locations become absolute (Ray workers run in another directory, and Ray
    Train storage needs absolute paths)."""
    if io.protocol(cfg.run.dir) == "file":
        cfg.run.dir = os.path.abspath(cfg.run.dir)
    c = cfg.checkpoint
    if c.dir and io.protocol(c.dir) == "file":
        c.dir = os.path.abspath(c.dir)
    if cfg.ray.storage_path and io.protocol(cfg.ray.storage_path) == "file":
        cfg.ray.storage_path = os.path.abspath(cfg.ray.storage_path)
    if c.resume not in ("auto", "none") and io.protocol(c.resume) == "file":
        c.resume = os.path.abspath(c.resume)
    d = cfg.data  # `data.cache = "dutycycle-demo/cache"` means this directory's, not a Ray worker's
    for name in ("cache", "table"):
        value = getattr(d, name)
        if value and io.protocol(value) == "file":
            setattr(d, name, os.path.abspath(value))
    return cfg.run.dir


def prepare_run(cfg: TrainConfig, quiet: bool = False, *, resume: bool = False, overwrite: bool = False,
                force: bool = False) -> Attempt:
    """Everything a launch checks and decides in the driver, before Ray starts: paths made absolute; the data
    (the cache and its splits, or the table) and the model's module (launch/inputs.py); the run directory, which
    a new run never clobbers (``resume`` continues the run there, ``overwrite`` replaces it, ``force`` accepts a
    resume's data changes: launch/rundir.py). Then claims this launch's attempt folder, holding its config."""
    resolve_run_dir(cfg)
    inputs = check_inputs(cfg)
    attempt = rundir.prepare(cfg, inputs, resume=resume, overwrite=overwrite, force=force,
                             say=None if quiet else _say)
    if not quiet:
        _say(f"run directory {cfg.run.dir}, attempt {attempt.number}: config in {attempt.config_uri()}")
    return attempt


def _say(msg: str) -> None:
    print(msg, flush=True)


def finish_run(cfg: TrainConfig, launched: float | None = None, fit_called: float | None = None,
               summary: dict | None = None) -> dict:
    """The driver's end of a run: the job's time account closed and written into ``summary.json``
    (``summary["launch"]``, launch/account.py, when the launch time is known), then ``report.png`` drawn from it
    (its drawing time, after the account closed, is ``summary["report_draw_s"]``)."""
    import time

    uri = io.join(cfg.run.dir, "summary.json")
    summary = read_summary(cfg.run.dir) if summary is None else summary
    if launched is not None and "attempt" in summary:
        summary["launch"] = job_time(summary, read_metrics(cfg.run.dir), launched=launched, fit_called=fit_called,
                                     closed=time.time())
    io.write_json_atomic(uri, summary)
    if cfg.run.report:
        t0 = time.perf_counter()
        summary["report"] = write_report(cfg.run.dir)
        summary["report_draw_s"] = time.perf_counter() - t0
        io.write_json_atomic(uri, summary)
        write_run_page(cfg.run.dir)  # report.html, from the summary just written (and any evaluations)
    return summary


def train(cfg: TrainConfig, local: bool = False, quiet: bool = False, *, resume: bool = False,
          overwrite: bool = False, force: bool = False) -> dict:
    """Run training as configured and return the summary. ``local=True`` runs in this process with no Ray
    (one worker). A ``run.dir`` that holds a run is refused unless ``resume=True`` (continue it from its newest
    commit; ``force=True`` also accepts config changes that alter its data) or ``overwrite=True`` (replace it):
    the same as ``dutycycle train --resume / --overwrite / --force`` (launch/rundir.py). A launch that fails
    before training leaves the run directory as it was."""
    import time

    launched = time.time()
    attempt = prepare_run(cfg, quiet=quiet, resume=resume, overwrite=overwrite, force=force)
    try:
        if local:
            summary = train_local(cfg, launched=launched, attempt_dir=attempt.dir)
        else:
            summary = train_ray(cfg, launched=launched, attempt_dir=attempt.dir)
    except BaseException:
        attempt.discard_if_untrained()
        raise
    attempt.finish()
    return summary


# --------------------------------------------------------------------------------------------------- local


def train_local(cfg: TrainConfig, launched: float | None = None, attempt_dir: str = "") -> dict:
    """One worker, this process, no Ray and no process group. ``attempt_dir``: this launch's folder in the run
    directory (``prepare_run``), where its health check is recorded."""
    import time

    import torch

    if cfg.parallel.num_workers != 1:
        raise ConfigError(
            f"parallel.num_workers = {cfg.parallel.num_workers} with --local; local mode runs one worker "
            "(drop --local to run on Ray, or use torchrun)"
        )
    gpu = use_gpu(cfg, torch.cuda.device_count())
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    set_threads(cfg, 1)
    with Trainer(cfg, WorkerContext(rank=0, world_size=1, device=device, run_dir=cfg.run.dir,
                                    attempt_dir=attempt_dir, started=time.time())) as trainer:
        trainer.train()
    return finish_run(cfg, launched)


# ----------------------------------------------------------------------------------------------- Ray Train


def _ray_train_fn(payload: dict) -> None:
    """Runs in every Ray Train worker. Ray Train has already set up the process group (gloo or nccl)."""
    import time

    started = time.time()  # launch/account.py: the end of the worker start
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = from_dict(payload["config"])
    set_threads(cfg, ctx.get_local_world_size())
    device = ray.train.torch.get_device() if payload["use_gpu"] else torch.device("cpu")
    rt = ray.get_runtime_context()

    me = {"rank": rank, "node_id": rt.get_node_id(), "node": node_label(), "labels": dict(rt.get_node_labels() or {})}
    where = [None] * world
    if world > 1:
        dist.all_gather_object(where, me)
    else:
        where = [me]
    # Ray's own labels (ray.io/...) are noise in a summary; keep the user's
    for w in where:
        w["labels"] = {k: v for k, v in w["labels"].items() if not k.startswith("ray.io/")}

    # a restarted group resumes from the newest verified commit by itself (checkpoint.resume = "auto"); Ray
    # Train's own record of the last reported one is kept for the summary
    info = {"workers": where, "launcher": "ray", "ray_checkpoint": latest_reported()}
    last_commit: dict = {}

    def on_commit(step: int, uri: str) -> None:
        last_commit.update(step=step, uri=uri)
        report_commit(step, uri)

    def report(metrics: dict) -> None:  # an evaluation's metrics: the barrier only, the hand-over in the background
        ray.train.report(metrics, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)

    ctx = WorkerContext(rank=rank, world_size=world, device=device, report=report, run_dir=payload["run_dir"],
                        attempt_dir=payload["attempt_dir"], info=info, on_commit=on_commit,
                        node_labels=[w["node"] for w in where], started=started)
    with Trainer(cfg, ctx) as trainer:
        summary = trainer.train()
    report_results(cfg, payload["run_dir"], summary, rank, last_commit or None, attempt_dir=payload["attempt_dir"])


def init_ray(cfg: TrainConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0"}
    for k, v in env.items():
        os.environ.setdefault(k, v)
    runtime = runtime_env({k: os.environ[k] for k in env})  # one print per line, no state-API warnings
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=True, configure_logging=False, runtime_env=runtime)
    else:  # a cluster already running on this machine, or a new one
        start_local_ray(fresh=False, log_to_driver=True, runtime_env=runtime)


def scaling_config(cfg: TrainConfig, gpu: bool):
    from ray.train import ScalingConfig

    resources = {"CPU": cfg.parallel.cpus_per_worker}
    if gpu:
        resources["GPU"] = 1
    return ScalingConfig(
        num_workers=cfg.parallel.num_workers,
        use_gpu=gpu,
        resources_per_worker=resources,
        placement_strategy=cfg.ray.placement_strategy,
        label_selector=dict(cfg.ray.label_selector) or None,
        accelerator_type=cfg.ray.accelerator_type or None,
    )


def train_ray(cfg: TrainConfig, launched: float | None = None, attempt_dir: str = "") -> dict:
    """Run on Ray Train's TorchTrainer with ``parallel.num_workers`` workers. ``attempt_dir``: this launch's
    folder in the run directory (``prepare_run``), where its health check and config are recorded."""
    import time

    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    init_ray(cfg)
    gpu = use_gpu(cfg, ray.cluster_resources().get("GPU", 0))
    storage = rundir.storage_of(cfg)

    # dutycycle's commits decide where a run resumes: a damaged Ray Train record must not stop the start
    set_aside_damaged_run_state(storage, cfg.run.name)

    per_worker = scaling_config(cfg, gpu).resources_per_worker
    if not cfg.ray.address:  # a cluster this process started (or joined on this machine) does not grow
        check_fits(cfg, alive_nodes(), per_worker)
    # Ray Train reads the start timeout from the driver's environment and passes it to its controller
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(cfg.ray.start_timeout_s)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(cfg.ray.health_check_interval_s)
    trainer = TorchTrainer(
        _ray_train_fn,
        train_loop_config={"config": cfg.to_dict(), "run_dir": cfg.run.dir, "attempt_dir": attempt_dir or cfg.run.dir,
                           "use_gpu": gpu},
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        scaling_config=scaling_config(cfg, gpu),
        # a dead worker restarts the whole group up to ray.max_failures times; the new workers resume from the
        # last commit. Ray Train keeps pointers to dutycycle's commits (checkpoint/raytrain.py), as many as we keep.
        run_config=RunConfig(name=cfg.run.name, storage_path=storage, logging_config=LoggingConfig(cfg.ray.log_level),
                             # the model's module when it is the user's, not installed (launch/usermodule.py)
                             worker_runtime_env=worker_runtime_env(cfg, storage),
                             # a group that cannot be placed within ray.start_timeout_s ends the run (Ray
                             # Train's default retries it forever)
                             failure_config=FailureConfig(max_failures=cfg.ray.max_failures,
                                                          controller_failure_limit=0),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep)),
    )
    fit_called = time.time()
    try:
        result = trainer.fit()
    except Exception as e:
        user = _user_error(e) or _start_error(e, cfg, per_worker)
        if user is not None:  # a bad config or a diverged loss inside a worker: say it plainly
            raise user from None
        raise
    if result.error is not None:
        raise _start_error(result.error, cfg, per_worker) or result.error
    # through Ray Train's result and storage, not the driver's disk (rank 0 may have run on another node)
    return finish_run(cfg, launched, fit_called, summary=results_from(cfg, result, attempt_dir or cfg.run.dir))


def _start_error(err: BaseException, cfg: TrainConfig, per_worker: dict):
    """A worker group that never started, as a dutycycle error naming the request and the wait; None otherwise."""

    exc, seen = err, 0
    while exc is not None and seen < 10:
        if type(exc).__name__ == "WorkerGroupStartupTimeoutError":
            try:
                nodes = describe_nodes(alive_nodes())
            except Exception:  # noqa: BLE001 - the message names what it can
                nodes = "nodes unknown"
            return ConfigError(f"{request_text(cfg, per_worker)} was not placed within ray.start_timeout_s = "
                               f"{cfg.ray.start_timeout_s:g} s (the cluster now: {nodes}); free or add resources, "
                               "lower the request, or raise ray.start_timeout_s on a cluster that autoscales")
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return None


def _user_error(err: BaseException):
    """The first dutycycle user error (e.g. TrainingDiverged) raised by any worker, unwrapped from Ray's
    WorkerGroupError / RayTaskError layers; None when the failure is something else."""

    candidates = [err, *getattr(err, "worker_failures", {}).values()]
    for exc in candidates:
        seen = 0
        while exc is not None and seen < 10:
            if isinstance(exc, DutycycleError):
                return exc
            exc = getattr(exc, "cause", None) or exc.__cause__
            seen += 1
    return None
