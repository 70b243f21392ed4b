"""Findings: each experiment's result read back from its process's JSON against its schema, a wrong key named."""

from __future__ import annotations

import json

import pytest
from dutycycle.trainer.diagnose.experiments import EXPERIMENTS
from dutycycle.trainer.diagnose.findings import (
    FINDINGS,
    CheckpointFinding,
    FindingError,
    LoaderFinding,
    NotApplicable,
    ScalingFinding,
    from_dict,
    read,
    to_dict,
)


def _run(**extra):
    return {"workers": 2, "samples_per_s": 100.0, "step_s": 0.1, "data_wait_share": 0.0, "comm_share": 0.3,
            "checkpoint_share": 0.0, "intervals": {"comm_share": [0.2, 0.4]}, "per_step": {"step_s": [0.1]},
            "bytes_per_step": 1e6, "inter_node_bytes_per_step": 0.0, "comm_exposed_measured": 0.03, "launch_s": 2.0,
            "held_per_rank": [], "summary": {"steps": 8}, **extra}


def _scaling(**extra):
    return {"workers": 2, "zero_stage": 2, "replicate": 1, "tensor": 1, "quant_grads": "none", "quant_block": 256,
            "one": _run(workers=1), "many": _run(), "speedup": 1.2, "efficiency": 0.6, **extra}


def test_every_experiment_has_a_schema():
    assert set(FINDINGS) == {key for key, _, _ in EXPERIMENTS}


def test_a_finding_goes_through_json_unchanged_and_typed():
    data = _scaling(quantized=_run(zero_stage=2, settings=["parallel.quant_grads=int8"], speedup=1.5))
    finding = read("scaling", json.loads(json.dumps(data)))
    assert isinstance(finding, ScalingFinding) and finding.many.comm_share == 0.3
    assert finding.quantized.settings == ["parallel.quant_grads=int8"]
    assert to_dict(finding) == data


def test_an_optional_part_absent_stays_absent():
    finding = read("scaling", _scaling())
    assert finding.quantized is None and "quantized" not in to_dict(finding)
    loader = from_dict(LoaderFinding, {"global_batch_size": 16, "intervals": {}, "slow_ms": 0.0, "cache": 900.0})
    assert to_dict(loader) == {"global_batch_size": 16, "intervals": {}, "slow_ms": 0.0, "cache": 900.0}


def test_a_missing_or_extra_key_is_named_with_where_it_is():
    bad = _scaling()
    del bad["many"]["step_s"]
    with pytest.raises(FindingError, match=r"scaling.many: missing key\(s\) step_s for RunFinding"):
        read("scaling", bad)
    with pytest.raises(FindingError, match=r"scaling: unexpected key\(s\) speedupp for ScalingFinding"):
        read("scaling", {**_scaling(), "speedupp": 1.0})
    with pytest.raises(FindingError, match=r"scaling.one: expected an object"):
        read("scaling", {**_scaling(), "one": 3})


def test_a_key_that_is_a_python_keyword_keeps_its_name():
    save = _run(stall_s_per_save=0.2, saves=4, stall_interval=[0.1, 0.3])
    data = {"configured_every": 4, "configured_async": False, "every": 2, "sync": save, "async": save}
    finding = from_dict(CheckpointFinding, data)
    assert finding.async_.stall_s_per_save == 0.2 and to_dict(finding) == data


def test_an_experiment_that_does_not_apply_says_why():
    finding = read("h2d", {"applicable": False, "why": "a CPU run has no host-to-device copy"})
    assert finding == NotApplicable("a CPU run has no host-to-device copy")
    assert to_dict(finding) == {"why": "a CPU run has no host-to-device copy", "applicable": False}
