"""Remedies as config changes with a predicted rate from the measured components, and ``--verify`` running the top
one: the models checked by hand, then a real short run that measures what the checkpoint remedy gives."""

from __future__ import annotations

import pytest
from dutycycle.trainer.config import load_config
from dutycycle.trainer.diagnose import diagnose
from dutycycle.trainer.diagnose.remedies import (
    checkpoint_remedy,
    comm_remedy,
    compute_remedy,
    data_remedy,
    remedies,
)


def _e2e(source, rate, step, wait=0.0, comm=0.0, workers=1):
    return {"configured": source, source: {"samples_per_s": rate, "step_s": step, "data_wait_share": wait,
                                           "comm_share": comm, "workers": workers}}


def test_each_remedy_predicts_from_its_measured_components():
    # raw: 40% of the step waits on decode; without the wait 100 -> 166.7, capped by the cache loader alone
    f = {"end_to_end": _e2e("raw", 100.0, 0.32, wait=0.4), "loader": {"cache": 150.0}}
    assert data_remedy(f)["predicted_samples_per_s"] == pytest.approx(150.0)
    f["loader"]["cache"] = 10_000.0
    assert data_remedy(f)["predicted_samples_per_s"] == pytest.approx(100 / 0.6)
    assert data_remedy({"end_to_end": _e2e("cache", 100.0, 0.32), "loader": {"cache": 1e4}}) is None
    # communication: half the step exchanging fp32; int8 sends (8 + 32/256)/32 of the bytes
    many = {"samples_per_s": 100.0, "step_s": 1.0, "comm_share": 0.5}
    f = {"end_to_end": _e2e("synthetic", 100.0, 1.0), "scaling": {"many": many, "quantized": {
        "settings": ["parallel.quant_grads=int8"], "zero_stage": 2}}}
    r = comm_remedy(f)
    assert r["predicted_samples_per_s"] == pytest.approx(100 / (0.5 + 0.5 * (8 + 0.125) / 32))
    assert r["set"] == ["parallel.quant_grads=int8", "parallel.zero_stage=2"]
    # checkpoint: the experiment's runs save every 2 steps; synchronous ones step in 1.0 s, asynchronous ones in
    # 0.55 s (stall and contention together): at a save every 4 steps the run's 0.5 s step loses 0.45 * 2 / 4
    f = {"end_to_end": _e2e("cache", 200.0, 0.5), "checkpoint": {
        "configured_every": 4, "configured_async": False, "every": 2,
        "sync": {"stall_s_per_save": 0.9, "step_s": 1.0}, "async": {"stall_s_per_save": 0.05, "step_s": 0.55}}}
    assert checkpoint_remedy(f)["predicted_samples_per_s"] == pytest.approx(100 / (0.5 - 0.45 * 2 / 4))
    f["checkpoint"]["configured_async"] = True  # never a remedy the run already uses
    assert checkpoint_remedy(f) is None


def test_workers_sharing_the_cores_are_told_the_rate_of_one_worker_with_them_all():
    # 2 workers at 900 samples/s end to end; the scaling experiment: one worker 1000, two 950 (efficiency 0.475)
    f = {"end_to_end": _e2e("cache", 900.0, 0.14, workers=2),
         "scaling": {"workers": 2, "efficiency": 0.475, "one": {"samples_per_s": 1000.0},
                     "many": {"samples_per_s": 950.0}}}
    r = compute_remedy(f)
    # one worker with nothing to shard or exchange: the layout of the scaling run the prediction comes from
    flat = ["parallel.zero_stage=0", "parallel.quant_grads=none", "parallel.quant_weights=none"]
    assert r["set"] == ["parallel.num_workers=1", *flat]
    assert r["predicted_samples_per_s"] == pytest.approx(900 * 1000 / 950)
    assert remedies(f, "compute-bound")[0]["for"] == "compute"
    f["scaling"]["efficiency"] = 0.9  # workers that scale: nothing to undo
    assert compute_remedy(f) is None


def test_a_remedy_for_a_hybrid_run_is_a_config_that_loads():
    """Under hybrid sharding (parallel.replicate = 2 of 4 workers) one worker has no replica groups: the remedy
    sets the layout back to flat, or the config it names would be refused."""
    from dutycycle.trainer.config import load_config

    base = ["data.source=synthetic", "parallel.num_workers=4", "parallel.zero_stage=3", "parallel.replicate=2"]
    f = {"end_to_end": _e2e("cache", 900.0, 0.14, workers=4),
         "scaling": {"workers": 4, "replicate": 2, "efficiency": 0.3, "one": {"samples_per_s": 1000.0},
                     "many": {"samples_per_s": 950.0}}}
    r = compute_remedy(f)
    assert r["set"][:2] == ["parallel.num_workers=1", "parallel.replicate=1"]
    assert load_config(None, base + r["set"]).parallel.replicate == 1


