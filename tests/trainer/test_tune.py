"""``dutycycle tune``: the loop's decisions (keep, reject, stop) on recorded findings, the tuned config written as
TOML that loads back to the same config, then one tiny real tune end to end through the CLI."""

from __future__ import annotations

import json

import pytest
from dutycycle.trainer.config import load_config
from dutycycle.trainer.diagnose.tuned import to_toml, tuned_tree
from dutycycle.trainer.diagnose.tuning import baseline, candidates, judge, loop, merged, rate_interval

# ---------------------------------------------------------------------------------------- the decisions


def _run(rate: float, steps: list[float]) -> dict:
    """A short run's dict as experiments.short_run records it: ``rate`` over steps of these durations."""
    return {"samples_per_s": rate, "step_s": sum(steps) / len(steps), "per_step": {"step_s": steps}}


def _diagnosis(rate: float, spread: float, found: list[dict], configured: str = "cache") -> dict:
    """A round's diagnosis: the configured run at ``rate`` (steps of 32 samples, alternating by +-``spread``)."""
    step = 32 / rate
    steps = [step * (1 + spread * (-1) ** i) for i in range(20)]
    return {"findings": {"end_to_end": {"configured": configured, configured: _run(rate, steps)}},
            "verdict": {"headline": "recorded"}, "remedies": found, "budget_s": 60.0}


def _remedy(name: str, predicted: float, *sets: str) -> dict:
    return {"for": name, "set": list(sets), "predicted_samples_per_s": predicted, "from": "recorded"}


def _measured(remedy: dict, rate: float, lo: float, hi: float) -> dict:
    return {**remedy, "measured_samples_per_s": rate, "measured_interval": [lo, hi],
            "measured_over_predicted": rate / remedy["predicted_samples_per_s"]}


def test_the_rate_interval_comes_from_the_run_s_own_steps():
    steady = rate_interval(_run(320.0, [0.1] * 10))
    assert steady == pytest.approx([320.0, 320.0])
    noisy = _run(320.0, [0.08, 0.12] * 10)  # the same mean step, half of them 50% slower than the other half
    lo, hi = rate_interval(noisy)
    assert lo < 320.0 < hi and hi - lo > 10
    assert baseline({"end_to_end": {"configured": "raw", "raw": noisy}})["interval"] == [lo, hi]
    assert baseline({"end_to_end": {"error": "boom"}}) is None and baseline({}) is None


def test_a_remedy_is_tried_only_beyond_the_noise_and_the_largest_predicted_gain_first():
    base = {"samples_per_s": 100.0, "interval": [95.0, 105.0]}
    small = _remedy("checkpoint", 104.0, "checkpoint.async_save=true")  # inside the baseline's interval
    data = _remedy("data", 180.0, "data.source=cache")
    comm = _remedy("communication", 130.0, "parallel.quant_grads=int8", "parallel.zero_stage=2")
    ettr = {"for": "failures", "set": ["checkpoint.every=40"], "predicted_ettr": 0.99}
    go, passed = candidates([small, comm, data, ettr], base, set())
    assert [r["for"] for r in go] == ["data", "communication"]
    assert {p["remedy"]["for"]: p["why"] for p in passed}.keys() == {"checkpoint", "failures"}
    assert "within the noise" in next(p["why"] for p in passed if p["remedy"]["for"] == "checkpoint")
    # a remedy already run from this config is not offered again
    go, _ = candidates([small, comm, data], base, {("data.source=cache",)})
    assert [r["for"] for r in go] == ["communication"]
    # a layout that fits the memory budget comes before any rate: a run that does not fit has none to improve
    mem = {"for": "memory", "set": ["parallel.zero_stage=3"], "predicted_bytes_per_rank": 1e6}
    assert [r["for"] for r in candidates([data, mem], base, set())[0]] == ["memory", "data"]
    # a larger node is said, not verified: no setting of this run changes the machine
    node = {"for": "data", "set": [], "node": "a node with 4 cores", "predicted_samples_per_s": 300.0}
    go, passed = candidates([node, comm], base, set())
    assert [r["for"] for r in go] == ["communication"] and passed[0]["why"] == "not a setting: a node with 4 cores"


