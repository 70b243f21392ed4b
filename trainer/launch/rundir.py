"""Run directories: a launch never clobbers a run, and each launch keeps its own files apart.

A run directory (``run.dir``) holds one run, trained by one or more launches (attempts)::

    RUN_DIR/
      attempts/1/config.json    the config launch 1 started with (claimed with create-if-absent: the attempt's
      attempts/1/health.json    number is taken once); the pre-flight check of its (last) worker group
      attempts/1/attempt.json   the launch: when, resumed from which step, what the config changed, --force
      attempts/2/...            a --resume: the next launch, its own files
      metrics.jsonl             the run's steps, every step once: a resume keeps the rows up to its commit
      checkpoints/              the run's commits (checkpoint.dir, when set, holds them instead)
      config.json               \\
      summary.json               | the newest attempt that finished: rewritten together when a later attempt
      model.safetensors          | finishes, so the model, its summary and its config always belong together
      report.png                /  (an attempt that fails leaves the last finished attempt's in place)
      ray/                      Ray Train's storage (ray.storage_path, when set, holds it instead)

What a launch does with it (``prepare``, in the driver, before Ray starts):

- a directory that holds no run (absent, empty, or none of dutycycle's files, and no commit at the checkpoint
  root): a new run, attempt 1.
- one that holds a finished run (``summary.json``) or an unfinished one (commits, steps, attempts, no summary):
  refused, naming what is there (steps, when, the newest commit) and the ways on: ``resume`` (continue from the
  newest commit, e.g. with a larger ``run.max_steps``; the config is compared with the run's: changes.py),
  another ``run.dir``, or ``overwrite`` (remove dutycycle's files there, and the commits at the checkpoint
  root; anything else in the folder stays).

A launch that fails before training (a bad config, missing data, a model that does not import, a refused run
directory: all before anything is written; a health check that fails, a worker group that is never placed: in
Ray) leaves the run directory as it was: its attempt folder is removed, and a directory the launch created is
removed whole. "Before training" means the launch wrote no row into ``metrics.jsonl``: its Trainer never reached
the restore that opens an attempt's rows. Ray Train's own storage (``RUN_DIR/ray``) is Ray's: Ray Train updates
its record there on every start.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from dutycycle.engine import formats, io
from dutycycle.engine.errors import ConfigError, SourceError
from dutycycle.trainer.checkpoint import manifest as mf
from dutycycle.trainer.config import (
    ATTEMPTS,
    CONFIG_FILE,
    TrainConfig,
    attempt_numbers,
    from_dict,
    run_config_uri,
)
from dutycycle.trainer.config_batch import keep_run_partitions
from dutycycle.trainer.step.metrics import METRICS, SUMMARY, read_metrics

from . import changes as ch
from .inputs import Inputs

ATTEMPT_FILE = "attempt.json"
HEALTH_FILE = "health.json"
# dutycycle's own files in a run directory, and its folders: what --overwrite removes (nothing else)
# mlflow.json: the MLflow run a resume continues (launch/tracking.py); a replaced run starts a new one
# MODEL_CARD.md, model_card.json: the run's model card (launch/card.py), which describes the replaced run
RUN_FILES = (SUMMARY, METRICS, CONFIG_FILE, "model.safetensors", "report.png", "report.html", HEALTH_FILE,
             "mlflow.json", "MODEL_CARD.md", "model_card.json")
# evaluation/: `dutycycle evaluate`'s files; export/: `dutycycle export`'s default output; both describe this run's
# model and would be stale beside a replaced one
RUN_FOLDERS = (ATTEMPTS, "checkpoints", "ray", "evaluation", "export")
# their presence makes a directory hold a run (report.png or Ray's storage alone do not)
RUN_MARKERS = (SUMMARY, METRICS, CONFIG_FILE, "model.safetensors", HEALTH_FILE, ATTEMPTS)


class RunExistsError(ConfigError):
    """``run.dir`` holds a run, and the launch said neither resume nor overwrite."""


# ------------------------------------------------------------------------------------------------ the state


@dataclass
class RunState:
    """What a run directory holds, as the driver sees it before a launch."""

    run_dir: str
    checkpoint_root: str
    present: list[str]  # dutycycle's files and folders in run_dir ("checkpoints/" with a trailing slash)
    commits: list[int]  # committed steps at the checkpoint root, newest first
    summary: dict | None  # summary.json of the newest finished attempt
    attempts: list[int]
    finished_at: float | None = None
    ray_run: str | None = None  # Ray Train's record of this run name under ray.storage_path, when set and there

    @property
    def holds_run(self) -> bool:
        return bool(self.commits) or any(m.rstrip("/") in RUN_MARKERS for m in self.present)

    @property
    def newest_commit(self) -> int | None:
        return self.commits[0] if self.commits else None

    def describe(self) -> str:
        """``a finished run (300 steps, finished 2026-01-02 14:03, newest commit step 300)``."""
        facts = []
        if self.summary is not None:
            steps = self.summary.get("steps")
            when = f", finished {_when(self.finished_at)}" if self.finished_at else ""
            acc = self.summary.get("val_accuracy")
            facts.append((f"{steps} steps" if steps is not None else "a summary.json that does not read") + when
                         + (f", val accuracy {acc:.3f}" if isinstance(acc, float) else ""))
        if self.commits:
            facts.append(f"newest commit step {self.commits[0]} in {self.checkpoint_root}")
        elif self.summary is None:
            facts.append(f"no commit in {self.checkpoint_root}")
        if self.attempts:
            facts.append(f"{len(self.attempts)} attempt{'s' if len(self.attempts) != 1 else ''}")
        kind = "a finished run" if self.summary is not None else "an unfinished run (no summary.json)"
        return f"{kind}: {', '.join(facts)}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def inspect(cfg: TrainConfig) -> RunState:
    """What ``cfg.run.dir`` and the run's checkpoint root hold (read-only)."""
    run_dir = cfg.run.dir
    root = mf.checkpoint_root(cfg, run_dir)
    fs, path = io.filesystem(run_dir)
    fs.invalidate_cache(path)
    try:
        names = {e.rstrip("/").rsplit("/", 1)[-1]: e for e in fs.ls(path, detail=False)}
    except (FileNotFoundError, NotADirectoryError):
        names = {}
    present = [n for n in RUN_FILES if n in names] + [f"{n}/" for n in RUN_FOLDERS if n in names]
    commits = [step for step, uri in mf.list_steps(root) if mf.is_committed(uri)] if root else []
    summary, finished = None, None
    if SUMMARY in names:
        try:
            summary = json.loads(io.read_small(io.join(run_dir, SUMMARY)))
        except (ValueError, OSError):
            summary = {}  # a summary that does not parse still marks a finished run
        try:
            finished = fs.modified(f"{path.rstrip('/')}/{SUMMARY}").timestamp()
        except (NotImplementedError, OSError, AttributeError):
            finished = None
    ray_run = io.join(cfg.ray.storage_path, cfg.run.name) if cfg.ray.storage_path else None
    ray_run = ray_run if ray_run and io.exists(ray_run) else None
    return RunState(run_dir, root, present, commits, summary, attempt_numbers(run_dir), finished, ray_run)


