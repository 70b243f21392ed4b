"""The results no script here measures, rendered for the docs: ``dutycycle demo``'s run (benchmarks/results/demo.json,
the demo's own demo.json with the figures measured by hand beside it) and an example of ``dutycycle diagnose``
(diagnose_example.json, its findings file)."""

from __future__ import annotations

from dutycycle.trainer.launch.account import NAMES
from dutycycle.trainer.step.timing import JOB_ONE_TIME, PHASES

from benchmarks import docs_format as fmt


def render_demo(d: dict) -> str:
    st, tr, rc = d["stages"], d["training"], d["recovery"]
    hand = d["measured_by_hand"]
    whole, exact = hand["whole_process"], hand["recovery_exact"]
    stages = fmt.table(
        ["stage", "seconds"],
        [[name, fmt.secs(st[name])] for name in ("synth", "ingest", "curate", "materialize", "train", "diagnose")]
        + [["all stages (`dutycycle demo`)", fmt.secs(d["total_s"])],
           [f"whole process, timed by hand: {fmt.command_line(whole['command'])}", fmt.secs(whole["real_s"])]],
    )
    fr = tr["time_breakdown"]["fractions"]
    order = ["forward_backward", "comm", "optimizer", "eval", "checkpoint", "data_wait", "h2d", "other"]
    labels = {"forward_backward": "forward/backward", "comm": "exposed communication", "h2d": "host-to-device",
              "data_wait": "data wait", "eval": "evaluation"}
    training = fmt.table(
        ["training", "value"],
        [["validation accuracy", fmt.pct(d["val_accuracy"], 1)],
         ["validation loss", f"{tr['val_loss']:.3g}"],
         ["optimizer steps", fmt.count(tr["steps"])],
         ["samples/s (the resumed attempt)", fmt.rate(tr["samples_per_s"])],
         ["goodput of the training loop (every attempt's kept steps)", fmt.pct(tr["goodput"])]]
        + [[f"share of the step: {labels.get(k, k)}", fmt.pct(fr[k])] for k in order],
    )
    launch = tr.get("launch")
    if launch:  # every second from launch to exit under a name (trainer/launch/account.py)
        sec, lfr = launch["seconds"], launch["fractions"]
        rows = [[f"per step: {NAMES[k]}", fmt.secs(sec[k]), fmt.pct(lfr[k], 1)] for k in PHASES]
        rows += [[f"once: {NAMES[k]}", fmt.secs(sec[k]), fmt.pct(lfr[k], 1)] for k in JOB_ONE_TIME]
        rows += [["other (the residue)", fmt.secs(sec["other"]), fmt.pct(lfr["other"], 1)],
                 ["the job, from launch to exit", fmt.secs(launch["wall_s"]), "100%"]]
        training += "\n\n" + fmt.table(["the job's time", "seconds", "share"], rows)
    recovery = fmt.table(
        ["recovery", "value"],
        [["rank killed (SIGKILL)", f"rank {rc['killed_rank']} after step {rc['killed_at_step']}"],
         ["resumed from the commit of step", str(rc["resumed_from_step"])],
         ["from the kill to the resumed group's first step", fmt.secs(rc["recovery_s"])],
         ["steps trained again", str(rc["steps_lost"])],
         [f"largest per-step loss difference against an uninterrupted run ({fmt.count(exact['steps_compared'])} "
          "steps)", f"{exact['max_abs_loss_diff']:g}"],
         ["the uninterrupted run's validation loss", f"{exact['uninterrupted_val_loss']:.3g}"]],
    )
    return "\n\n".join([stages, training, recovery, fmt.source("demo")])


def render_demo_verdict(d: dict) -> str:
    v = d["diagnosis"]["verdict"]
    return "\n\n".join([fmt.verdict_block(v["headline"]), fmt.para(f"Suggested fix: {v['fix']}."), fmt.source("demo")])


def render_diagnose_example(d: dict) -> str:
    f = d["findings"]
    raw = f["end_to_end"]["raw"]
    rows = [
        ["compute ceiling (one worker, a batch already in place)", f"{fmt.rate(f['compute']['samples_per_s'])} samples/s"],
        ["loader alone, raw decode path", f"{fmt.rate(f['loader']['raw'])} samples/s"],
        ["end to end, raw", f"{fmt.rate(raw['samples_per_s'])} samples/s, step {fmt.secs(raw['step_s'])}"],
        ["data-wait share of the step, end to end", fmt.pct(raw["data_wait_share"])],
        ["data share the verdict weighs (the larger of the wait and the part of the ceiling the loader alone "
         "cannot feed)", fmt.pct(d["verdict"]["shares"]["data"])],
    ]
    return "\n\n".join([fmt.verdict_block(d["verdict"]["headline"]), fmt.table(["measured", "value"], rows),
                        fmt.source("diagnose_example")])