def test_a_change_is_kept_only_when_its_measured_interval_lies_above_the_baseline_s():
    base = {"samples_per_s": 100.0, "interval": [95.0, 105.0]}
    r = _remedy("data", 180.0, "data.source=cache")
    assert judge(_measured(r, 150.0, 140.0, 160.0), base) == (True, "+50%: its interval lies above the baseline's")
    keep, why = judge(_measured(r, 108.0, 104.0, 112.0), base)  # faster, but its interval reaches the baseline's
    assert not keep and "within the noise" in why
    keep, why = judge(_measured(r, 80.0, 75.0, 85.0), base)
    assert not keep and "slower" in why
    keep, why = judge({**r, "verify_error": "TimeoutError: stopped at its deadline"}, base)
    assert not keep and "TimeoutError" in why
    mem = {"for": "memory", "set": ["parallel.zero_stage=3"], "predicted_bytes_per_rank": 1e6}
    assert judge({**mem, "measured_bytes_per_rank": 0.9e6}, base, budget_bytes=1e6)[0]
    assert not judge({**mem, "measured_bytes_per_rank": 1.2e6}, base, budget_bytes=1e6)[0]
    assert merged(["parallel.zero_stage=2", "data.source=cache"], ["parallel.zero_stage=1"]) == [
        "parallel.zero_stage=1", "data.source=cache"]


class Recorded:
    """The measuring functions of the loop, answering from recorded figures: ``rounds`` maps the kept changes to
    that config's diagnosis, ``measured`` a remedy's settings to its measured (rate, low, high). Each call is
    logged, and each takes ``cost`` seconds of a budget of ``budget``."""

    def __init__(self, rounds: dict, measured: dict, budget: float = 1e9, cost: float = 10.0):
        self.rounds, self.measured, self.left, self.cost, self.calls = rounds, measured, budget, cost, []

    def diagnose(self, kept, k):
        self.calls.append(("diagnose", tuple(kept)))
        self.left -= self.cost
        return self.rounds[tuple(kept)]

    def verify(self, kept, remedy, diag, k):
        self.calls.append(("verify", tuple(remedy["set"])))
        self.left -= self.cost
        got = self.measured[tuple(remedy["set"])]
        return got if isinstance(got, dict) else _measured(remedy, *got)

    def run(self, **kw):
        return loop(self.diagnose, self.verify, lambda: self.left, min_round_s=5.0, say=lambda _: None, **kw)


DATA = _remedy("data", 300.0, "data.source=cache")
COMM = _remedy("communication", 150.0, "parallel.quant_grads=int8")
ASYNC = _remedy("checkpoint", 140.0, "checkpoint.async_save=true")


def test_the_loop_keeps_what_beats_the_noise_rediagnoses_and_stops_when_no_gain_exceeds_it():
    """Round 1: the cache (largest predicted gain) is kept; round 2 diagnoses the new config, whose int8 remedy
    is measured within the noise and not kept, so its async remedy is tried next from the same diagnosis and
    kept; round 3's only remedy predicts a gain inside the noise: stop."""
    rounds = {(): _diagnosis(100.0, 0.02, [COMM, DATA]),
              ("data.source=cache",): _diagnosis(250.0, 0.02, [_remedy("communication", 300.0,
                                                                       "parallel.quant_grads=int8"),
                                                               _remedy("checkpoint", 290.0,
                                                                       "checkpoint.async_save=true")]),
              ("data.source=cache", "checkpoint.async_save=true"): _diagnosis(
                  290.0, 0.02, [_remedy("communication", 290.5, "parallel.quant_grads=int8")])}
    measured = {("data.source=cache",): (245.0, 240.0, 252.0), ("parallel.quant_grads=int8",): (255.0, 248.0, 262.0),
                ("checkpoint.async_save=true",): (292.0, 285.0, 299.0)}
    rec = Recorded(rounds, measured)
    got = rec.run()
    assert rec.calls == [("diagnose", ()), ("verify", ("data.source=cache",)),
                         ("diagnose", ("data.source=cache",)), ("verify", ("parallel.quant_grads=int8",)),
                         ("verify", ("checkpoint.async_save=true",)),
                         ("diagnose", ("data.source=cache", "checkpoint.async_save=true"))]
    assert got["kept"] == ["data.source=cache", "checkpoint.async_save=true"]
    assert [(e["for"], e["kept"]) for e in got["experiments"]] == [("data", True), ("communication", False),
                                                                  ("checkpoint", True)]
    e = got["experiments"][1]  # each row: predicted, measured with its interval, the baseline, why
    assert e["predicted_samples_per_s"] == 300.0 and e["measured_interval"] == [248.0, 262.0]
    assert e["baseline"]["samples_per_s"] == 250.0 and "within the noise" in e["why"]
    assert got["stopped"] == "no remedy's predicted gain exceeds the noise"
    assert got["rounds"][-1]["passed_over"][0]["for"] == "communication"


