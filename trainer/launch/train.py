"""Launching a run: locally in this process, on Ray Train (TorchTrainer, the V2 API), or under torchrun.

All three run the same ``Trainer`` (step/trainer.py). Before any worker starts (before Ray starts), the driver
checks the data and the model's module (inputs.py) and the run directory, which a new run never clobbers, and
saves the config in this launch's attempt folder, naming it in one line (rundir.py); during the run it shows rank
0's progress
(progress.py: a bar with an ETA on a terminal, plain lines otherwise) and records it in MLflow when
``tracking.mlflow_uri`` is set (tracking.py); after the run it reads ``summary.json``, draws ``report.png`` and
writes the job's time account with its start-up (``summary["launch"]``, ``summary["startup"]``: account.py).

Start-up: the driver does not import the step loop (worker.py: torch.distributed's FSDP and DTensor), only what
launching needs, and a Ray Train worker starts importing it as its process starts (results.py: ``PRELOAD_ENV``);
a Ray instance this process already runs (a notebook's earlier ``train`` or ``materialize``) is
reused, and the workers' environment travels with the run (``RunConfig.worker_runtime_env``), so it holds
whoever started Ray. Ray Train's preemption watcher (an actor per run that polls for node drains, which
dutycycle does not act on: a drained node's workers fail and the group restarts from the last commit) is off
unless ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER`` says otherwise: one process fewer at start, and no error line.

Placement on Ray: workers are gang-scheduled in one placement group. ``PACK`` (the default) puts them on as
few nodes as possible; ``STRICT_PACK`` insists on one node. ``ray.label_selector`` (e.g. ``{zone = "a"}``)
restricts every worker's bundle to nodes carrying those labels, so a run never straddles slow links between
zones. Nodes get labels with ``ray start --labels`` (or ``Cluster.add_node(labels=...)``).

Elastic runs (``parallel.num_workers = [min, max]``): Ray Train's elastic mode (``ScalingConfig(num_workers=(min,
max))``) starts the group at the size the cluster holds and restarts it at another size when nodes are lost or
join; every restart resumes from the newest commit, resharded to the new size (DCP, the loader's canonical
partitions). Made fast and accounted here (trainer/cluster/elastic.py): each start waits
``ray.elastic_start_timeout_s`` (5 s) for its placement instead of ``ray.start_timeout_s``, and a start that
failed on a stale view counts as a controller failure that Ray Train retries (``controller_failure_limit`` off)
at the size it then sees; Ray Train considers growing every ``ray.resize_interval_s`` (its 60 s default, 5 s
here); the driver's node watch tells Ray's resource view of a lost or joined node at once, and the controller's
state changes are recorded, so the time account splits each resize into its parts (launch/account.py) and a
``resize`` row per size change joins the metrics. A run that loses nodes without resizing (a fixed size with
``ray.max_failures`` spent) is reported as a lost node, not as a placement problem. Before Ray Train starts, the
cluster must hold ``min`` workers and the layout must form at every size in the range (launch/fits.py).

CPU budget inside a worker: each Ray Train worker reserves ``parallel.cpus_per_worker`` CPUs (default 1). On a
2-core machine two workers hold both CPUs, so the loader runs in process inside the worker (``auto``: the split
held in RAM, in the node's object store when it fits, with a prefetch thread for augmentation; no Ray read
tasks that would wait for CPUs that are all reserved), and torch uses cores/workers
intra-op threads so two workers do not oversubscribe the cores.
"""

from __future__ import annotations

import os
import sys
import time

from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError, DutycycleError
from dutycycle.trainer.checkpoint.peerstore import release as release_memory
from dutycycle.trainer.checkpoint.peerstore import run_key
from dutycycle.trainer.checkpoint.raytrain import set_aside_damaged_run_state
from dutycycle.trainer.cluster.elastic import CONTROLLER_LOG, NodeWatch, controller_log, read_controller_log
from dutycycle.trainer.cluster.local import start_local_ray
from dutycycle.trainer.config import TrainConfig, use_gpu
from dutycycle.trainer.step.metrics import read_metrics, read_summary
from dutycycle.trainer.step.report import write_report