def refusal(state: RunState, resume_hint: str) -> RunExistsError:
    """The message for a launch into a run directory that holds a run."""
    removes = ", ".join(state.present + ([f"the commits in {state.checkpoint_root}"]
                                          if state.commits and "checkpoints/" not in state.present else [])
                        + ([f"Ray Train's record {state.ray_run}"] if state.ray_run else []))
    return RunExistsError(
        f"run.dir = {state.run_dir!r} holds {state.describe()}. A new run there would replace it; either\n"
        f"  --resume          {resume_hint} (Python: train(cfg, resume=True))\n"
        f"  a fresh run.dir   e.g. --set run.dir={state.run_dir.rstrip('/')}-2\n"
        f"  --overwrite       replace it, removing dutycycle's files there ({removes}) (Python: overwrite=True)")


# ---------------------------------------------------------------------------------------------- the attempt


@dataclass
class Attempt:
    """One launch's folder in its run directory (``attempts/<number>``), claimed by ``prepare``."""

    run_dir: str
    number: int
    launched: float
    created_run_dir: bool  # the run directory did not exist before this launch
    resumed_from: int | None = None  # the newest commit when the launch resumed
    changes: dict = field(default_factory=dict)
    # dutycycle's entries of the run directory before this launch ("ray/", "attempts/", ...): a failed launch
    # removes those it added (Ray Train's storage, the attempts folder) and leaves these
    before: frozenset[str] = frozenset()

    @property
    def dir(self) -> str:
        return io.join(self.run_dir, ATTEMPTS, str(self.number))

    def config_uri(self) -> str:
        return io.join(self.dir, CONFIG_FILE)

    def trained(self) -> bool:
        """Whether this launch's Trainer wrote a row into ``metrics.jsonl`` (it reached the restore that opens
        an attempt's rows)."""
        try:
            rows = read_metrics(self.run_dir, live=True)
        except (OSError, ValueError):
            return True  # unreadable: keep everything for a person to look at
        return any(float(r.get("time", 0.0)) >= self.launched for r in rows)

    def discard_if_untrained(self) -> bool:
        """After a failed launch: when it never trained, remove what it wrote (its attempt folder; the whole run
        directory when the launch created it). Returns whether it removed anything."""
        if self.trained():
            return False
        if self.created_run_dir:
            targets = [self.run_dir]
        else:
            added = [f"{n}/" for n in RUN_FOLDERS] + list(RUN_FILES)
            targets = [self.dir] + [io.join(self.run_dir, n.rstrip("/")) for n in added if n not in self.before]
        for target in targets:
            fs, path = io.filesystem(target)
            try:
                fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
        return True

    def finish(self) -> None:
        """After the attempt finished: its config becomes the run's (``RUN_DIR/config.json``), beside the
        summary and model it just wrote; its record says when it finished (``finished_at``: a later launch
        that resumes after one without it resumed after a failure, as the model card counts them)."""
        io.write_bytes_atomic(io.join(self.run_dir, CONFIG_FILE), io.read_small(self.config_uri()))
        uri = io.join(self.dir, ATTEMPT_FILE)
        try:
            record = json.loads(io.read_small(uri))
        except (OSError, ValueError):
            record = formats.stamp({"attempt": self.number, "launched": self.launched})
        io.write_json_atomic(uri, {**record, "finished_at": time.time()})


