"""notebooks/curate.ipynb runs top to bottom in a real Jupyter kernel; the repo keeps it without outputs."""

from __future__ import annotations

import os
import shutil

import nbformat
import pytest

NOTEBOOK = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "curate.ipynb"
)


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_notebook_executes_in_a_real_kernel(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    shutil.copy(NOTEBOOK, tmp_path / "curate.ipynb")
    nb = nbformat.read(tmp_path / "curate.ipynb", as_version=4)
    monkeypatch.chdir(tmp_path)
    # The kernel inherits this environment (analytics off) and runs in the temporary working directory.
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [
        o["data"]["text/html"]
        for o in outputs
        if o.output_type == "execute_result" and "text/html" in o.get("data", {})
    ]
    assert any(h.count("data:image/jpeg;base64,") >= 6 for h in html)  # the thumbnail grid rendered inline
    assert (tmp_path / "data" / "subset" / "_manifest.json").exists()


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("DAFT_ANALYTICS_ENABLED", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("DAFT_PROGRESS_BAR", "0")