def test_the_loop_stops_when_the_budget_or_the_experiment_limit_is_spent_or_nothing_beats_the_noise():
    rounds = {(): _diagnosis(100.0, 0.02, [DATA, COMM, ASYNC])}
    slower = {("data.source=cache",): (90.0, 85.0, 95.0), ("parallel.quant_grads=int8",): (101.0, 97.0, 105.0),
              ("checkpoint.async_save=true",): {**ASYNC, "verify_error": "Died: killed"}}
    # every remedy tried from the one diagnosis, none kept: never diagnosed again
    rec = Recorded(rounds, slower)
    got = rec.run()
    assert [c[0] for c in rec.calls] == ["diagnose", "verify", "verify", "verify"]
    assert got["kept"] == [] and "the ones tried did not beat it" in got["stopped"]
    assert "Died: killed" in got["experiments"][2]["why"]
    # a budget of three calls: the diagnosis and two verifications
    rec = Recorded(rounds, slower, budget=30.0, cost=10.0)
    got = rec.run()
    assert len(got["experiments"]) == 2 and got["stopped"] == "budget spent"
    # at the limit of experiments, a kept change is not diagnosed again
    rec = Recorded({(): _diagnosis(100.0, 0.02, [DATA])}, {("data.source=cache",): (245.0, 240.0, 252.0)})
    got = rec.run(max_experiments=1)
    assert [c[0] for c in rec.calls] == ["diagnose", "verify"] and got["kept"] == ["data.source=cache"]
    assert got["stopped"] == "1 experiments verified (the limit)"
    # no budget for even one diagnosis
    got = Recorded(rounds, slower, budget=1.0).run()
    assert got["rounds"] == [] and got["stopped"] == "budget spent before the first diagnosis"
    # interrupted in its second diagnosis (Ctrl-C): what was measured before stays in the caller's state
    rec = Recorded({(): _diagnosis(100.0, 0.02, [DATA])}, {("data.source=cache",): (245.0, 240.0, 252.0)})
    state: dict = {}
    with pytest.raises(KeyError):  # no recorded diagnosis for the kept config: the second round raises
        loop(rec.diagnose, rec.verify, lambda: 1e9, say=lambda _: None, state=state)
    assert state["kept"] == ["data.source=cache"] and len(state["experiments"]) == 1
    # a diagnosis without a training rate (its end-to-end run failed): nothing to compare against
    failed = {**rounds[()], "findings": {"end_to_end": {"error": "boom"}}}
    got = Recorded({(): failed}, slower).run()
    assert got["experiments"] == [] and "measured no training rate" in got["stopped"]
    # ... unless the configured layout does not fit: the layout that fits is tried, judged by its bytes
    mem = {"for": "memory", "set": ["parallel.zero_stage=3"], "predicted_bytes_per_rank": 1e6}
    over = {**failed, "remedies": [DATA, mem],
            "findings": {**failed["findings"], "memory": {"budget_bytes": 2e6}}}
    rec = Recorded({(): over, ("parallel.zero_stage=3",): failed},
                   {("parallel.zero_stage=3",): {**mem, "measured_bytes_per_rank": 1.1e6}})
    got = rec.run()
    assert got["kept"] == ["parallel.zero_stage=3"] and got["experiments"][0]["baseline"] is None
    assert got["rounds"][0]["passed_over"] == [{"for": "data", "set": ["data.source=cache"],
                                                "why": "the configured run measured no rate to compare it with"}]


def test_the_tuned_config_is_the_base_plus_the_kept_changes_and_loads_back(tmp_path):
    base = {"data": {"source": "raw", "table": 'a "quoted" path', "augment": {"flip": True, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}},
            "model": {"width": 8}, "optim": {"lr": 0.005}, "run": {"dir": str(tmp_path / "run")}}
    kept = ["data.source=cache", f"data.cache={tmp_path / 'cache'}", "checkpoint.async=true", "data.prefetch=8"]
    path = tmp_path / "tuned.toml"
    path.write_text(to_toml(tuned_tree(base, kept), ["tuned: data.source=cache"]))
    text = path.read_text()
    assert text.startswith("# tuned: data.source=cache\n") and "[data.augment]" in text
    want = load_config(None, kept, base=base)
    assert load_config(str(path)).to_dict() == want.to_dict()
    assert want.data.source == "cache" and want.checkpoint.async_save and want.data.prefetch == 8
    # the full resolved config written the same way loads back to itself too
    full = tmp_path / "full.toml"
    full.write_text(to_toml(want.to_dict()))
    assert load_config(str(full)).to_dict() == want.to_dict()


# ------------------------------------------------------------------------------------- one real tune, end to end


