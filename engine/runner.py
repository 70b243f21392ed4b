"""Choose where Daft runs queries: its native (single-process, multithreaded) runner or a Ray cluster.

Precedence: an explicit ``--runner`` value, then the ``DAFT_RUNNER`` environment variable, then native, so a
process that merely has Ray initialized (a Ray Train worker, a notebook with a Ray cluster) still runs Daft
natively unless asked. Daft fixes the runner per process once a query has run; with nothing asked for
explicitly, the runner already fixed is kept.
"""

from __future__ import annotations

import os

from .errors import ConfigError

RUNNERS = ("native", "ray")


def resolve(runner: str | None = None) -> str:
    name = (runner or os.environ.get("DAFT_RUNNER") or "native").strip().lower()
    if name not in RUNNERS:
        origin = "--runner" if runner else "DAFT_RUNNER"
        raise ConfigError(f"{origin} {name!r} is not a runner; use one of: {', '.join(RUNNERS)}")
    return name


def configure(runner: str | None = None, ray_address: str | None = None) -> str:
    """Set Daft's runner for this process; returns the runner's name. Safe to call again with the same one."""
    import daft

    name = resolve(runner)
    if ray_address and name != "ray":
        raise ConfigError(f"--ray-address {ray_address!r} needs the Ray runner; add --runner ray")
    current = daft.get_or_infer_runner_type()
    try:
        if name == "ray":
            daft.set_runner_ray(address=ray_address, noop_if_initialized=True)
        else:
            daft.set_runner_native()
    except Exception as e:
        if "more than once" in str(e) and current == name:
            return name  # already running on the requested runner
        if "more than once" in str(e) and runner is None and not os.environ.get("DAFT_RUNNER"):
            return current  # nothing was asked for explicitly: keep the runner this process already fixed
        if "more than once" in str(e):
            raise ConfigError(
                f"Daft already runs queries on the {current!r} runner in this process; choose --runner "
                f"{name!r} before the first query (start a new process)"
            ) from e
        raise
    return name


def add_arguments(parser) -> None:
    """``--runner`` and ``--ray-address`` for CLI subcommands that run Daft queries."""
    parser.add_argument(
        "--runner",
        choices=None,
        default=None,
        help="native (default) or ray; also DAFT_RUNNER in the environment",
    )
    parser.add_argument(
        "--ray-address", default=None, help="address of a running Ray cluster (with --runner ray)"
    )
