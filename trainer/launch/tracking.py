"""A run recorded in MLflow (``[tracking]``, config_tracking.py; the optional ``tracking`` extra).

The driver records; the workers know nothing of MLflow. What a tracked run holds:

- params: the resolved config, flattened (``data.global_batch_size``, ``optim.lr``, ...);
- metrics, as the steps arrive through the progress stream (progress.py): ``loss``, ``lr``, ``grad_norm`` and
  ``samples_per_s`` per step, ``val_accuracy`` and ``val_loss`` per evaluation, and at the end the summary's
  ``final_loss``, ``goodput``, ``wall_s`` and ``launch_to_first_step_s``;
- artifacts: ``summary.json``, ``config.json``, ``metrics.jsonl``, ``health.json``, ``report.png``, the model
  card (``MODEL_CARD.md``, ``model_card.json``: card.py), the model
  (``model/model.safetensors``, ``tracking.log_model``) and an evaluation's files (``evaluation/``: the evaluate
  command calls ``log_run_files``);
- tags: ``dutycycle.table``, ``dutycycle.table_version``, ``dutycycle.cache``, ``dutycycle.cache_fingerprint``,
  ``dutycycle.version``, ``dutycycle.run_dir``, ``dutycycle.launcher``, the git revision of the working
  directory's repository (``mlflow.source.git.commit`` and ``dutycycle.git_dirty``), ``mlflow.user``,
  ``mlflow.source.name``, and ``tracking.tags``; at the end the model card's facts, ``dutycycle.card.*`` (the
  data, code, environment, training and evaluation: card.py's ``card_tags``), and its Markdown as the run's
  description (``mlflow.note.content``), set again by each ``dutycycle evaluate``.

Timing: whether MLflow is installed is checked before Ray starts (``require_mlflow``: a clear error naming
``pip install 'dutycycle[tracking]'``). Importing MLflow and opening its store (a new SQLite database migrates
its schema: seconds) run on a thread of their own while Ray and the workers start. The MLflow run itself is
created (or continued) when the first attempt reaches its training loop: a launch that fails before training
leaves no run behind and writes nothing into the run directory.

One run across attempts: its id is kept in ``RUN_DIR/mlflow.json``. An attempt that resumes from a checkpoint of
the run directory (``--resume``, or Ray Train restarting the workers) continues that MLflow run: its status goes
back to RUNNING, new metrics append to the same histories, a config key whose value changed is recorded as a tag
``dutycycle.changed.<key>`` (MLflow params cannot change). A run that starts from step 0 is a new MLflow run.

A local directory as ``mlflow_uri`` is a SQLite store ``DIR/mlflow.db`` with its artifacts under
``DIR/artifacts``: MLflow 3 refuses its old file store unless told otherwise, and SQLite needs no server.
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import subprocess
import tempfile
import threading
import time
import warnings

from dutycycle.engine import io
from dutycycle.engine.errors import ConfigError

INSTALL_HINT = "pip install 'dutycycle[tracking]'"
RECORD = "mlflow.json"  # in the run directory: which MLflow run this run directory is
ARTIFACT_FILES = ("summary.json", "config.json", "metrics.jsonl", "health.json", "report.png", "MODEL_CARD.md",
                  "model_card.json")
EVALUATION = "evaluation"  # RUN_DIR/evaluation/*: the evaluate command's files, logged under the same name
STEP_METRICS = ("loss", "lr", "grad_norm", "samples_per_s")
EVAL_METRICS = ("val_accuracy", "val_loss")
FLUSH_S = 2.0  # metrics are sent in batches: at least this often while steps arrive
FLUSH_ROWS = 500  # or when this many metric values are waiting (MLflow takes 1,000 per batch)
PARAMS_PER_BATCH = 100  # MLflow's limit on params per log_batch call
PARAM_VALUE_MAX = 6000  # MLflow's limit on a param value's length


def require_mlflow(uri: str) -> None:
    """Refuse a tracked run when MLflow is not installed, before anything starts."""
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError(f"tracking.mlflow_uri = {uri!r} records the run in MLflow, which is not installed: "
                          f"{INSTALL_HINT} (or leave tracking.mlflow_uri empty)")


def resolve_store(uri: str, cwd: str | None = None) -> tuple[str, str | None]:
    """``(tracking URI, default artifact root or None)`` for ``tracking.mlflow_uri``: a local directory (or a
    ``file:`` URI) becomes a SQLite store inside it, artifacts beside; a ``sqlite:///`` file keeps its artifacts
    beside it (its path made absolute against ``cwd``); anything else is MLflow's (or its server's) to place."""
    cwd = cwd or os.getcwd()
    if uri.startswith("sqlite:///"):  # artifacts beside the database (MLflow's default is ./mlruns, wherever one is)
        path = uri[len("sqlite:///"):]
        path = path if os.path.isabs(path) else os.path.join(cwd, path)
        return "sqlite:///" + path, os.path.join(os.path.dirname(path), "artifacts")
    if uri.startswith("file:"):
        uri = uri[len("file://"):] if uri.startswith("file://") else uri[len("file:"):]
    elif "://" in uri or uri in ("databricks", "databricks-uc") or uri.startswith("databricks://"):
        return uri, None
    root = uri if os.path.isabs(uri) else os.path.join(cwd, uri)
    return f"sqlite:///{os.path.join(root, 'mlflow.db')}", os.path.join(root, "artifacts")


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: dotted keys (``data.augment.flip``), values as text. A table of strings
    (``ray.label_selector``, ``tracking.tags``) is one value, written as JSON, as are lists; values are cut to
    MLflow's length limit."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not all(isinstance(x, str) for x in v.values()):
            out.update(flat_params(v, key + "."))
        else:
            text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
            out[key] = text[:PARAM_VALUE_MAX]
    return out


def code_revision(cwd: str | None = None) -> dict | None:
    """``{"commit", "dirty", "root"}`` of the git repository holding ``cwd`` (tracked files changed or not), or
    None outside a repository or without git."""
    cwd = cwd or os.getcwd()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        root = git("rev-parse", "--show-toplevel")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty, "root": root}


def dutycycle_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dutycycle")
    except PackageNotFoundError:
        return "unknown"


def data_tags(data: dict | None) -> dict[str, str]:
    """The data a run trained on, as tags: the table and its version, the cache and its fingerprint."""
    data = data or {}
    lineage = data.get("lineage") or {}
    options = lineage.get("options") or {}
    tags = {"dutycycle.table": lineage.get("table"), "dutycycle.table_version": options.get("table_version"),
            "dutycycle.cache": lineage.get("cache"), "dutycycle.cache_fingerprint": data.get("fingerprint")}
    return {k: str(v) for k, v in tags.items() if v not in (None, "")}


def read_record(run_dir: str) -> dict | None:
    """``RUN_DIR/mlflow.json``: the MLflow run this run directory is recorded as, or None."""
    uri = io.join(run_dir, RECORD)
    return io.read_json(uri) if io.exists(uri) else None


# --------------------------------------------------------------------------------------------- the run


class Tracker:
    """One run directory's MLflow run, on the driver. ``open`` begins opening the store in the background;
    ``listener`` is the progress stream's listener (it creates or continues the MLflow run at the first
    ``start`` row, then logs metrics); ``finish`` logs the summary and artifacts and ends the run."""

    def __init__(self, cfg, *, launcher: str, cwd: str | None = None):
        t = cfg.tracking
        self.cfg, self.launcher = cfg, launcher
        self.cwd = cwd or os.getcwd()
        self.uri, self.default_artifacts = resolve_store(t.mlflow_uri, self.cwd)
        self.experiment_name = t.experiment or cfg.run.name
        self.run_dir = cfg.run.dir
        self.client = None
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self.error: BaseException | None = None
        self.continued = False
        self.attempts = 0
        self._pending: list = []
        self._flushed = time.monotonic()
        self._opened = threading.Thread(target=self._open, name="dutycycle-mlflow-open", daemon=True)

    # ------------------------------------------------------------------------------ opening

    def open(self) -> Tracker:
        self._opened.start()
        return self

    def _open(self) -> None:
        try:
            import logging

            from mlflow import MlflowClient

            # a new SQLite store announces its schema migration at INFO through alembic and mlflow's own loggers
            for name in ("alembic", "mlflow.store.db.utils"):
                logging.getLogger(name).setLevel(logging.WARNING)
            if self.uri.startswith("sqlite:///"):
                os.makedirs(os.path.dirname(self.uri[len("sqlite:///"):]) or ".", exist_ok=True)
            self.client = MlflowClient(tracking_uri=self.uri)
            exp = self.client.get_experiment_by_name(self.experiment_name)
            if exp is None:
                where = self.cfg.tracking.artifact_location or self._default_location()
                self.experiment_id = self.client.create_experiment(self.experiment_name, artifact_location=where)
            else:
                self.experiment_id = exp.experiment_id
        except Exception as e:  # noqa: BLE001 - reported once by ready(); training goes on without tracking
            self.error = e

    def _default_location(self) -> str | None:
        if self.default_artifacts is None:
            return None
        return os.path.join(self.default_artifacts, self.experiment_name.replace(os.sep, "_"))

    def ready(self, timeout: float = 300.0) -> bool:
        """Wait for the store to open (opening it now if ``open`` was not called); False, with one warning,
        when it failed."""
        if self._opened.ident is None:
            self._opened.start()
        self._opened.join(timeout)
        if self.error is None and self.client is None:
            self.error = TimeoutError(f"the MLflow store {self.uri!r} did not open within {timeout:.0f} s")
        if self.error is not None:
            self._warn(f"MLflow store {self.uri!r} could not be opened")
            return False
        return True

    def _warn(self, what: str) -> None:
        if not getattr(self, "_warned", False):
            self._warned = True
            warnings.warn(f"tracking: {what}: {type(self.error).__name__}: {self.error}; the run is not tracked",
                          RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------------------ the run

    def begin(self, start: dict) -> None:
        """At the first ``start`` row: continue the run directory's MLflow run when the attempt resumed from a
        checkpoint and the record names a run of this store, else create one; then params and tags."""
        from mlflow.entities import Param, RunTag

        if self.run_id is not None:  # Ray Train restarted the workers: the same run, one attempt more
            self.attempts += 1
            self.client.set_tag(self.run_id, "dutycycle.attempts", str(self.attempts))
            return
        if not self.ready():
            return
        record = read_record(self.run_dir) if start.get("resumed") else None
        existing = None
        if record and record.get("tracking_uri") == self.uri:
            try:
                existing = self.client.get_run(record["run_id"])
            except Exception:  # noqa: BLE001 - deleted or unreachable: a new run is the answer
                existing = None
        params = flat_params(self.cfg.to_dict())
        tags = self._tags(start)
        if existing is not None:
            self.run_id, self.continued = existing.info.run_id, True
            self.client.update_run(self.run_id, status="RUNNING")
            old = existing.data.params
            changed = {k: v for k, v in params.items() if k in old and old[k] != v}
            params = {k: v for k, v in params.items() if k not in old}
            tags.update({f"dutycycle.changed.{k}": f"{old[k]} -> {v}"[:PARAM_VALUE_MAX] for k, v in changed.items()})
            attempts = int(existing.data.tags.get("dutycycle.attempts", "1")) + 1
        else:
            name = self.cfg.tracking.run_name or os.path.basename(self.run_dir.rstrip("/")) or self.cfg.run.name
            run = self.client.create_run(self.experiment_id, run_name=name, start_time=int(start["time"] * 1000))
            self.run_id, attempts = run.info.run_id, 1
        self.attempts = attempts
        tags["dutycycle.attempts"] = str(attempts)
        items = list(params.items())
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[i:i + PARAMS_PER_BATCH]])
        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        io.write_json_atomic(io.join(self.run_dir, RECORD), {
            "tracking_uri": self.uri, "experiment_id": self.experiment_id, "run_id": self.run_id,
            "experiment": self.experiment_name})

    def _tags(self, start: dict) -> dict[str, str]:
        tags = {"mlflow.source.name": "dutycycle train", "mlflow.source.type": "LOCAL",
                "mlflow.user": _user(), "dutycycle.version": dutycycle_version(),
                "dutycycle.run_dir": self.run_dir, "dutycycle.launcher": self.launcher,
                "dutycycle.world_size": str(start.get("world_size", "")), **data_tags(start.get("data"))}
        rev = code_revision(self.cwd)
        if rev is not None:
            tags.update({"mlflow.source.git.commit": rev["commit"], "dutycycle.git_dirty": str(rev["dirty"]).lower(),
                         "dutycycle.git_root": rev["root"]})
        tags.update({str(k): str(v) for k, v in self.cfg.tracking.tags.items()})
        return tags

    # ------------------------------------------------------------------------------ metrics

    def listener(self) -> MetricsListener:
        return MetricsListener(self)

    def add_metrics(self, row: dict) -> None:
        from mlflow.entities import Metric

        names = EVAL_METRICS if row.get("event") == "eval" else STEP_METRICS
        ms = int(row.get("time", time.time()) * 1000)
        for k in names:
            v = row.get(k)
            if v is not None:
                self._pending.append(Metric(k, float(v), ms, int(row["step"])))
        if (len(self._pending) >= FLUSH_ROWS or time.monotonic() - self._flushed >= FLUSH_S
                or row.get("event") != "step"):
            self.flush()

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if self.run_id is None or not self._pending:
            return
        batch, self._pending = self._pending, []
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    # ------------------------------------------------------------------------------ the end

    def finish(self, summary: dict | None, status: str = "FINISHED", tags: dict[str, str] | None = None) -> None:
        """The summary's figures, ``tags`` (the model card's: launch/card.py), the run directory's files as
        artifacts, the run ended with ``status``. Does nothing when no MLflow run began (the training never
        reached its loop)."""
        from mlflow.entities import Metric

        if self.run_id is None:
            return
        self.flush()
        set_tags(self.client, self.run_id, tags)
        if summary:
            step = int(summary.get("steps") or 0)
            now = int(time.time() * 1000)
            figures = {"final_loss": summary.get("final_loss"), "goodput": summary.get("goodput"),
                       "wall_s": summary.get("wall_s"),
                       "launch_to_first_step_s": (summary.get("startup") or {}).get("launch_to_first_step_s")}
            metrics = [Metric(k, float(v), now, step) for k, v in figures.items() if v is not None]
            if metrics:
                self.client.log_batch(self.run_id, metrics=metrics)
            files = [n for n in ARTIFACT_FILES if io.exists(io.join(self.run_dir, n))]
            self._log_files(self.run_dir, files, None)
            model = summary.get("model")
            if self.cfg.tracking.log_model and model and io.exists(model):
                self._log_files(os.path.dirname(model.rstrip("/")) or self.run_dir, [os.path.basename(model)],
                                "model")
            evaluation = io.join(self.run_dir, EVALUATION)
            if io.exists(evaluation):
                self._log_files(evaluation, _listing(evaluation), EVALUATION)
        self.client.set_terminated(self.run_id, status=status)

    def _log_files(self, folder: str, names: list[str], artifact_path: str | None) -> None:
        log_files(self.client, self.run_id, folder, names, artifact_path)


class MetricsListener:
    """The tracker as a progress listener: ``start`` begins the MLflow run, step and eval rows become metrics;
    closing the stream sends what is waiting (the run itself ends in ``Tracker.finish``)."""

    name = "MLflow tracking"

    def __init__(self, tracker: Tracker):
        self.tracker = tracker

    def __call__(self, row: dict) -> None:
        kind = row.get("event")
        if kind == "start":
            self.tracker.begin(row)
        elif kind in ("step", "eval", "end") and self.tracker.run_id is not None:
            self.tracker.add_metrics(row)

    def close(self) -> None:
        self.tracker.flush()


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _listing(folder: str) -> list[str]:
    fs, path = io.filesystem(folder)
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False) if fs.isfile(p))


def log_files(client, run_id: str, folder: str, names: list[str], artifact_path: str | None) -> None:
    """Log ``folder/NAME`` for each name as artifacts of ``run_id`` (under ``artifact_path``); a folder on an
    object store is copied to a local temporary directory first (MLflow logs local files)."""
    if not names:
        return
    if io.protocol(folder) == "file":
        local = folder.removeprefix("file://")
        for name in names:
            client.log_artifact(run_id, os.path.join(local, name), artifact_path)
        return
    with tempfile.TemporaryDirectory(prefix="dutycycle-mlflow-") as d:
        for name in names:
            target = os.path.join(d, name)
            fs, path = io.filesystem(io.join(folder, name))
            fs.get_file(path, target)  # streamed: the weights can be large
            client.log_artifact(run_id, target, artifact_path)


def set_tags(client, run_id: str, tags: dict[str, str] | None) -> None:
    """Set ``tags`` on the run, in batches MLflow accepts."""
    from mlflow.entities import RunTag

    items = list((tags or {}).items())
    for i in range(0, len(items), PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in items[i:i + PARAMS_PER_BATCH]])


def log_run_files(run_dir: str, paths: list[str], artifact_path: str | None = EVALUATION,
                  metrics: dict[str, float] | None = None, step: int | None = None,
                  tags: dict[str, str] | None = None) -> str | None:
    """Log files (e.g. an evaluation's ``RUN_DIR/evaluation/*.json`` and ``*.png``; ``artifact_path`` None: at
    the artifacts' root), optionally a few metrics (``{"test_accuracy": 0.98}``) and tags (the model card's)
    to the MLflow run of ``run_dir``; the run keeps its status. Returns its run id, or None when the run
    directory is not tracked. For the evaluate command, after the training has ended."""
    record = read_record(run_dir)
    if record is None:
        return None
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(tracking_uri=record["tracking_uri"])
    run_id = record["run_id"]
    by_folder: dict[str, list[str]] = {}
    for p in paths:
        folder, _, name = str(p).rstrip("/").rpartition("/")
        by_folder.setdefault(folder or ".", []).append(name)
    for folder, names in by_folder.items():
        log_files(client, run_id, folder, names, artifact_path)
    if metrics:
        ms = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), ms, int(step or 0)) for k, v in metrics.items()])
    set_tags(client, run_id, tags)
    return run_id
