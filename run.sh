#!/usr/bin/env bash
# One entry point that does all set-up on a fresh machine (Python 3.11), then runs what you ask:
#   ./run.sh demo [ARGS]   the main job end to end on the embedded default data
#   ./run.sh test [ARGS]   lint and the test suite but the tests marked `long` (what CI runs; pytest ARGS:
#                          -m "not slow" for the fast subset)
#   ./run.sh test-all [ARGS]  lint and every test, the `long` ones too
#   ./run.sh setup         only create .venv
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DUTYCYCLE_VENV:-.venv}
TORCH=${DUTYCYCLE_TORCH:-torch==2.13.0}  # the CPU wheel on this machine kind's disk

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import dutycycle.engine, dutycycle.configs, torch, daft, ray" 2>/dev/null \
     || [ pyproject.toml -nt "$VENV/.dutycycle-installed" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first: the CPU wheel pinned here; without it pip resolves a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install -q "$TORCH"
    # and named again: pip 26, backtracking over fsspec/s3fs, otherwise drops the installed torch and takes the
    # newest one the range admits (2.14.1, a CUDA build of several GB)
    "$VENV/bin/python" -m pip install -q -e ".[dev,bench,tracking]" "$TORCH"
    touch "$VENV/.dutycycle-installed"
  fi
}

export RAY_USAGE_STATS_ENABLED=0 DAFT_ANALYTICS_ENABLED=0

cmd=${1:-test}
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; exec "$VENV/bin/dutycycle" demo "$@" ;;
  # the long tests (benchmark smoke runs, the elastic demo, load-sensitive diagnoses, ...) would take CI past its
  # 30 minutes on the slowest 2-core machines seen here; a later -m in ARGS replaces this one
  test) setup; "$VENV/bin/ruff" check .; exec "$VENV/bin/python" -m pytest -m "not long" "$@" ;;
  test-all) setup; "$VENV/bin/ruff" check .; exec "$VENV/bin/python" -m pytest "$@" ;;
  *) echo "usage: ./run.sh {demo|test|test-all|setup} [ARGS]" >&2; exit 2 ;;
esac