@pytest.mark.slow  # 15-20 s of CPU: three processes that import torch (the diagnosis's two experiments, the check)
def test_tune_cli_verifies_the_cache_remedy_keeps_it_and_writes_the_tuned_config(tmp_path, capsys):
    """A config that decodes large JPEGs in the training thread, beside a cache of the same table: the diagnosis
    (loader alone, end to end) predicts the cache's rate; tune verifies it by a short run, keeps it by the
    intervals, and writes a tuned config that ``load_config`` reads. One torch thread: with two on a busy 2-core
    machine single steps took 10 to 60 times the usual (seen), an interval no prediction could clear."""
    from dutycycle.engine import TransformSpec, materialize
    from dutycycle.trainer.app.cli import main

    from ..support.tablemaker import make_shapes_table

    table, _ = make_shapes_table(str(tmp_path / "t"), n=128, size=(448, 512))
    cache = materialize(table, str(tmp_path / "cache"), TransformSpec(size=16), runner="native").uri
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[data]\nsource = "raw"\ntable = "{table}"\ncache = "{cache}"\nsize = 16\n'
                   'loader_mode = "sync"\nglobal_batch_size = 32\neval_batch_size = 32\n[model]\nwidth = 8\n'
                   '[optim]\nwarmup_steps = 1\n[parallel]\nthreads_per_worker = 1\n'
                   f'[run]\ndir = "{tmp_path / "run"}"\nlog_every = 0\n')
    out = tmp_path / "tune"
    rc = main(["tune", str(cfg), "--budget-s", "60", "--out", str(out), "--only", "loader,end_to_end",
               "--max-experiments", "1"])
    printed = capsys.readouterr().out
    assert rc == 0
    got = json.loads((out / "tune.json").read_text())
    (e,) = got["experiments"]
    # the cache of the run's own table, by its path (sources.py: the one the loader experiment read)
    change = ["data.source=cache", f"data.cache={cache}"]
    assert e["for"] == "data" and e["set"] == change, e["set"]
    base = e["baseline"]  # the config as it was, measured again right before the change
    assert base["interval"][0] <= base["samples_per_s"] <= base["interval"][1]
    assert base != got["rounds"][0]["baseline"]  # not the diagnosis's run: a run of its own
    assert e["predicted_samples_per_s"] > got["rounds"][0]["baseline"]["interval"][1]  # why it was tried
    lo, hi = e["measured_interval"]
    assert lo <= e["measured_samples_per_s"] <= hi
    # decoding 448 px JPEGs per step against reading 16 px samples: far beyond the noise
    assert e["kept"] and lo > base["interval"][1], e
    assert got["kept"] == change and got["stopped"] == "1 experiments verified (the limit)"
    assert got["tuned"]["samples_per_s"] == e["measured_samples_per_s"]
    tuned = load_config(str(out / "tuned.toml"))
    want = load_config(str(cfg), change)
    assert tuned.to_dict() == want.to_dict()
    row = next(line for line in printed.splitlines() if line.startswith("1  "))
    assert "data.source=cache" in row and " yes " in row and "[tune] tuned config:" in printed
    assert (out / "rounds" / "1" / "diagnosis.json").exists()
    assert (out / "rounds" / "1" / "runs" / "verify-data").exists()


def test_a_second_tune_into_the_same_folder_replaces_the_first_and_bad_arguments_are_named(tmp_path, capsys):
    """With no time for a diagnosis nothing is measured, yet the files are written whole: the tuned config is the
    user's file plus the --set items given (here nothing kept), and an earlier tune's rounds are gone."""
    from dutycycle.trainer.app.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text('[data]\nsource = "synthetic"\nsize = 8\n[model]\nwidth = 8\n'
                   f'[run]\ndir = "{tmp_path / "run"}"\n')
    earlier = tmp_path / "run" / "tune" / "rounds" / "1" / "runs" / "verify-data"
    earlier.mkdir(parents=True)
    assert main(["tune", str(cfg), "--budget-s", "1", "--set", "model.depth=2"]) == 0
    out = tmp_path / "run" / "tune"
    got = json.loads((out / "tune.json").read_text())
    assert got["experiments"] == [] and got["stopped"] == "budget spent before the first diagnosis"
    assert not (out / "rounds").exists()
    tuned = load_config(str(out / "tuned.toml"))
    assert tuned.to_dict() == load_config(str(cfg), ["model.depth=2"]).to_dict()
    assert "no experiment was verified" in capsys.readouterr().out
    for bad in (["--budget-s", "0"], ["--max-experiments", "0"], ["--diagnose-s", "-1"], ["--only", "nope"]):
        assert main(["tune", str(cfg), *bad]) == 2, bad
    assert "--only nope: unknown experiment" in capsys.readouterr().err
