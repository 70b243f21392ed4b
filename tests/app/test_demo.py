"""`dutycycle demo --small` end to end, as a user runs it: the `dutycycle` command of a wheel built from this
tree, installed into a fresh virtual environment, run outside the source tree (a subprocess: it starts its own
Ray cluster). An editable install once hid a subpackage missing from the wheel; this run would not."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from ..support import REPO
from ..support.wheel import clean_env, venv_with

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_demo_small_runs_end_to_end_from_the_built_wheel(tmp_path, wheel):
    bin_dir = venv_with(wheel, tmp_path / "venv")
    where = subprocess.run([str(bin_dir / "python"), "-c", "import dutycycle.trainer.diagnose as d; print(d.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=clean_env())
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout + where.stderr
    out = tmp_path / "demo"
    proc = subprocess.run([str(bin_dir / "dutycycle"), "demo", "--small", "--out", str(out)],
                          capture_output=True, text=True, timeout=540, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    text = proc.stdout
    for stage in ("synth:", "ingest:", "curate:", "inspect:", "materialize:", "train:", "final validation accuracy:",
                  "time: data_wait", "recovery:", "diagnose:", "[diagnose] verdict:", "everything together:"):
        assert stage in text, f"{stage!r} missing from the demo output:\n{text}"
    # a readable log: each of rank 0's lines once, no state-API warning every second, no Daft span records
    # (the raw loader's row plan in diagnose printed one per operator through Ray Train's INFO root logger)
    both = proc.stdout + proc.stderr
    assert "Failed to query Ray Train Controller actor state" not in both
    assert "ScanTaskSource::get_data" not in both
    step_lines = [ln for ln in both.splitlines() if ln.startswith("step 1/16 (")]  # the driver's progress line
    assert len(step_lines) == 1, step_lines
    assert "[rank 0]" not in both and "Token authentication" not in both and "PreemptionWatcher" not in both
    assert "attempt 2: resumed at step" in text  # the restart after the killed worker, as the driver shows it
    assert "bad files counted" in text and " 0 bad files" not in text  # the broken files were counted
    demo = json.loads((out / "demo.json").read_text())
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 16
    assert summary["parallel"]["zero_stage"] == 2 and summary["parallel"]["quantization"]["grads_bits"] == 8
    # one worker was killed mid-run; Ray Train restarted the group and it resumed from a commit by itself
    rec = demo["recovery"]
    assert rec["killed_pid"] and rec["error"] is None, rec
    assert rec["resumed_from_step"] >= 4 and rec["resumed_from_step"] % 4 == 0 and rec["recovery_s"] > 0
    assert summary["checkpoint"]["resumed"]["step"] == rec["resumed_from_step"]
    # the job's account covers the killed attempt too: steps trained again and the downtime, in goodput's divisor
    job = summary["job"]
    assert job["attempts"] == 2 and job["steps_redone"] == summary["checkpoint"]["resumed"]["steps_lost"] > 0
    assert job["failures_s"] > 0 and summary["goodput"] == job["goodput"]
    # every second from launch to exit under a name, the failure included; "other" the residue under 5%
    launch = summary["launch"]
    assert sum(launch["seconds"].values()) == pytest.approx(launch["wall_s"], rel=1e-9)
    assert launch["fractions"]["other"] < 0.05, launch["seconds"]
    assert launch["attempts"] == 2 and launch["seconds"]["failures"] > 0
    assert launch["failures"]["redone_s"] == pytest.approx(job["redone_s"])
    assert "job: " in text and "from launch to exit" in text
    steps = [json.loads(ln)["step"] for ln in (out / "run" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in ln]
    assert steps == list(range(1, 17))  # lost steps trained again, none twice
    assert demo["diagnosis"]["verdict"]["kind"] in ("compute-bound", "data-bound", "communication-bound", "balanced",
                                                    "checkpoint-bound", "layout-bound", "inconclusive",
                                                    "unexplained")  # a busy machine's gap can be mostly unmeasured
    assert (out / "diagnose" / "diagnosis.html").exists()
    page = (out / "demo.html").read_text()
    assert "Failure and recovery" in page and demo["diagnosis"]["verdict"]["kind"] in page
    assert "lost to failures" in page and "steps trained again" in page
    # written for a person: no None, dict or float reprs; the verdict's kind said once, not "x-bound: x-bound:"
    from ..support.pages import raw_values, unresolved

    diagnosis = json.loads((out / "diagnose" / "diagnosis.json").read_text())
    for html_page, folder in ((page, out), ((out / "diagnose" / "diagnosis.html").read_text(), out / "diagnose"),
                              ((out / "contact_sheet.html").read_text(), out)):
        assert not raw_values(html_page), raw_values(html_page)
        assert not unresolved(html_page, folder), unresolved(html_page, folder)
    # the pages show the summary's and the diagnosis's figures, under the names they have there
    import html as _html

    assert f"{launch['wall_s']:.1f} s from launch to exit" in page
    for k, v in launch["seconds"].items():
        if v > 0:
            assert f"{v:.2f} s ({launch['fractions'][k]:.1%})" in page, k
    stall = summary["checkpoint"]["stall_s"]
    assert f"{stall['total']:.2f} s over {summary['checkpoint']['saves']} saves" in page
    verdict = diagnosis["verdict"]["headline"]
    assert verdict == demo["diagnosis"]["verdict"]["headline"]
    assert page.count(_html.escape(verdict)) == 1
    assert (out / "diagnose" / "diagnosis.html").read_text().count(_html.escape(verdict)) == 1
    from PIL import Image

    with Image.open(out / "run" / "report.png") as png:
        title, subtitle = png.text["Title"], png.text["Description"]
    assert f"{summary['steps']} steps, {summary['samples_per_s']:.0f} samples/s" in title
    assert f"{launch['wall_s']:.0f} s launch to exit (goodput {launch['goodput']:.0%})" == subtitle
    for html_page in (page, (out / "diagnose" / "diagnosis.html").read_text()):
        kind = demo["diagnosis"]["verdict"]["kind"]
        assert f"{kind}: {kind}" not in html_page
    # 16 steps of a tiny CNN: no accuracy target, but the value must be a real accuracy over real val samples
    assert summary["val_accuracy"] == demo["val_accuracy"]
    assert demo["training"]["steps"] == 16 and demo["training"]["time_breakdown"] == summary["time_breakdown"]
    evals = [json.loads(ln) for ln in (out / "run" / "metrics.jsonl").read_text().splitlines() if "val_samples" in ln]
    assert evals and all(e["val_samples"] > 0 for e in evals)
    assert 0.0 <= demo["val_accuracy"] <= 1.0
    assert (out / "run" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "contact_sheet.html").read_text().count("<img") > 0
    assert (out / "run" / "config.json").exists() and (out / "run" / "metrics.jsonl").exists()
    # the model card of a wheel's run: no git checkout, the wheel as pip recorded it; the killed worker survived
    card = json.loads((out / "run" / "model_card.json").read_text())
    assert card["code"]["git"] is None and card["code"]["install"]["kind"] == "archive"
    assert card["code"]["install"]["url"].endswith(wheel.name)
    assert [r["cause"] for r in card["training"]["restarts"]] == ["start", "restart after failure"]
    assert card["training"]["failures_survived"] == 1 and card["training"]["world_sizes"] == [2, 2]
    assert card["data"]["table"]["version"] and card["data"]["splits"]["train"] == summary["data"]["train_samples"]
    assert (out / "run" / "MODEL_CARD.md").read_text().startswith("# Model card: ")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and k != "label_selector":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("small", [False, True])
def test_the_demo_trains_with_demo_toml_plus_its_documented_overrides(small):
    """configs/demo.toml is what `dutycycle train` users copy and what the demo trains with: the demo's resolved
    config differs from the file only in its cache, run directory and worker count (and --small's settings)."""
    from dutycycle.loader.plan import default_partitions
    from dutycycle.trainer.app.demo import SMALL, training_config
    from dutycycle.trainer.config import load_config, packaged_config

    root = str(REPO)
    path = os.path.join(root, "configs", "demo.toml")
    with open(path, encoding="utf-8") as f:
        assert f.read() == packaged_config("demo.toml")  # the demo reads the installed copy of this file
    from_file = _flat(load_config(path).to_dict())
    demo = _flat(training_config(4, "/demo/run", "/demo/cache/abc", small, ["optim.lr=0.01"]).to_dict())
    documented = {"data.cache": "/demo/cache/abc", "run.dir": "/demo/run", "parallel.num_workers": 4,
                  **(SMALL["train"] if small else {}), "optim.lr": 0.01,  # the user's --set comes last
                  # the default partition count follows the worker count (a plan input, resolved when loaded)
                  "data.partitions": default_partitions([4], demo["data.global_batch_size"])}
    assert demo.keys() == from_file.keys()
    differ = {k: v for k, v in demo.items() if v != from_file[k]}
    assert differ == {k: v for k, v in documented.items() if v != from_file[k]}
    assert {"data.cache", "run.dir", "parallel.num_workers", "optim.lr"} <= differ.keys()
    load_config(os.path.join(root, "configs", "vit.toml"))  # and the other shipped config validates
