"""Contention measured, not missed, and the whole gap explained: the verdict and the remedies on recorded
findings (pure functions), the OS's CPU accounting against a thread that spins, and the experiments reading the
run's own data source, never a cache a base config names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from dutycycle.trainer.config import load_config
from dutycycle.trainer.diagnose import cpu, decide
from dutycycle.trainer.diagnose.remedies import (
    data_remedy,
    decode_threads_remedy,
    layout_remedy,
    node_remedy,
    remedies,
)
from dutycycle.trainer.diagnose.sources import loader_sources, own_cache, table_of

# The issue's run, as recorded: one worker, data.source = raw, batch 128; 990 samples/s end to end against a
# compute ceiling of 2,254, 6% of the step waiting on the loader. The raw loader alone (all cores to itself)
# outpaces the ceiling, so the old approximation (1 - loader / ceiling) saw no data pressure: "compute-bound".
STEP = 128 / 990
ALONE = 128 / 2254
C = 0.94 * 1.05 / 2.05  # decoding's part of the step: 1.05 / 2.05 of its compute (94% of it) at a 105% slowdown


def _issue(contention: dict | None = None, loader_raw: float = 2600.0) -> dict:
    f = {"compute": {"samples_per_s": 2254.0, "interval": [2200.0, 2300.0]},
         "loader": {"raw": loader_raw, "in_ram": 40_000.0, "intervals": {"raw": [2500.0, 2700.0]},
                    "paths": {"table": "/data/table", "size": 32}},
         "end_to_end": {"configured": "raw", "raw": {
             "samples_per_s": 990.0, "step_s": STEP, "data_wait_share": 0.06, "comm_share": 0.0,
             "checkpoint_share": 0.0, "workers": 1,
             "intervals": {"data_wait_share": [0.05, 0.07], "comm_share": [0.0, 0.0],
                           "checkpoint_share": [0.0, 0.0]}}}}
    if contention is not None:
        f["contention"] = contention
    return f


def _contention(slowdown: float, loader_cores: float = 1.6, raw_threads: int = 4) -> dict:
    return {"source": "raw", "loader_mode": "auto", "raw_threads": raw_threads, "prefetch": 2, "workers": 1,
            "batch_per_worker": 128, "threads": 2, "cores": 2, "steps_alone": 20, "steps_beside": 10,
            "alone_step_s": ALONE, "beside_step_s": ALONE * (1 + slowdown), "slowdown": slowdown,
            "slowdown_interval": [slowdown - 0.1, slowdown + 0.1], "wait_s_per_batch": 0.008,
            "alone": {"step": 1.9, "loader": 0.0, "others": 0.05},
            "beside": {"step": 1.2, "loader": loader_cores, "others": 0.05, "loader_threads": 5,
                       "loader_processes": 0}}


def _step_parts(v) -> float:
    return sum(v.shares[k] for k in ("data", "communication", "checkpoint", "layout", "overhead", "unexplained")
               if k in v.shares)


def test_a_step_slowed_by_decoding_is_data_bound_with_the_cores_named():
    # decoding beside the step makes it 105% slower: of the run's compute (94% of its step, the rest waiting),
    # 1.05 / 2.05 is decoding's, 48% of the step; with the 6% wait, the 56% gap to the ceiling is explained but
    # for 2 points
    v = decide(_issue(_contention(1.05)))
    assert v.kind == "data-bound", v.headline
    assert "decoding takes 1.6 of 2 cores and slows each step by 105% (48% of the step)" in v.headline
    assert "6% of each step waits on the loader" in v.headline and "44% of its compute ceiling" in v.headline
    assert "dutycycle materialize" in v.fix and "data.raw_threads" in v.fix and "more cores" in v.fix
    gap = 1 - 990 / 2254
    assert v.gap["share"] == pytest.approx(gap)
    assert v.gap["parts"]["contention"] == pytest.approx(C)
    assert v.gap["parts"]["data_wait"] == pytest.approx(0.06)
    # the shares add up to the gap, with unexplained explicit
    assert v.shares["unexplained"] == pytest.approx(gap - 0.06 - C)
    assert _step_parts(v) == pytest.approx(gap)
    assert v.gap["parts"]["unexplained"] == pytest.approx(v.shares["unexplained"])
    # with the run's per-step compute recorded, the host work outside compute and waits is measured, not
    # unexplained: here 3 ms of each step (its compute 0.1185 s of the 0.1293 s step, beside the 6% wait);
    # decoding's part is of that compute
    f = _issue(_contention(1.05))
    own = 0.94 - 0.003 / STEP
    f["end_to_end"]["raw"]["per_step"] = {"step_s": [STEP] * 4, "comm": [0.0] * 4, "compute": [STEP * own] * 4}
    v = decide(f)
    assert v.shares["overhead"] == pytest.approx(0.003 / STEP)
    assert v.gap["parts"]["contention"] == pytest.approx(own * 1.05 / 2.05)
    assert v.shares["unexplained"] == pytest.approx(gap - 0.06 - own * 1.05 / 2.05 - 0.003 / STEP)
    assert _step_parts(v) == pytest.approx(gap) and v.kind == "data-bound"


def test_a_gap_the_waits_do_not_explain_is_said_so_with_what_was_measured():
    # the issue's run without the contention experiment: 6% waits of a 56% gap. Not "compute-bound, no wait
    # > 6%": it cannot explain the run, and says what it measured
    v = decide(_issue())
    assert v.kind == "unexplained", v.headline
    assert v.shares["unexplained"] == pytest.approx(1 - 990 / 2254 - 0.06)
    assert "44% of its compute ceiling of 2.3k" in v.headline and "50% of the 56% gap is unexplained" in v.headline
    assert "loader alone raw 2.6k, in_ram 40.0k samples/s" in v.headline
    assert "the step beside the loader was not measured" in v.headline
    assert _step_parts(v) == pytest.approx(1 - 990 / 2254)
    # a slowdown too small to account for the gap: still unexplained, with the loader's cores reported
    v = decide(_issue(_contention(0.1, loader_cores=0.3)))
    assert v.kind == "unexplained" and "the step +10% beside the loader, whose threads took 0.3 of 2 cores" \
        in v.headline, v.headline
    assert "other processes took 0.1 of 2 cores while the step ran" in v.headline
    # unexplained beyond a quarter of the gap only beyond its noise: a 49% slowdown leaves 19 of the 56 points
    # unexplained; measured within 30%-70% (unexplained 9%-...) that is noise and decoding is named, measured
    # within 48%-50% (unexplained 17%-...) it is not
    loose = _contention(0.49)
    loose["slowdown_interval"] = [0.3, 0.7]
    v = decide(_issue(loose))
    assert v.shares["unexplained"] > v.gap["share"] / 4 and v.intervals["unexplained"][0] < v.gap["share"] / 4
    assert v.kind == "data-bound", v.headline
    tight = _contention(0.49)
    tight["slowdown_interval"] = [0.48, 0.50]
    assert decide(_issue(tight)).kind == "unexplained"
    # a large measured wait with much left over: named in the fix, not the verdict
    f = _issue()
    f["end_to_end"]["raw"].update(data_wait_share=0.3, intervals={"data_wait_share": [0.28, 0.32]})
    v = decide(f)
    assert v.kind == "unexplained" and "the largest measured wait is data (30%)" in v.fix
    # a run close to its ceiling is compute-bound whatever part of its small gap is unexplained
    f = _issue()
    f["end_to_end"]["raw"].update(samples_per_s=2000.0, step_s=128 / 2000)
    v = decide(f)
    assert v.kind == "compute-bound" and "unexplained 5%" in v.headline, v.headline
    # without the ceiling there is no gap to explain: the waits alone, as before
    f = _issue()
    del f["compute"]
    v = decide(f)
    assert v.kind == "compute-bound" and "unexplained" not in v.shares and v.gap == {}


def test_the_layout_s_own_work_is_measured_named_and_its_remedy_predicted():
    # The demo's config on one worker, as diagnosed here: a tiny CNN whose bare step takes 2.9 ms, while the
    # trainer's step at ZeRO stage 2 with int8 gradients takes 9.0 ms on the same batch, 2.8 ms at stage 0 with
    # nothing quantized (FSDP2's hooks and
    # sharded parameters, quantizing: work that one worker pays and exchanges nothing for). The run: 12 ms a
    # step, 10.5 ms of it compute, 5% waiting on the loader; without the layout measured, 64 points of its 76-point
    # gap would be unexplained.
    bare, trainer, flat, step = 0.0029, 0.0090, 0.0028, 0.012
    f = {"compute": {"samples_per_s": 32 / bare, "samples_per_s_per_worker": 32 / bare, "workers": 1,
                     "batch_per_worker": 32, "interval": [32 / 0.0030, 32 / 0.0028],
                     "trainer": {"compute_s": trainer, "interval": [0.0088, 0.0096], "steps": 6,
                                 "layout": "ZeRO stage 2 (FSDP2), int8 gradients"},
                     "trainer_flat": {"compute_s": flat, "interval": [0.0027, 0.0030], "steps": 6,
                                      "layout": "ZeRO stage 0 (DDP)"}},
         "end_to_end": {"configured": "cache", "cache": {
             "samples_per_s": 32 / step, "step_s": step, "data_wait_share": 0.05, "comm_share": 0.0,
             "checkpoint_share": 0.0, "workers": 1,
             "intervals": {"data_wait_share": [0.04, 0.06], "comm_share": [0.0, 0.0], "checkpoint_share": [0.0, 0.0]},
             "per_step": {"step_s": [step] * 4, "comm": [0.0] * 4, "compute": [0.0105] * 4}}}}
    v = decide(f, {"workers": 1})
    assert v.kind == "layout-bound", v.headline
    # the layout's cost: the trainer's step in its layout against the same trainer's flat step
    lay = (trainer - flat) / step
    assert v.shares["layout"] == pytest.approx(lay) and v.gap["parts"]["layout"] == pytest.approx(lay)
    assert v.intervals["layout"] == pytest.approx([(0.0088 - 0.0030) / step, (0.0096 - 0.0027) / step])
    assert "(ZeRO stage 2 (FSDP2), int8 gradients) takes 9.0 ms against 2.8 ms at ZeRO stage 0 with nothing " \
        "quantized at one worker" in v.headline and f"{lay:.0%} of each step" in v.headline, v.headline
    assert "parallel.zero_stage = 0" in v.fix and "nothing to shard" in v.fix
    # the gap adds up, the layout explaining most of it: 76% = 5% wait + 52% layout + 7.5% host work outside
    # compute + 11.7% the run's compute beyond the trainer's step alone and the flat step's below the bare one
    # (no contention measured here)
    assert _step_parts(v) == pytest.approx(1 - bare / step)
    assert v.shares["overhead"] == pytest.approx(1 - 0.0105 / step - 0.05)
    assert v.shares["unexplained"] == pytest.approx((0.0105 - trainer + flat - bare) / step)
    # at N workers the fix does not drop the sharding: a stage that exchanges less where memory allows
    assert "larger batch per worker" in decide(f, {"workers": 2}).fix
    # the remedy: the step without the layout's work, settings that one worker runs
    r = layout_remedy(f)
    assert r["set"] == ["parallel.zero_stage=0", "parallel.quant_grads=none", "parallel.quant_weights=none"]
    assert r["predicted_samples_per_s"] == pytest.approx(32 / (step - (trainer - flat)))
    # a diagnosis recorded before the flat step was measured: against the bare loop's step
    old = {**f, "compute": {k: v for k, v in f["compute"].items() if k != "trainer_flat"}}
    assert decide(old, {"workers": 1}).shares["layout"] == pytest.approx((trainer - bare) / step)
    assert remedies(f, v.kind)[0] is not None and remedies(f, v.kind)[0]["for"] == "layout"
    # offload is kept for memory: no remedy drops it; a trainer step not measured (an old diagnosis) leaves it out
    f["compute"]["trainer"]["layout"] += ", optimizer offload"
    assert layout_remedy(f) is None
    del f["compute"]["trainer"]
    assert "layout" not in decide(f, {"workers": 1}).shares


def test_a_shared_machine_is_said_and_its_slowdown_is_not_surely_the_loader_s():
    # the issue's run with another process on one of the two cores while the step was measured: the slowdown
    # beside the loader is the loader and that process together, so none of it is surely decoding's; the data
    # share's interval reaches down to the wait alone, and the verdict cannot call it data-bound
    shared = _contention(1.05)
    shared["alone"]["others"] = shared["beside"]["others"] = 1.0
    v = decide(_issue(shared), {"others_cores": 1.0, "cores": 2, "budget_s": 60})
    assert v.intervals["data"][0] == pytest.approx(0.05) and v.shares["data"] == pytest.approx(0.06 + C)
    assert v.kind == "inconclusive", v.headline
    assert "measure longer (--budget-s 120" in v.headline
    assert v.headline.endswith("[the machine was shared: other processes took 1.0 of its 2 cores while it measured; "
                               "figures from a shared machine move between runs]"), v.headline
    # a quiet machine (a tenth of a core elsewhere): the same figures are data-bound, with nothing said
    v = decide(_issue(_contention(1.05)), {"others_cores": 0.1, "cores": 2})
    assert v.kind == "data-bound" and "shared" not in v.headline


def test_the_remedies_for_decoding_predict_from_the_measured_parts():
    f = _issue(_contention(1.05))
    c = C
    # the cache: the step without its wait and decoding's slowdown, capped by the samples held in RAM; no cache
    # of this table exists yet, so --verify materializes one
    r = data_remedy(f)
    assert r["predicted_samples_per_s"] == pytest.approx(990 / (1 - 0.06 - c))
    assert r["set"] == ["data.source=cache", "data.cache=CACHE"]
    assert r["materialize"] == {"table": "/data/table", "size": 32}
    f["loader"].update(cache=1500.0, paths={"table": "/data/table", "cache": "/data/cache", "size": 32})
    r = data_remedy(f)
    assert r["predicted_samples_per_s"] == pytest.approx(1500.0) and "materialize" not in r
    assert r["set"] == ["data.source=cache", "data.cache=/data/cache"]
    # one decode thread: the slowdown over the 1.6 cores decoding took, the loader alone over its 2 cores
    r = decode_threads_remedy(f)
    expected = 128 / max(STEP * 0.94 / 2.05 * (1 + 1.05 / 1.6), 128 / (2600 / 2))
    assert r["set"] == ["data.raw_threads=1"] and r["predicted_samples_per_s"] == pytest.approx(expected)
    # a node with the cores decoding takes: the step at its speed alone (the small wait stays out of it)
    r = node_remedy(f)
    assert r["set"] == [] and "a node with 4 cores" in r["node"]
    assert r["predicted_samples_per_s"] == pytest.approx(990 / (1 - c))
    # the verdict's remedies first, config changes before a node, the larger gain first
    found = remedies(f, "data-bound")
    assert [x["set"][:1] for x in found] == [["data.source=cache"], ["data.raw_threads=1"], []]
    # no slowdown measured: no threads or node remedy
    f["contention"] = _contention(0.0)
    assert decode_threads_remedy(f) is None and node_remedy(f) is None


def test_another_process_s_cpu_is_counted_and_its_end_is_not():
    """Other work on the machine, per process: a spinner that is no descendant of this one (a shell starts it and
    exits) is counted while it runs (all the CPU it gets); once killed, the zombie init reaps (or has reaped) adds
    nothing, where init's reaped-children time once read its whole life as other work. Read against the other work
    measured just before it starts, so that a machine already busy (another job spinning) reads the same."""
    if not cpu.available():
        pytest.skip("no /proc here")

    def cores() -> tuple[float, cpu.Others, cpu.Others]:
        a = cpu.others()
        time.sleep(1.5)
        b = cpu.others()
        return cpu.others_cores(a, b), a, b

    before, _, _ = cores()
    got = subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    spinner = int(got.stdout)
    try:
        time.sleep(0.5)
        reaper = int(cpu._fields(f"/proc/{spinner}/stat")[1])  # its parent, the shell having exited
        running, a, b = cores()
    finally:
        os.kill(spinner, signal.SIGKILL)
    time.sleep(0.2)
    after, a2, b2 = cores()
    # the spinner is runnable throughout, so it gets its share of the 2 cores whatever else runs (0.2 of a core
    # seen beside the whole suite and another spinner): all of it is counted among the others
    own = (b.seconds[spinner] - a.seconds[spinner]) / (b.at - a.at)
    assert own >= 0.1 and running >= own, (own, running)
    # afterwards it adds nothing: its frozen time (a zombie's, or gone) and no jump at its reaper (init, or a
    # subreaper), whose reaped children's time once read the spinner's whole life as other work. Per process, so
    # that other work starting meanwhile (another job on the machine: 1.1 cores once) is not read as a jump
    if spinner in b2.seconds:  # not reaped yet
        assert b2.seconds[spinner] == a2.seconds[spinner]
    jump = sum(b2.seconds[p] - a2.seconds[p] for p in {reaper, spinner} if p in a2.seconds and p in b2.seconds)
    assert jump / (b2.at - a2.at) < 0.3, (reaper, jump, before, after)


_SPINNER = """
import json, threading, time
from dutycycle.trainer.diagnose import cpu