def _claim(cfg: TrainConfig, state: RunState, record: dict, created: bool) -> Attempt:
    """Take the next attempt number: its ``config.json`` is created only if absent, so two launches racing
    into one directory cannot share a number; the loser is refused."""
    number = max(state.attempts, default=0) + 1
    attempt = Attempt(cfg.run.dir, number, record["launched"], created, record.get("resumed_from"),
                      record.get("changes") or {}, frozenset(state.present))
    data = json.dumps(formats.stamp(cfg.to_dict()), indent=2, sort_keys=True).encode()
    if not io.create_exclusive(attempt.config_uri(), data):
        raise ConfigError(f"another launch took attempt {number} of run.dir = {cfg.run.dir!r} a moment ago; two "
                          "launches cannot train one run: wait for it, or use another run.dir")
    io.write_json_atomic(io.join(attempt.dir, ATTEMPT_FILE), formats.stamp({"attempt": number, **record}))
    return attempt


def rejoin(cfg: TrainConfig) -> Attempt:
    """The newest attempt of ``cfg.run.dir``, for a launcher's restart of its own launch (torchrun's
    ``--max-restarts``): no new claim, no checks; the Trainer resumes from the newest commit."""
    numbers = attempt_numbers(cfg.run.dir)
    if not numbers:
        raise ConfigError(f"a restarted launch found no attempt folder in run.dir = {cfg.run.dir!r}; start it anew")
    attempt = Attempt(cfg.run.dir, numbers[-1], time.time(), created_run_dir=False,
                      before=frozenset(inspect(cfg).present))
    try:  # the launch began with its first try: rows since then are this attempt's
        attempt.launched = float(json.loads(io.read_small(io.join(attempt.dir, ATTEMPT_FILE)))["launched"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return attempt


# ------------------------------------------------------------------------------------------------- prepare


def prepare(cfg: TrainConfig, inputs: Inputs, *, resume: bool = False, overwrite: bool = False,
            force: bool = False, say=print) -> Attempt:
    """Decide what this launch does with ``cfg.run.dir`` and claim its attempt folder (see the module doc).
    ``inputs``: what the driver's checks learned of the data (its fingerprint, the run's length). ``say``: where
    the one-line notes go (a resume's changes, what --overwrite removed); None for none."""
    launched = time.time()
    if resume and overwrite:
        raise ConfigError("--resume continues the run in run.dir and --overwrite replaces it: pass one of them")
    if force and not resume:
        raise ConfigError("--force accepts data changes on a --resume; without --resume it does nothing")
    if resume and cfg.checkpoint.resume == "none":
        raise ConfigError('--resume with checkpoint.resume = "none" asks to continue and to start fresh; drop one')
    state = inspect(cfg)
    created = not io.exists(cfg.run.dir)
    record: dict = {"launched": launched, "resume": resume, "overwrite": overwrite, "force": force}
    if state.holds_run and overwrite:
        removed = remove_run(state)
        if say:
            say(f"--overwrite: removed the previous run's {', '.join(removed)} from {cfg.run.dir}")
        state = inspect(cfg)
    elif state.holds_run and not resume:
        hint = (f"continue it from step {state.newest_commit}, e.g. with a larger run.max_steps"
                if state.commits else "impossible here: it has no commit to continue from")
        raise refusal(state, hint)
    elif resume and state.holds_run:
        record.update(_resume(cfg, state, inputs, force=force, say=say))
    elif resume and say:
        say(f"--resume: run.dir = {cfg.run.dir!r} holds no run yet; starting one")
    return _claim(cfg, state, record, created)


def _resume(cfg: TrainConfig, state: RunState, inputs: Inputs, *, force: bool, say) -> dict:
    """Check a resume of the run in ``state`` with ``cfg``: something to continue from, something left to train,
    and what the config changes (changes.py); returns what the attempt records."""
    where = state.run_dir
    step = state.newest_commit
    if cfg.checkpoint.resume not in ("auto", "none"):
        step = mf.parse_step(cfg.checkpoint.resume)
    if step is None:
        raise ConfigError(
            f"--resume: run.dir = {where!r} holds {state.describe()}, and no commit to continue from "
            f"(checkpoint.every = {cfg.checkpoint.every}; commits are looked for in {state.checkpoint_root}): "
            "a resume would start over from step 0. Use --overwrite to start over, or a fresh run.dir")
    old, saved = _trained_with(state, step)
    keep_run_partitions(cfg, old)  # data.partitions at its default: the run's own count (a plan input)
    changes = ch.compare(old, cfg.to_dict(), old_fingerprint=(saved.get("data") or {}).get("fingerprint", ""),
                         new_fingerprint=inputs.fingerprint)
    ch.check_resume(changes, force=force, where=where)
    total = inputs.total_steps(cfg)
    if total is not None and step >= total:
        raise ConfigError(
            f"--resume: the run in {where!r} has trained {step} steps, and this config's run "
            f"({'run.max_steps' if cfg.run.max_steps else 'run.epochs'}) ends at step {total}: nothing is left to "
            "train. Raise run.max_steps (or run.epochs) to continue it, e.g. "
            f"--set run.max_steps={max(step * 2, step + 1)}")
    if force and changes.data:
        cfg.checkpoint.force_loader_state = True  # the loader continues this config's own plan
    if say:
        old_total = (saved.get("schedule") or {}).get("total_steps")
        note = ch.schedule_note(changes, step=step, old_total=old_total, new_total=total,
                                old_optim=_optim(old, cfg), new_optim=cfg.optim)
        forced = "; --force: continuing with the changed data" if force and changes.data else ""
        say(f"resuming {where} from step {step}; changed: {changes.line()}" + (f" ({note})" if note else "")
            + forced)
    return {"resumed_from": step, "changes": changes.to_dict()}


def _trained_with(state: RunState, step: int) -> tuple[dict, dict]:
    """The config the run was trained with (its newest attempt's, else the commit's) and the commit's trainer
    state (its data fingerprint and schedule; empty when it cannot be read)."""
    saved: dict = {}
    uri = io.join(state.checkpoint_root, mf.step_name(step), mf.TRAINER_STATE)
    try:
        got = mf.read_json_bounded(uri)
        saved = got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        pass  # the workers verify the commit; here it only says what changed
    config_uri = run_config_uri(state.run_dir)
    if config_uri is not None:
        try:
            tree = json.loads(io.read_small(config_uri))
            return {k: v for k, v in tree.items() if k != formats.KEY}, saved
        except (ValueError, OSError) as e:
            raise SourceError(f"--resume: the run's config {config_uri} cannot be read ({e}); pass --overwrite "
                              "to start over, or a fresh run.dir") from None
    return dict(saved.get("config") or {}), saved


def _optim(tree: dict, cfg: TrainConfig):
    """The optimizer section of an old config tree (for the learning rate it had); this config's when it
    cannot be built."""
    try:
        return from_dict({"optim": tree.get("optim", {}), "data": {"source": "synthetic"}}).optim
    except (ConfigError, TypeError):
        return cfg.optim


def remove_run(state: RunState) -> list[str]:
    """Remove dutycycle's files from a run directory and the commits at its checkpoint root (``--overwrite``);
    returns what went. Anything else in the folder stays."""
    removed = []
    for name in state.present:
        uri = io.join(state.run_dir, name.rstrip("/"))
        fs, path = io.filesystem(uri)
        try:
            fs.rm(path, recursive=name.endswith("/"))
            removed.append(name)
        except FileNotFoundError:
            pass
    if state.ray_run:  # Ray Train's pointers to the commits removed here (ray.storage_path/run.name)
        fs, path = io.filesystem(state.ray_run)
        fs.rm(path, recursive=True)
        removed.append(f"Ray Train's record {state.ray_run}")
    if state.commits and mf.list_steps(state.checkpoint_root):
        for _, uri in mf.list_steps(state.checkpoint_root):
            mf.remove(uri)  # manifest first: an interrupted removal leaves no half commit
        removed.append(f"commits in {state.checkpoint_root}")
    return removed


def storage_of(cfg: TrainConfig) -> str:
    """Ray Train's storage for the run (``ray.storage_path``, else ``RUN_DIR/ray``), as an absolute location."""
    storage = cfg.ray.storage_path or io.join(cfg.run.dir, "ray")
    return os.path.abspath(storage) if io.protocol(storage) == "file" else storage
