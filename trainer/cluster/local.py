"""Processes on this machine: a Ray cluster started for this process, and a free TCP port for a rendezvous.

One place for both, used by ``dutycycle train`` (a local cluster when ``ray.address`` is empty), the tests and
the benchmarks, so every Ray start on one machine is configured alike.
"""

from __future__ import annotations

import socket
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a rendezvous: torchrun's, MASTER_PORT, a local server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ray(
    num_cpus: int | None = None,
    object_store_bytes: int | None = None,
    *,
    fresh: bool = True,
    log_to_driver: bool = False,
    runtime_env: dict[str, Any] | None = None,
) -> bool:
    """Start Ray on this machine for this process unless it is initialized already; True when this call started it.

    ``fresh=True`` always starts a cluster of its own (``address="local"``): without it, ``ray.init`` joins any
    cluster another process left running here (``ray start``) and then refuses ``num_cpus``. ``fresh=False``
    joins such a cluster (or ``RAY_ADDRESS``'s) when there is one and starts one otherwise. ``None`` leaves
    CPUs and the object store at Ray's defaults. The dashboard stays off and Ray leaves logging alone.
    """
    import ray

    if ray.is_initialized():
        return False
    ray.init(
        address="local" if fresh else None,
        num_cpus=num_cpus,
        object_store_memory=object_store_bytes,
        include_dashboard=False,
        log_to_driver=log_to_driver,
        configure_logging=False,
        runtime_env=runtime_env,
    )
    return True
