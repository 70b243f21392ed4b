"""SIGKILL a checkpoint save at many moments and check that the newest commit always loads and verifies.

    python -m tests.support.ckpt_killer ROOT --kills 24 --seed 0        (ROOT: a local path or s3://bucket/prefix)

One process imports torch once and forks a child per kill point (a fork starts in milliseconds; a fresh Python
with torch takes seconds). Each child saves steps ``newest commit + 1, + 2, ...`` through the product's
``Saver`` (synchronous and asynchronous saves alternate between children), and reports every phase it enters
(snapshot, write, commit, retention, done) through a pipe. The parent picks a save, a phase and a random delay
within that phase's measured duration, SIGKILLs the child there, then checks:

- the newest directory with a manifest verifies (sizes and sha256) and loads, and its tensors are exactly the
  ones of its step (every step's state is a known function of the step);
- it is the save that was killed (when the manifest got written before the kill) or the one before, never older;
- directories without a manifest, including a hand-made one newer than everything, are ignored.

Every report waits for the parent's go-ahead (a second pipe) before the child carries on, and after the chosen
phase the parent gives none: the kill lands inside the chosen phase, or at its very end with the child parked at
its next report, however late the parent reads the pipe or wakes from its delay (on a busy machine a child that
did not wait ran past its kill point, sometimes to its exit, before the signal was sent).

Prints one JSON line: the kill points (save, phase, delay, what was found) and any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

PHASES = ("snapshot", "write", "commit", "retention")


def state_for(step: int):
    """The state saved as ``step``: a "model" and an "optim" part, every value a known function of the step
    (about 6 MB, so each phase lasts long enough to be hit at random)."""
    import torch

    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(512, 1024, generator=g), "b": torch.full((1024,), float(step))},
            "optim": {"m": torch.randn(512, 1024, generator=g), "step": torch.tensor(float(step))}}


def child(root: str, first: int, saves: int, async_save: bool, pipe_w: int, go_r: int) -> None:
    from dutycycle.trainer.checkpoint.saver import Saver
    from dutycycle.trainer.checkpoint.state import TrainerState, capture_rng

    def report(line: str) -> None:
        """Tell the parent, then wait for its go-ahead (none comes after the kill point: the child stays here)."""
        os.write(pipe_w, f"{line}\n".encode())
        if os.read(go_r, 1) != b"g":  # the parent is gone
            os._exit(3)

    def phase(name: str) -> None:  # from the training thread or the saver's background thread, one at a time
        report(f"{name} {time.monotonic()}")

    saver = Saver(root, rank=0, world_size=1, keep=2, async_save=async_save, on_phase=phase)
    for step in range(first, first + saves):
        report(f"save {step}")
        saver.save(step, state_for(step), TrainerState(step=step, epoch=0, loader={}, rng=[], world_size=1),
                   capture_rng())
        saver.wait()
    report("exit 0")
    os._exit(0)


def newest(root: str):
    """The newest verified commit, loaded: ``(step, exact)`` or ``(None, True)``."""
    import torch
    from dutycycle.trainer.checkpoint import find_latest
    from dutycycle.trainer.checkpoint.storage import read_state

    sel = find_latest(root)
    if sel is None:
        return None, True
    want = state_for(sel.step)
    got = {part: {k: torch.zeros_like(v) for k, v in tensors.items()} for part, tensors in want.items()}
    read_state(got, sel.uri, set(sel.manifest.files))
    exact = all(torch.equal(got[p][k], want[p][k]) for p in want for k in want[p])
    return sel.step, exact and not sel.fallbacks


def run_child(root: str, first: int, saves: int, async_save: bool, kill_at=None):
    """Fork a saving child; if ``kill_at = (save index, phase, delay)`` SIGKILL it there. Returns the phase
    timeline it reported, what it was doing when killed (save, phase), whether it had already finished that phase
    (parked at its next report) and its wait status."""
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        os.close(go_w)
        try:
            child(root, first, saves, async_save, w, go_r)
        except BaseException:  # noqa: BLE001 - a child must never return into the parent's code
            import traceback

            traceback.print_exc()
            os._exit(1)
    os.close(w)
    os.close(go_r)
    timeline, buf, killed, parked = [], b"", None, False
    current_save = None
    with os.fdopen(r, "rb", buffering=0) as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if killed is not None:
                    parked = True  # the child reached its next report before the signal and waited there
                    continue
                name, value = line.decode().split(" ", 1)
                if name != "save" and name != "exit":
                    timeline.append((current_save, name, float(value)))
                current_save = int(value) if name == "save" else current_save
                os.write(go_w, b"g")  # the child may go on (into the phase it just reported)
                if kill_at and name not in ("save", "exit") and (current_save - first, name) == kill_at[:2]:
                    time.sleep(kill_at[2])
                    os.kill(pid, signal.SIGKILL)
                    killed = (current_save, name)
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    return timeline, killed, parked, status


def durations(timeline) -> dict[str, float]:
    """Median seconds spent in each phase (from one phase mark to the next) over an unkilled run."""
    import statistics

    out: dict[str, list[float]] = {}
    for (s1, p1, t1), (s2, _p2, t2) in zip(timeline, timeline[1:], strict=False):
        if s1 == s2 and p1 in PHASES:
            out.setdefault(p1, []).append(t2 - t1)
    return {p: statistics.median(v) for p, v in out.items()}


def main() -> int:
    import torch

    torch.set_num_threads(1)  # no OpenMP pool in the parent: children are forked
    from dutycycle.engine import io

    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--kills", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default=",".join(PHASES))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    phases = args.phases.split(",")
    # a hand-made directory newer than anything the children write, with no manifest: never a checkpoint
    io.write_bytes_atomic(io.join(args.root, "step-99999999", "__0_0.distcp"), b"not a checkpoint")
    io.write_bytes_atomic(io.join(args.root, "step-99999999", ".metadata"), b"junk")
    # calibration: children that are not killed commit steps 1-4 and tell how long each phase takes, per mode
    results, failures, dur = [], [], {}
    for first, async_save in ((1, False), (3, True)):
        timeline, _, _, status = run_child(args.root, first, 2, async_save=async_save)
        dur[async_save] = durations(timeline)
        if status != 0:
            failures.append(f"calibration child exited with status {status}")
    after, _ = newest(args.root)
    for i in range(args.kills):
        before = after  # nothing writes between one kill's check and the next child
        first = (before or 0) + 1
        target = (rng.randrange(2), phases[i % len(phases)])
        async_save = (i // len(phases)) % 2 == 1  # every phase in both modes
        delay = rng.uniform(0, dur[async_save].get(target[1], 0.001))
        _, killed, parked, status = run_child(args.root, first, 2, async_save=async_save, kill_at=(*target, delay))
        after, exact = newest(args.root)
        rec = {"kill": i, "async": async_save, "save": target[0], "phase": target[1], "delay_s": round(delay, 5),
               "killed_in": killed, "at_phase_end": parked, "before": before, "after": after, "exact": exact,
               "signal": os.WIFSIGNALED(status) and os.WTERMSIG(status)}
        results.append(rec)
        killed_step = killed[0] if killed else None
        if killed is None:
            failures.append(f"kill {i}: the child never reached {target}")
        elif rec["signal"] != signal.SIGKILL:
            failures.append(f"kill {i}: the child ended with wait status {status}, not by the SIGKILL ({rec})")
        elif after is None or not exact:
            failures.append(f"kill {i}: newest commit {after} does not load exactly ({rec})")
        elif after not in (killed_step, killed_step - 1):
            failures.append(f"kill {i}: newest commit is step {after}, killed while saving {killed_step}")
    print("KILLER " + json.dumps({"durations": {"sync": dur[False], "async": dur[True]}, "results": results,
                                  "failures": failures}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
