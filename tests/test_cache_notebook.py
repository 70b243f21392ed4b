"""notebooks/cache.ipynb runs top to bottom in a real Jupyter kernel; the repo keeps it without outputs."""

from __future__ import annotations

import os
import shutil

import nbformat

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "cache.ipynb")


def test_committed_cache_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_cache_notebook_executes_in_a_real_kernel(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    shutil.copy(NOTEBOOK, tmp_path / "cache.ipynb")
    nb = nbformat.read(tmp_path / "cache.ipynb", as_version=4)
    monkeypatch.chdir(tmp_path)
    for k, v in {"DAFT_ANALYTICS_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "DAFT_PROGRESS_BAR": "0"}.items():
        monkeypatch.setenv(k, v)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs
            if o.output_type == "execute_result" and "text/html" in o.get("data", {})]
    assert any(h.count("data:image/png;base64,") == 16 and "fingerprint" in h for h in html)  # the view
    assert any(h.count("data:image/png;base64,") == 12 for h in html)  # circle thumbnails
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "True" in text and "(64, 48, 48, 3) True" in text
    assert (tmp_path / "data" / "cache" / "latest").exists()
