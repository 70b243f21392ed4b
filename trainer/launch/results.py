"""How a run's results reach the driver on a real cluster, and how Ray's log stays readable.

**Results.** On a multi-node cluster the driver cannot read files rank 0 wrote to its own node's disk. So at the
end of training rank 0 reports the run's small result files (``summary.json`` and ``metrics.jsonl`` of the run,
``config.json`` and ``health.json`` of this launch's attempt folder) to Ray Train as the run's last checkpoint;
Ray Train copies it into ``RunConfig.storage_path`` (``ray.storage_path``: a shared folder or ``s3://``), and the
driver reads it from ``Result.checkpoint``, writing each file where its own view of ``run.dir`` lacks it or holds
another version (a different disk; an earlier attempt's summary), and draws ``report.png`` there once it has
closed the job's time account. The checkpoint also holds the pointer to the last
committed training checkpoint (checkpoint/raytrain.py), so ``checkpoint_uri(result.checkpoint)`` keeps working.
``model.safetensors`` stays in ``run.dir`` (it can be large); the summary names it.

**Logs.** Ray Train V2 wraps ``print`` in its workers and also lets the original through, so every line of rank 0
came out twice (``RAY_TRAIN_ENABLE_PRINT_PATCH=0`` keeps the plain print). Its placement-group cleaner asks Ray's
state API once a second whether the controller lives; the state API is served by the dashboard, which dutycycle's
local clusters do not start, so each query logged "Failed to query Ray Train Controller actor state" (46 lines in
one demo). Those warnings are silenced in every worker (``quiet_ray_logs``, Ray's ``worker_process_setup_hook``);
what the cleaner would have done, freeing the run's placement group if its controller died, happens anyway when
the driver's Ray session ends. Ray Train sets the root logger of each worker to INFO with a console handler, so
the span records Daft's Rust engine emits through Python logging (logger ``tracing.span``: one line per operator,
"ScanTaskSource::get_data;", 46 of them each time the raw loader plans its rows) would print too; that logger is
held at WARNING in every worker. Ray Train's own INFO lines (resources requested, each rank's "Reporting training
result N" at every report, each checkpoint persisted) are filtered by ``ray.log_level`` (default WARNING, through
``RunConfig(logging_config=...)``); set it to INFO to see them again. They stay in Ray's session log files.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

from dutycycle.engine import io
from dutycycle.engine.errors import DutycycleError
from dutycycle.trainer.checkpoint.raytrain import checkpoint_uri, write_pointer
from dutycycle.trainer.step.metrics import read_summary

RESULT_FILES = ("summary.json", "config.json", "metrics.jsonl", "health.json")
ATTEMPT_FILES = ("config.json", "health.json")  # in the attempt's folder; the others in the run directory
SUMMARY_KEY = "dutycycle_results"  # in the metrics of the final report: marks the results checkpoint
RAY_WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def quiet_ray_logs() -> None:
    """Runs in every Ray worker process at start (``worker_process_setup_hook``). Ray Train reconfigures its
    ``ray.train`` loggers after this hook (``ray.log_level`` filters those); these three it does not touch: the
    placement-group cleaner's, and the one that prints every rank's "Reporting training result N" line, which is
    named after its file rather than under ``ray.train``; and Daft's Rust span records (``tracing``), which
    Ray Train's INFO root logger would print to the console."""
    import importlib.util

    import ray

    # the placement-group cleaner asks Ray's state API about "the" cluster: with RAY_ADDRESS unset (or "local")
    # and another Ray instance on the machine it cannot tell which, and its thread dies with a traceback. This
    # process's cluster is the one it means.
    if os.environ.get("RAY_ADDRESS", "local") == "local" and ray.is_initialized():
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    logging.getLogger("tracing").setLevel(logging.WARNING)
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)
    spec = importlib.util.find_spec("ray.train.v2._internal.execution.context")
    if spec is not None and spec.origin:
        logging.getLogger(spec.origin).setLevel(logging.WARNING)
    if os.environ.get(PRELOAD_ENV) == "1":
        threading.Thread(target=_preload_trainer, name="dutycycle-preload", daemon=True).start()


# Set in the runtime environment of dutycycle's Ray Train workers alone (launch/train.py): their process starts
# importing the step loop (torch, its FSDP and DTensor: seconds) at once, on a thread of its own, while Ray Train
# creates the worker actor and sets up its process group; the train function's own import then finds it done
# (or waits for it: one import, never two). Every other process of the job (the controller, its helpers) skips it.
PRELOAD_ENV = "DUTYCYCLE_PRELOAD_TRAINER"


def _preload_trainer() -> None:
    import importlib

    try:
        importlib.import_module("dutycycle.trainer.step.trainer")
    except Exception:  # noqa: BLE001, S110 - the train function imports it again and reports what is wrong
        pass


def runtime_env(extra_env: dict[str, str]) -> dict:
    return {"env_vars": {**RAY_WORKER_ENV, **extra_env},
            "worker_process_setup_hook": "dutycycle.trainer.launch.results.quiet_ray_logs"}


def _home(name: str, run_dir: str, attempt_dir: str) -> str:
    return io.join(attempt_dir if name in ATTEMPT_FILES else run_dir, name)


def _holds(uri: str, data: bytes) -> bool:
    """Whether the file at ``uri`` holds exactly ``data``."""
    try:
        return io.read_capped(uri, len(data)) == data
    except (FileNotFoundError, io.FileTooLargeError):
        return False


def report_results(cfg, run_dir: str, summary: dict, rank: int, last_commit: dict | None,
                   attempt_dir: str = "") -> None:
    """Every worker calls this once after training (Ray Train V2 reports are a barrier); rank 0's carries the
    result files as a checkpoint. ``attempt_dir``: the launch's folder ("" = ``run_dir``)."""
    import ray.train

    if rank != 0:
        ray.train.report({}, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="dutycycle-results-") as d:
        for name in RESULT_FILES:
            uri = _home(name, run_dir, attempt_dir or run_dir)
            if io.exists(uri):
                fs, path = io.filesystem(uri)
                with fs.open(path, "rb") as src, open(os.path.join(d, name), "wb") as dst:
                    dst.write(src.read())
        if last_commit:
            write_pointer(d, last_commit["uri"], last_commit["step"])
        metrics = {SUMMARY_KEY: True, "steps": summary["steps"], "final_loss": summary["final_loss"],
                   "val_accuracy": summary["val_accuracy"]}
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def results_from(cfg, result, attempt_dir: str = "") -> dict:
    """The summary from Ray Train's result; each result file written into ``run.dir`` (or the attempt's folder,
    ``attempt_dir``) where the driver's view of it lacks the file or holds other bytes (rank 0 wrote them on
    another node's disk, where an earlier attempt's files may stand in the driver's)."""

    ckpt = result.checkpoint
    if ckpt is None or not (result.metrics or {}).get(SUMMARY_KEY):
        raise DutycycleError(f"Ray Train returned no results checkpoint for run {cfg.run.name!r} (storage "
                             f"{result.path!r}); the workers ended without reporting one")
    with ckpt.as_directory() as d:
        summary = read_summary(d)
        for name in RESULT_FILES:
            if not os.path.exists(os.path.join(d, name)):
                continue
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            uri = _home(name, cfg.run.dir, attempt_dir or cfg.run.dir)
            if not _holds(uri, data):
                io.write_bytes_atomic(uri, data)
    summary["ray_result_checkpoint"] = checkpoint_uri(ckpt)
    summary["ray_storage"] = result.path
    return summary
