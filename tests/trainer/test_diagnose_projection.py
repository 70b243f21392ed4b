"""--scale N: every wait's share carried from the measured worker count to N, each by its stated model, and the
verdict drawn from the projected shares."""

from __future__ import annotations

import pytest
from dutycycle.trainer.diagnose.projection import factors, models, project
from dutycycle.trainer.diagnose.verdict import decide


def test_each_part_of_the_step_scales_by_its_model():
    f = factors(measured_at=2, comm_measured_at=2, workers=16, zero_stage=2)
    assert f["compute"] == f["data"] == f["checkpoint"] == pytest.approx(2 / 16)
    assert f["communication"] == pytest.approx((15 / 16) / (1 / 2))  # ring: (W-1)/W of the bytes per rank
    assert factors(measured_at=2, comm_measured_at=2, workers=16, zero_stage=0)["checkpoint"] == 1.0  # one copy
    assert factors(measured_at=1, comm_measured_at=1, workers=16, zero_stage=2)["communication"] is None
    assert "one worker" in models(1)["communication"] and "ring" in models(2)["communication"]


def test_shares_are_each_part_over_the_projected_step():
    shares = {"data": 0.1, "communication": 0.2, "checkpoint": 0.05, "failures": 0.01}
    iv = {k: [v * 0.9, v * 1.1] for k, v in shares.items()}
    out, out_iv = project(shares, iv, measured_at=2, comm_measured_at=2, workers=16, zero_stage=2)
    step = 0.65 / 8 + 0.1 / 8 + 0.2 * 1.875 + 0.05 / 8
    assert out["communication"] == pytest.approx(0.2 * 1.875 / step)
    assert out["data"] == pytest.approx(0.1 / 8 / step) and out["checkpoint"] == pytest.approx(0.05 / 8 / step)
    assert out["failures"] == 0.01  # modelled at N already
    assert out_iv["communication"] == pytest.approx([0.9 * out["communication"], 1.1 * out["communication"]])
    same, _ = project(shares, iv, measured_at=4, comm_measured_at=4, workers=4, zero_stage=2)
    assert same == pytest.approx(shares)


def test_a_run_compute_bound_at_two_workers_is_communication_bound_at_sixty_four():
    run = {"configured": "cache", "cache": {"samples_per_s": 1000.0, "step_s": 0.1, "data_wait_share": 0.01,
                                            "comm_share": 0.15, "checkpoint_share": 0.0, "workers": 2}}
    here = decide({"end_to_end": run}, {"quant_grads": "none", "workers": 2, "zero_stage": 2})
    assert here.kind == "compute-bound"
    there = decide({"end_to_end": run}, {"quant_grads": "none", "workers": 2, "zero_stage": 2, "scale": 64})
    assert there.kind == "communication-bound" and there.shares["communication"] > 0.5
    assert "projected from 2 to 64 workers" in there.headline
