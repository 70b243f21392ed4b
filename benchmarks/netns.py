"""Two "nodes" on one machine: network namespaces joined by a rate-limited veth pair, for distributed benchmarks.

    from benchmarks.netns import launch, two_nodes
    with two_nodes(rate_gbit=1.0) as net:
        ranks = launch(net, [sys.executable, "my_entry.py", ...], world_size=4, timeout=600)

runs ``world_size`` processes of a torch.distributed entry (env:// initialization, as torchrun starts them):
ranks 0..W/2-1 in namespace A, the rest in namespace B. Each namespace has its own loopback; a rank binds gloo to
its namespace's veth address (``GLOO_SOCKET_IFNAME``), and connections between two ranks of the same namespace
go to a local address, so the kernel keeps them on that namespace's unshaped loopback. Only traffic between the
namespaces crosses the veth pair, which ``tc ... tbf`` limits to ``rate_gbit`` in each direction (``None``: no
limit). DESIGN: at 1gbit this carried 0.96 Gbit/s on this machine kind.

Needs root (``CAP_NET_ADMIN``) and iproute2; ``unavailable()`` says why not, so a benchmark can skip its rows
with the reason. The namespaces are named after this process id and always removed on exit (also on an
exception or SIGTERM); removing a namespace removes its end of the veth pair, and so the pair.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (node A's address), MASTER_PORT,
GLOO_SOCKET_IFNAME and NODE_RANK; ``dist.init_process_group("gloo")`` reads them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from dutycycle.trainer.cluster.local import free_port

SUBNET = "10.231.7"  # private addresses; they exist only inside the two namespaces


@dataclass(frozen=True)
class TwoNodes:
    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    addresses: tuple[str, str]
    rate_gbit: float | None


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str


def unavailable() -> str | None:
    """Why two-node runs cannot happen here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root (CAP_NET_ADMIN); run the benchmark as root for these rows"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def _shape(ns: str, dev: str, rate_gbit: float) -> None:
    # the bucket must hold at least one GSO segment (64 KiB) and about a millisecond of traffic at the rate, or
    # tbf cannot reach the rate; the queue holds 20 ms before it drops (TCP then backs off to the rate)
    rate_bytes = rate_gbit * 1e9 / 8
    burst = max(256 * 1024, int(rate_bytes / 1000))
    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_gbit * 1000:.0f}mbit",
         "burst", str(burst), "latency", "20ms")


@contextmanager
def two_nodes(rate_gbit: float | None = None, tag: str | None = None) -> Iterator[TwoNodes]:
    """Create namespaces A and B joined by a veth pair shaped to ``rate_gbit`` (both directions); remove them on
    exit, whatever happens."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    tag = tag or f"dc{os.getpid()}"
    ns = (f"{tag}a", f"{tag}b")
    dev = (f"{tag}va"[:15], f"{tag}vb"[:15])  # interface names: at most 15 characters
    addr = (f"{SUBNET}.1", f"{SUBNET}.2")
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # turn SIGTERM into an exception so that the finally below runs
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        for n in ns:
            _run("ip", "netns", "add", n)
        _run("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for n, d, a in zip(ns, dev, addr, strict=True):
            _run("ip", "link", "set", d, "netns", n)
            _run("ip", "-n", n, "addr", "add", f"{a}/24", "dev", d)
            _run("ip", "-n", n, "link", "set", d, "up")
            _run("ip", "-n", n, "link", "set", "lo", "up")
            if rate_gbit is not None:
                _shape(n, d, rate_gbit)
        yield TwoNodes(ns, dev, addr, rate_gbit)
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        subprocess.run(["ip", "link", "del", dev[0]], capture_output=True)  # if it never reached a namespace
        signal.signal(signal.SIGTERM, previous)


def launch(net: TwoNodes | None, argv: Sequence[str], world_size: int, *, timeout: float,
           env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``argv`` as ``world_size`` ranks, the first half in node A and the rest in node B (``net=None``: all
    on this machine's loopback, as one node); wait for all (kill all at ``timeout``) and return each rank's exit
    code and output."""
    if net is not None and (world_size < 2 or world_size % 2):
        raise ValueError(f"world_size={world_size}: two nodes need an even number of ranks, at least 2")
    per_node = world_size // 2 if net is not None else world_size
    port = 29511 if net is not None else free_port()  # a fresh namespace has every port free
    procs = []
    for rank in range(world_size):
        node = rank // per_node
        rank_env = {
            **(env if env is not None else os.environ),
            "RANK": str(rank), "WORLD_SIZE": str(world_size), "NODE_RANK": str(node),
            "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_ADDR": net.addresses[0] if net is not None else "127.0.0.1", "MASTER_PORT": str(port),
        }
        cmd = list(argv)
        if net is not None:
            rank_env["GLOO_SOCKET_IFNAME"] = net.interfaces[node]
            # the namespaces share this machine's hostname: name each rank's node for the trainer's observed
            # topology (trainer/cluster/topology.py)
            rank_env["DUTYCYCLE_NODE_ID"] = net.namespaces[node]
            cmd = ["ip", "netns", "exec", net.namespaces[node], *cmd]
        # output to files, not pipes: a rank blocked on a full pipe would stall the collective of all ranks
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append((subprocess.Popen(cmd, env=rank_env, stdout=out, stderr=err), out, err))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for rank, (p, out, err) in enumerate(procs):
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
                note = ""
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                note = f"\nkilled after {timeout:.0f} s"
            out.seek(0)
            err.seek(0)
            results.append(RankResult(rank, p.returncode if not note else None, out.read(), err.read() + note))
    finally:
        for p, out, err in procs:  # the ones still running when another rank timed out or an exception came
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()
            err.close()
    return results
