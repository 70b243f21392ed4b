"""Render the measured figures in the docs from benchmarks/results/*.json.

Every number a page quotes from a measurement lives in a results file; this script writes the tables (and the few
recorded verdict lines) between marker comments in README.md and docs/*.md::

    <!-- render:loader -->
    ...generated, do not edit...
    <!-- /render:loader -->

Everything outside the markers is written by hand. A block names one of ``BLOCKS``: the results file it renders and
the function that renders it, which lives in the benchmark that writes the file (``render`` for its main block).
A page that names a block that does not exist, or a results file that lacks a value a block needs, is an error,
not a silently empty table.

    python benchmarks/render_docs.py            # rewrite the pages in place
    python benchmarks/render_docs.py --check    # exit 1, naming the pages that differ from what would be written

Either exits 2 when a page or a results file is wrong (an unknown block, unpaired markers, a missing value).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # run as `python benchmarks/render_docs.py`: the siblings import as `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import (  # noqa: E402
    cache,
    cache_formats,
    checkpoint_render,
    collectives,
    curate_scale,
    diagnose_accuracy,
    diagnose_stability,
    ingest,
    loader,
    materialize,
    recorded,
    scale,
    scale_elastic,
    startup,
    trace,
    train,
    tune,
    zero,
    zero_offload,
    zeropp,
)
from benchmarks import docs_format as fmt  # noqa: E402
from benchmarks.docs_format import RESULTS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class RenderError(Exception):
    """A page names an unknown block, its markers do not pair up, or a results file lacks a value a block uses."""


def results_index(results: dict) -> str:
    """Every results file and the machine it was measured on."""
    rows = []
    for name in sorted(results):
        d = results[name]
        cpus = (d.get("machine") or {}).get("cpus", d.get("cpus"))
        rows.append([f"[`{name}.json`](../{RESULTS.as_posix()}/{name}.json)", f"{cpus} CPUs" if cpus else "not recorded"])
    return fmt.table(["results file", "machine"], rows)


INDEX = "results-index"  # the one block over every results file
BLOCKS: dict[str, tuple[str, Callable[[dict], str]]] = {  # block -> (the results file it renders, its renderer)
    "demo-run": ("demo", recorded.render_demo),
    "demo-verdict": ("demo", recorded.render_demo_verdict),
    "diagnose-example": ("diagnose_example", recorded.render_diagnose_example),
    "diagnose-stability": ("diagnose_stability", diagnose_stability.render),
    "diagnose-accuracy": ("diagnose_accuracy", diagnose_accuracy.render),
    "diagnose-accuracy-untuned": ("diagnose_accuracy_untuned", diagnose_accuracy.render_untuned),
    "diagnose-comm-prediction": ("zeropp", zeropp.render_comm_prediction),
    "tune": ("tune", tune.render),
    "ingest": ("ingest", ingest.render),
    "curate-scale": ("curate_scale", curate_scale.render),
    "materialize": ("materialize", materialize.render),
    "cache-formats": ("cache_formats", cache_formats.render),
    "cache": ("cache", cache.render),
    "loader": ("loader", loader.render),
    "loader-ratios": ("loader", loader.render_ratios),
    "loader-remote": ("loader", loader.render_remote),
    "scale": ("scale", scale.render),
    "scale-elastic": ("scale_elastic", scale_elastic.render_elastic),
    "train": ("train", train.render),
    "startup": ("startup", startup.render),
    "zero": ("zero", zero.render),
    "zero-ratios": ("zero", zero.render_ratios),
    "zero-offload": ("zero", zero_offload.render),
    "zeropp": ("zeropp", zeropp.render),
    "zeropp-hpz": ("zeropp", zeropp.render_hpz),
    "zeropp-convergence": ("zeropp", zeropp.render_convergence),
    "layouts": ("zeropp", zeropp.render_layouts),
    "collectives": ("collectives", collectives.render),
    "collectives-crossover": ("collectives", collectives.render_crossover),
    "collectives-codec": ("collectives", collectives.render_codec),
    "checkpoint": ("checkpoint", checkpoint_render.render),
    "trace": ("trace", trace.render),
}


def render_block(name: str, results: dict) -> str:
    """The markdown of block ``name`` from the results files (``results``: file stem -> its JSON)."""
    if name == INDEX:
        return results_index(results)
    stem, render = BLOCKS[name]
    if stem not in results:
        raise RenderError(f"no results file {RESULTS.as_posix()}/{stem}.json")
    return render(results[stem])

# A marker is a line of its own, so prose may quote one inline without opening a block.
MARKER = re.compile(r"^<!-- render:(?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /render:(?P=name) -->$", re.S | re.M)
ANY_MARKER = re.compile(r"^<!-- /?render:([\w-]+) -->$", re.M)


# -- pages ----------------------------------------------------------------------------------------------------------

def load_results(root: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((root / RESULTS).glob("*.json"))}


def pages(root: Path) -> list[Path]:
    """README.md and every docs page: the files that may hold render blocks."""
    found = [root / "README.md"] if (root / "README.md").exists() else []
    return found + sorted((root / "docs").glob("*.md"))


def render_text(text: str, results: dict, page: str = "page") -> str:
    """``text`` with every render block's body replaced by what its block writes from ``results``."""
    opened = [m.group(0) for m in ANY_MARKER.finditer(text)]
    paired = MARKER.findall(text)
    if len(opened) != 2 * len(paired):
        raise RenderError(f"{page}: render markers do not pair up ({len(opened)} markers, {len(paired)} blocks)")

    def one(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS and name != INDEX:
            raise RenderError(f"{page}: unknown render block {name!r} (known: {', '.join(sorted([*BLOCKS, INDEX]))})")
        try:
            body = render_block(name, results)
        except (KeyError, IndexError, TypeError) as e:
            raise RenderError(f"{page}: block {name!r}: a results file lacks a value it needs ({e!r})") from e
        return f"<!-- render:{name} -->\n{body.rstrip()}\n<!-- /render:{name} -->"

    return MARKER.sub(one, text)


def render_all(root: Path) -> dict[Path, tuple[str, str]]:
    """Every page under ``root``: (its text now, the text the renderer writes)."""
    results = load_results(root)
    out = {}
    for page in pages(root):
        text = page.read_text()
        out[page] = (text, render_text(text, results, str(page.relative_to(root))))
    return out


def check(root: Path) -> list[Path]:
    """Pages whose committed text differs from what the renderer writes."""
    return [page for page, (now, new) in render_all(root).items() if now != new]


def write(root: Path) -> list[Path]:
    """Rewrite the pages that differ; returns them."""
    changed = []
    for page, (now, new) in render_all(root).items():
        if now != new:
            page.write_text(new)
            changed.append(page)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a page differs from what would be written")
    p.add_argument("--root", default=str(ROOT), help="the repository root (default: this checkout)")
    args = p.parse_args(argv)
    root = Path(args.root)
    try:
        if args.check:
            stale = check(root)
            for page in stale:
                print(f"{page.relative_to(root)}: differs from benchmarks/results (run python "
                      "benchmarks/render_docs.py)", file=sys.stderr)
            return 1 if stale else 0
        for page in write(root):
            print(f"rewrote {page.relative_to(root)}")
    except RenderError as e:
        print(f"render_docs: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
