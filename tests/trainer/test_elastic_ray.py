"""Elastic training on Ray Train end to end: a local 3-node cluster (a 0-CPU head holding the driver and
Ray Train's controller, three 1-CPU worker nodes), float64, ZeRO stage 3, ``parallel.num_workers = [2, 3]``. A
worker node is killed (its raylet and worker, no drain: the cluster and the moves of ``dutycycle demo --elastic``)
once the run has committed step 10 and trained step 12 (mid-epoch: 40 steps per epoch), restored from the
survivors' peer memory (a copy every 2 steps, on the rank's own node and the next),
the run continues at 2 workers, the node returns and the run grows back to 3. Its per-step losses equal an
uninterrupted run at a fixed 3 workers (spawned gloo ranks, no Ray) within 1e-9 relative: only the summation
order of the gradient reduction differs between 2 and 3 ranks (each rank's share of the same global batch), so
the float64 losses agree to a few ulps (4e-16 in the trial; 1e-9 leaves room for the rounding to compound over 60
steps of Adam without hiding any change of samples or state, which moves the loss by far more than 1e-3).

The run's own record is checked too: every sample of the epoch trained exactly once and each step on the same
samples as the fixed-size run (the per-sample log), a ``resize`` row per size change (3 -> 2 at the state restored, then
2 -> 3), the world size on every attempt row, the time account's parts of each resize, and the time from the
node's removal to the first step at 2 workers (the issue's target: under 30 s; asserted below 60 s here, where
seven engineers share two cores; the figure is printed for the report).

Stage 3 and stage 3 with int8 gradients and error feedback are two tests, each its own Ray run; the quantized one
is marked ``long`` (``./run.sh test-all``; CI runs the stage-3 one: the two together took 241 s on a slow 2-core
machine).

The Ray run is a script of its own (tests/support/elastic_run.py): the session's ``ray_cluster`` fixture owns this
process's Ray, and ``Cluster.add_node`` works only from a main thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..support.harness import run_distributed

pytestmark = pytest.mark.ray

# a constant learning rate (no warm-up): run.max_steps does not change the schedule, so the quantized run's replay
# below can stop each phase at the step where the Ray run changed size
SETTINGS = ["data.source=synthetic", "data.size=16", "data.global_batch_size=12", "data.synthetic_samples=480",
            "model.width=8", "run.max_steps=60", "run.eval_every=0", "run.log_every=0", "checkpoint.every=2",
            "checkpoint.shared_fs=true", "run.report=false", "run.precision=fp64", "parallel.zero_stage=3",
            "parallel.threads_per_worker=1", "run.health_check=false", "optim.schedule=constant",
            "optim.warmup_steps=0"]
QUANT = ["parallel.quant_grads=int8", "parallel.error_feedback=true"]
# storage commits every 10 steps, peer memory every 2: the node is lost after the commit of step 10 and step 12
# (tests/support/elastic_run.py), so each resize restores the survivors' memory, newer than storage, and redoes at
# most 2 steps; the lost node's ranks' parts come from the copies on the other nodes
ELASTIC = ["parallel.num_workers=[2,3]", "data.slow_ms=250", "checkpoint.every=10", "checkpoint.memory_every=2"]


def _train(rank, world, run_dir, extra):
    """A rank of a run on spawned gloo ranks (no Ray): every step's loss (rank 0's metrics rows)."""
    from dutycycle.trainer.config import load_config
    from dutycycle.trainer.step.loop import WorkerContext, set_threads
    from dutycycle.trainer.step.trainer import Trainer
    from dutycycle.trainer.trace.losses import read_sample_losses

    cfg = load_config(None, [*SETTINGS, *extra, f"parallel.num_workers={world}", f"run.dir={run_dir}",
                             "run.record_sample_loss=true"])
    set_threads(cfg, world)
    with Trainer(cfg, WorkerContext(rank=rank, world_size=world, run_dir=run_dir)) as trainer:
        trainer.train()
    if rank:
        return None
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {"losses": {r["step"]: r["loss"] for r in rows if "loss" in r},
            "samples": _per_step(read_sample_losses(run_dir).to_pydict())}


def _per_step(samples: dict) -> dict[int, list]:
    """Each step's sample ids in the global batch's order (rank by rank, each rank's share in order)."""
    out: dict[int, list] = {}
    for step, _rank, _pos, sid in sorted(zip(samples["step"], samples["rank"], samples["position"],
                                           samples["sample_id"], strict=True)):
        out.setdefault(int(step), []).append(sid)
    return out


def _check_run(run: dict) -> tuple[list[dict], list[dict], dict]:
    """The record every elastic run must show: sizes 3, 2, 3 with a resize row per change, mid-epoch, each
    resize's parts adding up to its total, every step once. Returns its attempts, resizes and step losses."""
    assert "error" not in run and run["report_error"] is None, (run.get("error"), run.get("report_error"))
    assert {"removed", "shrunk_seen", "added"} <= set(run["events"]), run["events"]
    rows, launch = run["rows"], run["summary"]["launch"]
    attempts = [r for r in rows if r.get("event") == "attempt"]
    assert [a["world_size"] for a in attempts] == [3, 2, 3] == launch["world_sizes"]
    assert [a["nodes"] for a in attempts] == [3, 2, 3]  # the placement re-observed at every start
    resizes = [r for r in rows if r.get("event") == "resize"]
    assert [(r["from"], r["to"], r["kind"]) for r in resizes] == [(3, 2, "shrink"), (2, 3, "grow")]
    assert [r["step"] for r in resizes] == [a["step"] for a in attempts[1:]]
    assert 0 < resizes[0]["step"] < resizes[1]["step"] < 40  # both inside the first epoch (40 steps)
    for r in resizes:
        assert r["total_s"] == pytest.approx(sum(r["seconds"].values()), rel=1e-9)
        assert r["seconds"]["restore"] > 0 and r["seconds"]["worker_start"] > 0 and 0 <= r["steps_redone"] <= 2
    restored = [r for r in rows if r.get("event") == "resume"]
    assert [(r["step"], r["source"]) for r in restored] == [(r["step"], "memory") for r in resizes], restored
    assert resizes[0]["stale_starts"] == 0  # the node watch told Ray Train's resource view in time
    assert launch["resize_s"] == pytest.approx(sum(r["total_s"] for r in resizes))
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == list(range(1, 61))
    # every sample of the first epoch (480 samples, 40 steps of 12) trained exactly once across the shrink and the
    # grow, and the second epoch's 20 steps on 240 distinct samples: the steps the lost node had trained after
    # the restored state were trained again by the smaller group and kept once (the newest start's rows)
    per_step = _per_step(run["samples"])
    assert sorted(per_step) == list(range(1, 61)) and all(len(v) == 12 for v in per_step.values())
    first = [sid for s in range(1, 41) for sid in per_step[s]]
    assert len(first) == len(set(first)) == 480
    second = [sid for s in range(41, 61) for sid in per_step[s]]
    assert len(second) == len(set(second)) == 240
    return attempts, resizes, losses, per_step


def _relative(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


def _elastic_and_fixed(tmp_path, runs: list) -> tuple[dict, dict, dict]:
    """The elastic Ray runs ``runs`` (one cluster, one after the other) and, meanwhile, the uninterrupted run at a
    fixed 3 workers. Returns the Ray script's results, the fixed run's losses and its per-step samples."""
    script = os.path.join(os.path.dirname(__file__), "..", "support", "elastic_run.py")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", DAFT_ANALYTICS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    with open(tmp_path / "ray.out", "w") as out, open(tmp_path / "ray.err", "w") as err:
        proc = subprocess.Popen([sys.executable, script, str(tmp_path), json.dumps(runs), "12"],
                                stdout=out, stderr=err, text=True, env=env)
    try:  # the fixed-size run meanwhile (the Ray run's workers mostly wait for their start)
        fixed_run = run_distributed(_train, 3, str(tmp_path / "fixed"), [], timeout=300)[0]
        # a spawned rank's result comes back as JSON: its step keys as text
        fixed = {int(k): v for k, v in fixed_run["losses"].items()}
        fixed_samples = {int(k): v for k, v in fixed_run["samples"].items()}
    finally:
        try:
            proc.wait(timeout=700)
        finally:
            proc.kill()
    stdout, stderr = (tmp_path / "ray.out").read_text(), (tmp_path / "ray.err").read_text()
    line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, stdout[-3000:] + stderr[-5000:]
    return json.loads(line[0][len("RESULT "):]), fixed, fixed_samples


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_loses_a_node_continues_on_two_grows_back_and_matches_the_fixed_size_run(tmp_path):
    result, fixed, fixed_samples = _elastic_and_fixed(tmp_path, [["s3", [*SETTINGS, *ELASTIC]]])

    # stage 3: each loss the uninterrupted fixed-size run's within 1e-9 relative
    attempts, resizes, losses, per_step = _check_run(result["s3"])
    assert per_step == fixed_samples  # step N trained the same samples, in the same order, at every size
    worst = _relative(losses, fixed)
    assert worst <= 1e-9, worst
    run = result["s3"]
    first_at_two = min(r["time"] for r in run["rows"] if "loss" in r and r["time"] > attempts[1]["loop_started"])
    to_next = first_at_two - run["events"]["removed"]
    print(f"\nelastic stage 3: node removed -> first step at 2 workers {to_next:.1f} s; shrink "
          + ", ".join(f"{k} {v:.2f}" for k, v in resizes[0]["seconds"].items())
          + f" (redone {resizes[0]['steps_redone']} steps, {resizes[0]['redone_s']:.2f} s); grow "
          + ", ".join(f"{k} {v:.2f}" for k, v in resizes[1]["seconds"].items())
          + f"; max relative loss difference {worst:.2e}")
    assert to_next < 60, (to_next, resizes[0])


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
def test_with_int8_gradients_and_error_feedback_it_matches_the_same_sizes_replayed(tmp_path):
    result, fixed, fixed_samples = _elastic_and_fixed(tmp_path, [["q8", [*SETTINGS, *QUANT, *ELASTIC]]])
    # stage 3 with int8 gradients and error feedback. Quantizing each rank's share of the gradient depends on
    # the world size (the blocks and their scales are per rank), so the steps trained at 2 workers differ from
    # the fixed-size run's by the quantization error itself, which is not the elastic machinery's to remove. The
    # bound the elastic run must meet is therefore the run that changes size at the same steps without Ray: 3
    # spawned gloo ranks to the first resize's commit, 2 from there to the second's, 3 to the end (each phase
    # resumed from the previous one's final commit; the schedule is constant, so stopping a phase early changes
    # nothing). Every step then runs the same quantization on the same shares, the error-feedback residuals
    # resharded by the same checkpoints: equal within the same 1e-9 as above (only Ray's placement differs).
    q_attempts, q_resizes, q_losses, q_per_step = _check_run(result["q8"])
    assert q_per_step == fixed_samples
    replay = str(tmp_path / "replay")
    s1, s2 = (r["step"] for r in q_resizes)
    run_distributed(_train, 3, replay, [*QUANT, f"run.max_steps={s1}"], timeout=300)
    run_distributed(_train, 2, replay, [*QUANT, f"run.max_steps={s2}"], timeout=300)
    replayed = {int(k): v for k, v in run_distributed(_train, 3, replay, QUANT, timeout=300)[0]["losses"].items()}
    q_worst = _relative(q_losses, replayed)
    off_fixed = _relative({s: q_losses[s] for s in fixed}, fixed)
    print(f"elastic int8 + error feedback: max relative loss difference {q_worst:.2e} against the same sizes "
          f"replayed on gloo; {off_fixed:.2e} against the unquantized fixed-size run")
    assert q_worst <= 1e-9, q_worst
    assert all(q_losses[s] == replayed[s] for s in range(1, s1 + 1))  # before any resize: the same run, bit for bit
