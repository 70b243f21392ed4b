"""Remedies as config changes with a predicted rate from the measured components, and ``--verify`` running the top
one: the models checked by hand, then a real short run that measures what the checkpoint remedy gives."""

from __future__ import annotations

import pytest
from dutycycle.trainer.config import load_config
from dutycycle.trainer.diagnose import diagnose
from dutycycle.trainer.diagnose.remedies import checkpoint_remedy, comm_remedy, data_remedy, remedies


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
    # checkpoint: a 1 s synchronous stall every 4 steps of 0.5 s becomes 0.1 s
    f = {"end_to_end": _e2e("cache", 200.0, 0.5), "checkpoint": {
        "configured_every": 4, "configured_async": False, "sync": {"stall_s_per_save": 1.0},
        "async": {"stall_s_per_save": 0.1}}}
    assert checkpoint_remedy(f)["predicted_samples_per_s"] == pytest.approx(100 / (0.5 - 0.9 / 4))
    f["checkpoint"]["configured_async"] = True  # never a remedy the run already uses
    assert checkpoint_remedy(f) is None


def test_the_verdict_s_remedy_comes_first():
    f = {"end_to_end": _e2e("raw", 100.0, 0.32, wait=0.4), "loader": {"cache": 1e4},
         "checkpoint": {"configured_every": 4, "configured_async": False, "sync": {"stall_s_per_save": 1.0},
                        "async": {"stall_s_per_save": 0.1}}}
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
