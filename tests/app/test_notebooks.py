"""Both notebooks run top to bottom in a real Jupyter kernel; the repo keeps them without outputs."""

from __future__ import annotations

import shutil

import nbformat
import pytest

from ..support import REPO

NOTEBOOKS = REPO / "notebooks"


def html_outputs(outputs):
    return [o["data"]["text/html"] for o in outputs
            if o.output_type == "execute_result" and "text/html" in o.get("data", {})]


def check_curate(tmp_path, outputs):
    assert any(h.count("data:image/jpeg;base64,") >= 6 for h in html_outputs(outputs))  # thumbnails inline
    assert (tmp_path / "data" / "subset" / "_manifest.json").exists()
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "exact duplicates" in text and "near duplicates removed by distance: 0:" in text  # dedupe_stats


def check_cache(tmp_path, outputs):
    html = html_outputs(outputs)
    assert any(h.count("data:image/png;base64,") == 16 and "fingerprint" in h for h in html)  # the view
    assert any(h.count("data:image/png;base64,") == 12 for h in html)  # circle thumbnails
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "True" in text and "(64, 48, 48, 3) True" in text
    assert (tmp_path / "data" / "cache" / "latest").exists()


def check_bring_your_own(tmp_path, outputs):
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "1797 rows; splits by folders" in text
    accuracy = float(text.split("test accuracy ")[1].split()[0])
    assert accuracy >= 0.85, accuracy  # held-out handwritten digits, never in the training cache
    assert "a fresh process predicts the same: True" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the confusion matrix, shown inline
    # the ten highest-loss samples (run.record_sample_loss), joined with the table and shown with thumbnails
    assert "the ten highest-loss samples of" in text
    shown = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any(h.count("data:image") >= 10 and "max_loss" in h for h in shown)
    run = tmp_path / "runs" / "digits"
    assert (run / "evaluation" / "test.json").exists() and (run / "export" / "model.pt2").exists()
    assert (tmp_path / "mlruns" / "mlflow.db").exists()


CASES = {"curate.ipynb": check_curate, "cache.ipynb": check_cache, "bring_your_own.ipynb": check_bring_your_own}


@pytest.mark.parametrize("name", sorted(CASES))
def test_committed_notebook_has_no_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_notebook_executes_in_a_real_kernel(name, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    shutil.copy(NOTEBOOKS / name, tmp_path / name)
    nb = nbformat.read(tmp_path / name, as_version=4)
    monkeypatch.chdir(tmp_path)
    # The kernel inherits this environment (analytics off) and runs in the temporary working directory.
    for k, v in {"DAFT_ANALYTICS_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "DAFT_PROGRESS_BAR": "0"}.items():
        monkeypatch.setenv(k, v)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], [o for o in outputs if o.output_type == "error"]
    CASES[name](tmp_path, outputs)
