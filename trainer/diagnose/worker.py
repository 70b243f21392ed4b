"""One experiment of ``dutycycle diagnose`` in a process of its own:
``python -m dutycycle.trainer.diagnose.worker JOB.json``.

The job (written by run.py) names the function to call (``module:function``, called with the context and the
job's ``kwargs``), the config as a dict, the context's settings and the earlier experiments' results. The
function's finding (or its error) is written as JSON to the job's ``result`` path, renamed into place once
complete: an experiment killed at its deadline leaves no file, so nothing half-written is ever read.

Ray: the runner sets ``RAY_ADDRESS`` to the caller's cluster, so a Ray Train run here joins that cluster as a
driver of its own; when this process group is killed, Ray ends this driver's job and its actors by itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import traceback

from dutycycle.engine import io
from dutycycle.trainer.config import load_config

from .context import Context
from .experiments import short_run
from .findings import to_dict
from .remedies import verify as check_remedy


def context(job: dict) -> Context:
    """The experiment's context: the config rebuilt from its dict, the earlier experiments' results."""
    return Context(cfg=load_config(None, [], base=job["config"]), workdir=job["workdir"], seconds=job["seconds"],
                   steps=job["steps"], memory_budget_bytes=job["memory_budget_bytes"], scale=job["scale"],
                   results=job["results"])


def verify(ctx: Context, remedy: dict) -> dict:
    """``--verify``: the top remedy's settings as a short run, measured against its prediction."""
    return check_remedy(ctx, remedy, short_run)


def run(job: dict) -> dict:
    """``{"result": ...}`` with the function's finding as a dict, or ``{"error": ..., "traceback": ...}``."""
    module, name = job["call"].split(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        got = fn(context(job), **job.get("kwargs", {}))
    except Exception as e:  # noqa: BLE001 - the experiment's failure is its result; the runner reports it
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    return {"result": to_dict(got) if dataclasses.is_dataclass(got) else got}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        job = json.load(f)
    io.write_json_atomic(job["result"], run(job))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
