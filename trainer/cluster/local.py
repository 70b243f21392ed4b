"""Processes on this machine: a Ray cluster started for this process, and a free TCP port for a rendezvous.

One place for both, used by ``dutycycle train`` (a local cluster when ``ray.address`` is empty), the tests and
the benchmarks, so every Ray start on one machine is configured alike.

Token authentication: Ray 2.59 turns it on for every new local cluster and says so in a warning at each start
("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out..."), unless
``RAY_AUTH_MODE`` is set. A cluster started here gets ``RAY_AUTH_MODE=token``: the same secure default, chosen
rather than announced (the token is Ray's, generated once into ``~/.ray/auth_token``). Joining a cluster leaves
the mode to Ray, and a ``RAY_AUTH_MODE`` the user set is kept.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

AUTH_MODE = "RAY_AUTH_MODE"


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
    if fresh or not _cluster_to_join():
        _choose_token_auth()
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


def _choose_token_auth() -> None:
    """For a new cluster: Ray's default token authentication, chosen instead of announced, unless the user chose.
    Ray reads its config once, when it is imported; set later, the cluster's processes would take the mode and
    this one not (they would refuse its calls), so a process that imported Ray already has it read its config
    again, as Ray does itself when it turns token authentication on. Where that is not possible, Ray's own
    default (and its notice) stands."""
    if os.environ.get(AUTH_MODE) is not None:
        return
    os.environ[AUTH_MODE] = "token"
    if "ray" not in sys.modules:
        return
    try:
        from ray._raylet import Config

        Config.initialize("")
    except Exception:  # noqa: BLE001 - a Ray that moved it: leave Ray's default as it was
        del os.environ[AUTH_MODE]


def _cluster_to_join() -> bool:
    """Whether ``ray.init(address=None)`` joins a cluster rather than starting one: ``RAY_ADDRESS`` names one,
    or ``ray start`` recorded one on this machine (the file Ray's own lookup reads, in Ray's temp directory)."""
    address = os.environ.get("RAY_ADDRESS", "")
    if address:
        return address != "local"
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.exists(os.path.join(tmp, "ray", "ray_current_cluster"))