def test_the_verdict_s_remedy_comes_first():
    f = {"end_to_end": _e2e("raw", 100.0, 0.32, wait=0.4), "loader": {"cache": 1e4},
         "checkpoint": {"configured_every": 4, "configured_async": False, "every": 2,
                        "sync": {"stall_s_per_save": 1.0, "step_s": 0.8}, "async": {"stall_s_per_save": 0.1,
                                                                                   "step_s": 0.4}}}
    assert [r["for"] for r in remedies(f, "checkpoint-bound")] == ["checkpoint", "data"]
    assert [r["for"] for r in remedies(f, "data-bound")] == ["data", "checkpoint"]


def test_verify_runs_the_top_remedy_and_records_measured_against_predicted(tmp_path):
    cfg = load_config(None, ["data.source=synthetic", "data.size=8", "data.synthetic_samples=128",
                             "data.global_batch_size=16", "data.eval_batch_size=16", "model.width=8",
                             "optim.warmup_steps=1", "run.log_every=0", f"run.dir={tmp_path / 'run'}",
                             "checkpoint.every=2", "checkpoint.async_save=false"])
    out = diagnose(cfg, out=str(tmp_path / "d"), budget_s=120, only=["end_to_end", "checkpoint"], verify=True,
                   say=lambda _: None)
    top = out["remedies"][0]
    assert top["for"] == "checkpoint" and top["set"] == ["checkpoint.async_save=true"]
    assert top["predicted_samples_per_s"] > 0 and top["measured_samples_per_s"] > 0
    assert top["measured_over_predicted"] == pytest.approx(top["measured_samples_per_s"] /
                                                           top["predicted_samples_per_s"])
    page = (tmp_path / "d" / "diagnosis.html").read_text()
    assert "Remedies" in page and "--set checkpoint.async_save=true" in page


def test_the_memory_remedy_predicts_the_bytes_per_rank_and_verify_reads_what_the_ranks_held(tmp_path):
    """The stage that fits, with the model state per rank its formula gives; --verify runs that stage and reads
    the bytes its rank held. One worker here: every stage holds the same state, so the memory experiment's own
    row for the configured stage is the prediction a real run must meet (fp64, so the byte counts are exact)."""
    from dutycycle.trainer.diagnose.experiments import Context, short_run
    from dutycycle.trainer.diagnose.findings import to_dict
    from dutycycle.trainer.diagnose.layouts import memory
    from dutycycle.trainer.diagnose.remedies import memory_remedy, verify

    cfg = load_config(None, ["data.source=synthetic", "data.size=8", "data.synthetic_samples=64",
                             "data.global_batch_size=16", "model.width=8", "run.precision=fp64",
                             "parallel.zero_stage=2", f"run.dir={tmp_path / 'run'}", "run.log_every=0"])
    ctx = Context(cfg=cfg, workdir=str(tmp_path / "runs"), steps=3, memory_budget_bytes=10**9)
    mem = to_dict(memory(ctx))
    assert memory_remedy({"memory": mem}) is None  # it fits as configured: nothing to change
    mine = mem["configured"]
    # over a budget just below the configured stage's state, with the stage-2 row marked as the one that fits
    over = {**mem, "configured": {**mine, "fits": False},
            "rows": [{**r, "fits": r["zero_stage"] == 2 and not r["offload"]} for r in mem["rows"]]}
    r = memory_remedy({"memory": over})
    assert r["set"] == ["parallel.zero_stage=2"] and r["predicted_bytes_per_rank"] == mine["device_bytes"]
    got = verify(ctx, r, short_run)
    assert got["measured_over_predicted"] == pytest.approx(1.0, rel=0.01), got


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_memory_remedy_at_two_workers_is_verified_on_ray(ray_cluster, tmp_path):
    """Two workers on Ray Train, stage 0 over a budget of 0.8x its model state: the memory experiment names the
    least-communicating stage that fits, its formula predicts the bytes per rank, and --verify runs that stage on
    2 ranks and reads what the most loaded one held: within 1% (fp64; the CNN's rows divide by 2, so FSDP2 pads
    nothing; the step counters aside)."""
    from dutycycle.trainer.diagnose.experiments import Context, short_run
    from dutycycle.trainer.diagnose.findings import to_dict
    from dutycycle.trainer.diagnose.layouts import memory
    from dutycycle.trainer.diagnose.remedies import memory_remedy, verify

    cfg = load_config(None, ["data.source=synthetic", "data.size=8", "data.synthetic_samples=64",
                             "data.global_batch_size=16", "model.width=8", "run.precision=fp64",
                             "parallel.num_workers=2", "parallel.zero_stage=0", "parallel.cpus_per_worker=1",
                             f"run.dir={tmp_path / 'run'}", "run.log_every=0"])
    state = memory(Context(cfg=cfg, workdir=str(tmp_path / "probe"), steps=3)).configured["device_bytes"]
    ctx = Context(cfg=cfg, workdir=str(tmp_path / "runs"), steps=3, memory_budget_bytes=int(0.8 * state))
    r = memory_remedy({"memory": to_dict(memory(ctx))})
    assert r is not None and r["predicted_bytes_per_rank"] <= 0.8 * state, r
    assert any(s.startswith("parallel.zero_stage=") and s != "parallel.zero_stage=0" for s in r["set"]), r
    got = verify(ctx, r, short_run)
    assert got["measured_over_predicted"] == pytest.approx(1.0, rel=0.01), got
