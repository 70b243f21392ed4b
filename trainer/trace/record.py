"""Reading what a run records for its trace: one record per Trainer start (written by step/provenance.py).

A start's record (``provenance.start_record``) is written in the ``attempt`` row every Trainer start writes into
``metrics.jsonl`` (step.trainer.Trainer._restore), under ``"trace"``. It holds what the steps of that start were
planned from, as the start itself resolved it: the loader's state right after the restore (its position, the next
global batch, and every input of the plan: split, fingerprint, sample count, seed, global batch size, drop_last,
shuffle, blocks, window, partitions), the world size, the data-parallel ranks (under tensor parallelism a group
of ranks reads one share), the micro-batches each rank's share was cut into, the launch (attempt) number, and
where the data came from (cache, table). A start trains the steps after the one it restored, until the next
start's row (a resume keeps the rows up to its commit and drops the lost ones: metrics.py), so the starts read
in file order cover every step of the run once, whatever world size each ran at.

The batches skipped after a non-finite loss (``checkpoint.on_nonfinite = "skip"``) are read from the newest
commit and the summary: a step trains the next global batch that was never skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dutycycle.engine import formats, io
from dutycycle.engine.errors import SourceError
from dutycycle.loader.state import PLAN_FIELDS
from dutycycle.trainer.checkpoint import manifest as mf
from dutycycle.trainer.config import from_dict, run_config_uri
from dutycycle.trainer.step.metrics import SUMMARY, read_metrics
from dutycycle.trainer.step.provenance import RECORD_VERSION


@dataclass
class Start:
    """One Trainer start: it trained steps ``first + 1 ..`` until the next start (``last``, inclusive)."""

    first: int  # the step it restored (0: a fresh start)
    last: int  # its last step in the run's record (the next start's ``first``, or the run's last step)
    attempt: int
    world_size: int
    data_world: int
    data_groups: list | None
    micro_batches: int
    loader: dict  # the loader state after the restore: position and plan inputs
    data: dict
    started: float = 0.0  # wall clock of the start (its row's ``loop_started``)

    @property
    def epoch(self) -> int:
        return int(self.loader["epoch"])

    @property
    def batch(self) -> int:
        """The global batch (in ``epoch``) its first step took, skipped batches aside."""
        return int(self.loader["step"])

    @property
    def plan(self) -> dict:
        return {k: self.loader[k] for k in PLAN_FIELDS if k in self.loader}

    def ranks_of(self, data_rank: int) -> list[int]:
        """The global ranks that trained data-parallel rank ``data_rank``'s share."""
        return list(self.data_groups[data_rank]) if self.data_groups else [data_rank]


@dataclass
class RunRecord:
    """What a run directory says about its steps: the starts, the last step, the skipped batches, the config."""

    run_dir: str
    starts: list[Start]
    last_step: int
    skipped: set = field(default_factory=set)  # {(epoch, global batch)}
    config: object = None  # the run's TrainConfig (its newest attempt's), or None

    @property
    def data(self) -> dict:
        return self.starts[-1].data if self.starts else {}


def read_run(run_dir: str) -> RunRecord:
    """The run's starts, last step and skipped batches from its records (``metrics.jsonl``'s attempt rows, the
    summary, the newest commit), with a ``SourceError`` naming what is missing."""
    try:
        rows = read_metrics(run_dir, live=True)
    except (OSError, ValueError) as e:
        raise SourceError(f"run {run_dir!r}: its metrics.jsonl cannot be read ({e}); trace needs a run directory "
                          "written by `dutycycle train`") from None
    attempts = [r for r in rows if r.get("event") == "attempt"]
    if not attempts:
        raise SourceError(f"run {run_dir!r} has no training record (no attempt row in metrics.jsonl); trace needs a "
                          "run directory that trained at least one step")
    old = [r for r in attempts if not isinstance(r.get("trace"), dict)]
    if old:
        raise SourceError(f"run {run_dir!r} was trained by a dutycycle that did not record its plan per start (its "
                          f"attempt row of step {old[0].get('step')} has no trace record); trace works on runs "
                          "trained from this release on")
    bad = [r for r in attempts if r["trace"].get("version") != RECORD_VERSION]
    if bad:
        raise SourceError(f"run {run_dir!r}: its trace record version {bad[0]['trace'].get('version')!r} is not "
                          f"{RECORD_VERSION}, the one this dutycycle reads; trace it with the release that trained it")
    summary = _summary(run_dir)
    # the newest step the run trained: its summary's, or a later row's (a resume still training past a summary)
    done = int(summary["steps"]) if summary and isinstance(summary.get("steps"), int) else 0
    last = max(done, max((int(r.get("step", 0)) for r in rows), default=0))
    starts = []
    for i, r in enumerate(attempts):
        t = r["trace"]
        end = int(attempts[i + 1]["step"]) if i + 1 < len(attempts) else last
        starts.append(Start(first=int(r["step"]), last=end, attempt=int(t["attempt"]), world_size=int(t["world_size"]),
                            data_world=int(t["data_world"]), data_groups=t.get("data_groups"),
                            micro_batches=int(t["micro_batches"]), loader=dict(t["loader"]),
                            data=dict(t.get("data") or {}), started=float(r.get("loop_started", 0.0))))
    config = _config(run_dir)
    skipped = {tuple(x) for x in (summary or {}).get("checkpoint", {}).get("skipped_batches", [])}
    skipped |= _committed_skips(run_dir, config)
    return RunRecord(run_dir, starts, last, skipped, config)


def _summary(run_dir: str) -> dict | None:
    try:
        return json.loads(io.read_small(io.join(run_dir, SUMMARY)))
    except (OSError, ValueError):
        return None


def _config(run_dir: str):
    uri = run_config_uri(run_dir)
    if uri is None:
        return None
    try:
        tree = json.loads(io.read_small(uri))
        return from_dict({k: v for k, v in tree.items() if k != formats.KEY})
    except (OSError, ValueError):
        return None


def _committed_skips(run_dir: str, config) -> set:
    """The skipped batches the newest commit records (a run still training, or one stopped before its summary)."""
    root = mf.checkpoint_root(config, run_dir) if config is not None else io.join(run_dir, "checkpoints")
    for _, uri in mf.list_steps(root) if root and io.exists(root) else []:
        if not mf.is_committed(uri):
            continue
        try:
            state = mf.read_json_bounded(io.join(uri, mf.TRAINER_STATE))
        except (OSError, ValueError):
            return set()
        return {tuple(x) for x in (state.get("skipped") or [])} if isinstance(state, dict) else set()
    return set()