from . import progress as P
from . import rundir
from .account import add_resize_rows, job_time, startup_time
from .card import refresh_card
from .fits import NodeLostError, alive_nodes, check_fits, check_sizes, describe_nodes, request_text
from .inputs import check_inputs
from .results import PRELOAD_ENV, results_from, runtime_env
from .rundir import Attempt
from .runpage import write_run_page
from .tracking import Tracker, require_mlflow
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
    (the cache and its splits, or the table) and the model's module (launch/inputs.py); MLflow when the run is
    tracked; the run directory, which a new run never clobbers (``resume`` continues the run there,
    ``overwrite`` replaces it, ``force`` accepts a resume's data changes: launch/rundir.py). Then claims this
    launch's attempt folder, holding its config, and names it in one line."""
    resolve_run_dir(cfg)
    inputs = check_inputs(cfg)
    if cfg.tracking.mlflow_uri:  # a tracked run without MLflow is refused before anything is written
        require_mlflow(cfg.tracking.mlflow_uri)
    attempt = rundir.prepare(cfg, inputs, resume=resume, overwrite=overwrite, force=force,
                             say=None if quiet else _say)
    if not quiet:
        _say(f"config: {attempt.config_uri()} (resolved; run directory {cfg.run.dir}, attempt {attempt.number})")
    return attempt


def _say(msg: str) -> None:
    print(msg, flush=True)


def finish_run(cfg: TrainConfig, launched: float | None = None, fit_called: float | None = None,
               summary: dict | None = None, *, ray_ready: float | None = None, ray_reused: bool | None = None,
               tracker: Tracker | None = None, attempt: Attempt | None = None, controller: list[dict] | None = None,
               nodes: list[dict] | None = None) -> dict:
    """The driver's end of a run: the job's time account closed and written into ``summary.json``
    (``summary["launch"]`` and its start-up, ``summary["startup"]``: launch/account.py, when the launch time is
    known), then ``report.png`` drawn from it (its drawing time, after the account closed, is
    ``summary["report_draw_s"]``) and the run's page (``report.html``); the attempt's config becomes the run's
    (``attempt``: beside the summary and model it matches); then the MLflow run given its summary and files and
    ended (``tracker``), the run's model card (``MODEL_CARD.md``, ``model_card.json``: card.py) written before
    and its facts given to the MLflow run as tags.
    ``ray_ready``: when Ray was up (started or found); ``ray_reused``: it was this process's already.
    ``controller``, ``nodes``: Ray Train's controller events and the nodes seen lost or joined during the fit
    (cluster/elastic.py): each change of world size becomes a ``resize`` row in the metrics and a part of the
    account's failures (launch/account.py)."""
    uri = io.join(cfg.run.dir, "summary.json")
    summary = read_summary(cfg.run.dir) if summary is None else summary
    if launched is not None and "attempt" in summary:
        rows = add_resize_rows(cfg.run.dir, read_metrics(cfg.run.dir), controller or [], nodes or [])
        closed = time.time()
        summary["launch"] = job_time(summary, rows, launched=launched, fit_called=fit_called, closed=closed)
        summary["startup"] = startup_time(summary, rows, launched=launched, fit_called=fit_called,
                                          ray_ready=ray_ready, ray_reused=ray_reused)
    if tracker is not None and tracker.run_id is not None:
        summary["tracking"] = {"uri": tracker.uri, "experiment": tracker.experiment_name, "run_id": tracker.run_id}
    io.write_json_atomic(uri, summary)
    if cfg.run.report:
        t0 = time.perf_counter()
        summary["report"] = write_report(cfg.run.dir)
        summary["report_draw_s"] = time.perf_counter() - t0
        io.write_json_atomic(uri, summary)
        write_run_page(cfg.run.dir)  # report.html, from the summary just written (and any evaluations)
    if attempt is not None:
        attempt.finish()
    tags = refresh_card(cfg.run.dir, cfg, summary)  # launch/card.py: beside the model and config just written
    if tracker is not None:
        end_tracking(tracker, summary, "FINISHED", tags=tags)
    return summary


def end_tracking(tracker: Tracker, summary: dict | None, status: str, tags: dict[str, str] | None = None) -> None:
    """End the MLflow run (``tags``: set on it first); a tracking store that fails here costs the record, never
    the run's result."""
    import warnings

    try:
        tracker.finish(summary, status, tags=tags)
    except Exception as e:  # noqa: BLE001 - the training itself is done and written
        warnings.warn(f"tracking: the MLflow run {tracker.run_id} could not be ended ({type(e).__name__}: {e})",
                      RuntimeWarning, stacklevel=2)


def open_tracking(cfg: TrainConfig, launcher: str) -> Tracker | None:
    """The run's MLflow tracker, its store opening in the background; None when ``tracking.mlflow_uri`` is
    empty. Refuses a tracked run without MLflow installed (before Ray starts)."""
    if not cfg.tracking.mlflow_uri:
        return None
    require_mlflow(cfg.tracking.mlflow_uri)
    return Tracker(cfg, launcher=launcher).open()


def progress_stream(cfg: TrainConfig, tracker: Tracker | None) -> P.ProgressStream:
    """The driver's progress stream and its listeners: the display (unless ``run.log_every`` is 0), the MLflow
    run (when tracked)."""
    listeners = []
    if cfg.run.log_every > 0:
        listeners.append(P.ProgressDisplay(cfg.run.log_every, label=cfg.run.name))
    if tracker is not None:
        listeners.append(tracker.listener())
    return P.ProgressStream(listeners)


def train(cfg: TrainConfig, local: bool = False, quiet: bool = False, *, resume: bool = False,
          overwrite: bool = False, force: bool = False) -> dict:
    """Run training as configured and return the summary. ``local=True`` runs in this process with no Ray
    (one worker). A ``run.dir`` that holds a run is refused unless ``resume=True`` (continue it from its newest
    commit; ``force=True`` also accepts config changes that alter its data) or ``overwrite=True`` (replace it):
    the same as ``dutycycle train --resume / --overwrite / --force`` (launch/rundir.py). A launch that fails
    before training leaves the run directory as it was."""
    launched = time.time()
    attempt = prepare_run(cfg, quiet=quiet, resume=resume, overwrite=overwrite, force=force)
    try:
        if local:
            return train_local(cfg, launched=launched, attempt=attempt)
        return train_ray(cfg, launched=launched, attempt=attempt)
    except BaseException:
        attempt.discard_if_untrained()
        raise


# --------------------------------------------------------------------------------------------------- local


def train_local(cfg: TrainConfig, launched: float | None = None, attempt: Attempt | None = None) -> dict:
    """One worker, this process, no Ray and no process group; its progress rows go to the driver's stream in
    process. ``attempt``: this launch's folder in the run directory (``prepare_run``), where its health check is
    recorded; None writes it into the run directory."""
    if cfg.parallel.num_workers != 1:
        raise ConfigError(
            f"parallel.num_workers = {cfg.parallel.num_workers} with --local; local mode runs one worker "
            "(drop --local to run on Ray, or use torchrun)"
        )
    tracker = open_tracking(cfg, "local")
    stream = progress_stream(cfg, tracker)
    try:
        try:
            _worker().in_process(cfg, progress=stream.put, attempt_dir=attempt.dir if attempt else "")
        finally:
            stream.close()
        # inside: a summary or page that fails to write ends the MLflow run FAILED, not left RUNNING
        return finish_run(cfg, launched, tracker=tracker, attempt=attempt)
    except BaseException as e:
        if tracker is not None:
            end_tracking(tracker, None, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise


def _worker():
    """worker.py, loaded where the training runs (a Ray worker, or this process for --local)."""
    from . import worker  # heavy: torch.distributed's FSDP and DTensor, which a Ray driver does without

    return worker


# ----------------------------------------------------------------------------------------------- Ray Train


def _ray_train_fn(payload: dict) -> None:
    """Runs in every Ray Train worker (worker.py: ``ray_worker``). Ray Train has already set up the process
    group (gloo or nccl)."""
    started = time.time()  # launch/account.py: the end of the worker start
    _worker().ray_worker(payload, started)


QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "DAFT_ANALYTICS_ENABLED": "0"}


def ray_train_env(cfg: TrainConfig) -> dict[str, str]:
    """What Ray Train reads from the driver's environment (before each fit) and hands to its controller and
    workers."""
    elastic = cfg.parallel.elastic
    return {
        # a group that cannot be placed in time ends the run (elastic: a start sized on a stale view fails fast
        # and is retried at the size Ray Train then sees); Ray Train's controller polls its workers this often
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(cfg.ray.elastic_start_timeout_s if elastic
                                                      else cfg.ray.start_timeout_s),
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(cfg.ray.health_check_interval_s),
        # off (see the module's docstring) unless the user turned it on
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0"),
    }


def init_ray(cfg: TrainConfig) -> bool:
    """Ray for this run: this process's Ray instance when it has one (reused as it is: a notebook's second
    ``train``, or a ``materialize`` before it), else ``ray.address``'s cluster, else a cluster already running
    on this machine or a new one. True when this call connected or started Ray."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():  # Ray's own import is start_local_ray's
        return False
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    runtime = worker_env(job=True)  # one print per line, no state-API warnings
    if cfg.ray.address:
        import ray

        ray.init(address=cfg.ray.address, log_to_driver=True, configure_logging=False, runtime_env=runtime)
    else:  # a cluster already running on this machine, or a new one
        start_local_ray(fresh=False, log_to_driver=True, runtime_env=runtime)
    return True


def worker_env(job: bool = False) -> dict:
    """The workers' runtime environment (results.py): for the job when Ray starts (with the setup hook that
    quiets every process's logs), or for Ray Train's workers alone (``RunConfig.worker_runtime_env``; Ray takes
    a setup hook only at ``ray.init``), so that a Ray instance started elsewhere runs them alike."""
    env = runtime_env({k: os.environ.get(k, v) for k, v in QUIET_ENV.items()})
    if job:
        return env
    # Ray Train's workers start importing the step loop at once (results.py: PRELOAD_ENV)
    return {**{k: v for k, v in env.items() if k != "worker_process_setup_hook"},
            "env_vars": {**env["env_vars"], PRELOAD_ENV: "1"}}


def scaling_config(cfg: TrainConfig, gpu: bool):
    from ray.train import ScalingConfig

    resources = {"CPU": cfg.parallel.cpus_per_worker}
    if gpu:
        resources["GPU"] = 1
    p = cfg.parallel
    elastic = {"elastic_resize_monitor_interval_s": cfg.ray.resize_interval_s} if p.elastic else {}
    return ScalingConfig(
        num_workers=(p.min_workers, p.num_workers) if p.elastic else p.num_workers,
        **elastic,
        use_gpu=gpu,
        resources_per_worker=resources,
        placement_strategy=cfg.ray.placement_strategy,
        label_selector=dict(cfg.ray.label_selector) or None,
        accelerator_type=cfg.ray.accelerator_type or None,
    )


def max_failures(cfg: TrainConfig) -> int:
    """Ray Train's restarts after a worker failure: ``ray.max_failures``, plus, for an elastic run, one per worker
    the range lets it lose (max - min): Ray Train counts a lost node's dead workers as a failure like any other,
    and a run at [2, 3] is meant to go on at 2 without a restart budget of its own."""
    p = cfg.parallel
    return cfg.ray.max_failures + (p.num_workers - p.min_workers if p.elastic else 0)


def train_ray(cfg: TrainConfig, launched: float | None = None, attempt: Attempt | None = None) -> dict:
    """Run on Ray Train's TorchTrainer with ``parallel.num_workers`` workers. ``attempt``: this launch's folder in
    the run directory (``prepare_run``), where its health check and config are recorded; None: the run
    directory."""
    launched = launched or time.time()
    tracker = open_tracking(cfg, "ray")  # MLflow missing is refused here, before Ray starts
    try:
        started_ray = init_ray(cfg)
        ray_ready = time.time()
        return _fit(cfg, tracker, launched=launched, ray_ready=ray_ready, ray_reused=not started_ray,
                    attempt=attempt)
    except BaseException as e:
        if tracker is not None:
            end_tracking(tracker, None, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise


def _fit(cfg: TrainConfig, tracker: Tracker | None, *, launched: float, ray_ready: float, ray_reused: bool,
         attempt: Attempt | None) -> dict:
    """Ray is up: the TorchTrainer made and run, rank 0's progress relayed to the driver's stream meanwhile."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    gpu = use_gpu(cfg, ray.cluster_resources().get("GPU", 0))
    storage = rundir.storage_of(cfg)
    attempt_dir = attempt.dir if attempt is not None else cfg.run.dir

    # dutycycle's commits decide where a run resumes: a damaged Ray Train record must not stop the start
    set_aside_damaged_run_state(storage, cfg.run.name)

    per_worker = scaling_config(cfg, gpu).resources_per_worker
    nodes = alive_nodes()
    if not cfg.ray.address:  # a cluster this process started (or joined on this machine) does not grow
        check_fits(cfg, nodes, per_worker)
    check_sizes(cfg, nodes, per_worker)  # elastic: the layout at every size in the range

    os.environ.update(ray_train_env(cfg))  # Ray Train reads them from the driver's environment
    box, token = P.mailbox(), P.run_token()
    trainer = TorchTrainer(
        _ray_train_fn,
        train_loop_config={"config": cfg.to_dict(), "run_dir": cfg.run.dir, "attempt_dir": attempt_dir,
                           "use_gpu": gpu, "progress": {"mailbox": box, "token": token}},
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        scaling_config=scaling_config(cfg, gpu),
        # a dead worker restarts the whole group up to ray.max_failures times; the new workers resume from the
        # last commit. Ray Train keeps pointers to dutycycle's commits (checkpoint/raytrain.py), as many as we keep.
        run_config=RunConfig(name=cfg.run.name, storage_path=storage, logging_config=LoggingConfig(cfg.ray.log_level),
                             # a group that cannot be placed within ray.start_timeout_s ends the run (Ray
                             # Train's default retries it forever)
                             # elastic: a start that failed on a stale view (a node just lost) is a controller
                             # failure, retried at the size Ray Train then sees (it waits while fewer than min fit)
                             failure_config=FailureConfig(max_failures=max_failures(cfg),
                                                          controller_failure_limit=-1 if cfg.parallel.elastic else 0),
                             # the controller's record, and its wait for Ray's node table after a node loss
                             # (none with ray.node_poll_s = 0: Ray's own view alone)
                             callbacks=[controller_log(io.join(attempt_dir, CONTROLLER_LOG),
                                                       settle_s=cfg.ray.elastic_start_timeout_s
                                                       if cfg.ray.node_poll_s > 0 else 0.0)],
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
                             # the workers' environment, and the model's module when it is the user's, not
                             # installed (launch/usermodule.py)
                             worker_runtime_env={**worker_env(), **worker_runtime_env(cfg, storage)}),
    )
    stream = progress_stream(cfg, tracker)
    relay = P.Relay(box, token, stream)
    watch = NodeWatch(cfg.ray.node_poll_s)
    fit_called = time.time()
    try:
        try:
            with watch:
                result = trainer.fit()
        finally:
            relay.stop()
            stream.close()
            # the run's peer memory (checkpoint.memory_every): detached actors, freed whatever became of the run
            release_memory(run_key(cfg.run.dir, attempt_dir))
    except Exception as e:
        user = _user_error(e) or _lost_node_error(e, cfg, watch.lost()) or _start_error(e, cfg, per_worker)
        if user is not None:  # a bad config or a diverged loss inside a worker: say it plainly
            raise user from None
        raise
    if result.error is not None:
        raise (_lost_node_error(result.error, cfg, watch.lost()) or _start_error(result.error, cfg, per_worker)
               or result.error)
    # through Ray Train's result and storage, not the driver's disk (rank 0 may have run on another node)
    return finish_run(cfg, launched, fit_called, summary=results_from(cfg, result, attempt_dir),
                      ray_ready=ray_ready, ray_reused=ray_reused, tracker=tracker, attempt=attempt,
                      controller=read_controller_log(attempt_dir), nodes=watch.events)


def _lost_node_error(err: BaseException, cfg: TrainConfig, lost: list[dict]):
    """A run that failed after nodes were lost, as a ``NodeLostError`` naming them and what the run could not do
    without them; None when no node was lost (or a dutycycle error says more)."""
    if not lost:
        return None
    names = ", ".join(f"{e['node_id'][:12]} ({e['cpus']:g} CPU{'s' if e['cpus'] != 1 else ''}) at "
                      f"{time.strftime('%H:%M:%S', time.localtime(e['time']))}" for e in lost)
    p = cfg.parallel
    if p.elastic:
        need = (f"the cluster could not place the elastic minimum of parallel.num_workers = [{p.min_workers}, "
                f"{p.num_workers}] again")
    else:
        need = (f"a fixed-size run needs all parallel.num_workers = {p.num_workers} workers, and ray.max_failures = "
                f"{cfg.ray.max_failures} restarts were spent")
    return NodeLostError(f"{len(lost)} node(s) of the Ray cluster were lost during the run: {names}; {need} "
                         f"({type(err).__name__}). Resume it with `dutycycle train --resume` when the nodes are back; "
                         "or train elastically, parallel.num_workers = [min, max], to continue on fewer workers")


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