step_threads = set(cpu.thread_seconds())
spent = []

def spin():
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.3:
        sum(range(1000))
    spent.append(time.thread_time() - t0)

a = cpu.snapshot()
t = threading.Thread(target=spin)
t.start()
t.join(timeout=60)
b = cpu.snapshot()
print(json.dumps({"got": cpu.cores(a, b, step_threads), "spent": spent[0], "cores": cpu.cores_available()}))
"""


def test_cpu_time_of_a_spinning_thread_is_counted_as_the_loader_s():
    """A thread started beside the step's threads spins for 0.3 s of its own CPU time (its clock, read inside it)
    and ends: /proc counts those seconds as the loader's, ended thread included, and none as the step's.
    Measured in a fresh process: in the test session's own, a local Ray cluster's daemons are its descendants and
    their CPU is (rightly) counted as the loader's too (0.05 s of them in one CI run)."""
    if not cpu.available():
        pytest.skip("no /proc here")
    out = subprocess.run([sys.executable, "-c", _SPINNER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    got, spent = res["got"], res["spent"]
    loader_s = got["loader"] * got["wall_s"]
    # /proc counts in clock ticks (1/100 s here): the thread's seconds within two ticks, plus the little the
    # snapshots themselves cost in the main thread (counted as the step's, not the loader's)
    assert got["loader_processes"] == 0, got
    assert loader_s == pytest.approx(spent, abs=2 / cpu.TICK + 0.01), res
    assert got["step"] * got["wall_s"] < 0.1 and got["others"] >= 0.0 and res["cores"] >= 1, res


def test_experiments_read_the_run_s_own_source_never_a_cache_a_base_config_names(tmp_path, shapes_small):
    """A raw config whose base config names a cache that was never materialized: the loader experiment measures
    the raw path and says why no cache; the cache of this very table is measured beside it; a synthetic config
    reads neither."""
    table, cache = shapes_small
    base = tmp_path / "base.toml"
    base.write_text(f'[data]\nsource = "cache"\ncache = "{tmp_path / "missing-cache"}"\n')
    raw = load_config(str(base), ["data.source=raw", f"data.table={table}", "data.size=16"])
    sources, skipped = loader_sources(raw)
    assert [name for name, _ in sources] == ["raw"] and "no committed cache" in skipped["cache"]
    assert table_of(raw) == table
    # the base config's cache is this table's, at the run's size: measured as the remedy's alternative
    mine = load_config(str(base), ["data.source=raw", f"data.table={table}", "data.size=16", f"data.cache={cache}"])
    assert own_cache(mine) == (cache, "")
    assert [name for name, _ in loader_sources(mine)[0]] == ["raw", "cache"]
    # at another size it is not the same samples
    other = load_config(str(base), ["data.source=raw", f"data.table={table}", "data.size=32", f"data.cache={cache}"])
    assert own_cache(other)[0] is None and "16 px" in own_cache(other)[1]
    # a cache run: its raw alternative is the cache's own source table at the cache's size
    cached = load_config(str(base), [f"data.cache={cache}", "data.table=/elsewhere/table"])
    sources, _ = loader_sources(cached)
    assert [n for n, _ in sources] == ["cache", "raw"]
    assert sources[1][1].data.table == table and sources[1][1].data.size == 16
    synth = load_config(str(base), ["data.source=synthetic", "data.table=/elsewhere/table"])
    assert [n for n, _ in loader_sources(synth)[0]] == ["synthetic"] and table_of(synth) is None


@pytest.fixture(scope="module")
def shapes_small(tmp_path_factory):
    from dutycycle.engine.cache.materialize import materialize
    from dutycycle.engine.transform import TransformSpec

    from ..support.tablemaker import make_shapes_table

    root = str(tmp_path_factory.mktemp("own"))
    table, _ = make_shapes_table(root, n=24, size=(24, 24))
    return table, materialize(table, root + "/cache", TransformSpec(size=16), runner="native").uri
