"""The ``[checkpoint]`` config section: saves, commits, resume and recovery (storage and peer memory); each key
checked here, naming it (trainer/config.py holds the others)."""

from __future__ import annotations

from dataclasses import dataclass

from dutycycle.engine.errors import ConfigError

from .configtree import not_negative, one_of


@dataclass
class CheckpointSection:
    """Checkpoints (trainer/checkpoint/): model, optimizer, loader position, RNG and step, committed by a manifest
    with checksums written last."""

    every: int = 0  # optimizer steps between saves (and one at the last step); 0 = no checkpoints
    # any fsspec URI; "" = RAY_STORAGE/RUN_NAME/checkpoints when ray.storage_path is set (Ray Train's shared
    # storage), else RUN_DIR/checkpoints
    dir: str = ""
    # Ranks on several nodes each write their own files, and rank 0's manifest names them all: a local path is
    # refused then (each node would hold a part), unless it is a file system every node mounts (NFS, a mounted
    # bucket) and this says so. Object stores (s3://, gs://, ...) need nothing.
    shared_fs: bool = False
    keep: int = 2  # committed checkpoints kept (at least 2: the newest may be the one being replaced)
    # failures per worker-hour that `dutycycle diagnose` models lost work and the best interval with; default: the
    # Llama 3 report's 419 interruptions in 54 days on 16,384 GPUs (trainer/diagnose/failures.py)
    failures_per_worker_hour: float = 419 / (54 * 24 * 16384)
    # seconds from a failure to Ray Train acting on it, for the same model; unset: a lost node as Ray notices it
    # (its health check declares the node dead after 5 missed checks 3 s apart, then the controller's next poll,
    # ray.health_check_interval_s). A crashed worker is seen sooner; a hang only at the process group's timeout:
    # set that here when hangs are the failures your cluster has
    failure_detect_s: float | None = None
    # true: the step blocks only for the snapshot into host memory, the write streams in the background (at most
    # one save in flight; a save due while the previous one still writes waits for it, counted as stall).
    # false: the step blocks for the whole write and commit. The key "checkpoint.async" is accepted too.
    async_save: bool = True
    # how many nice steps below training the background save thread runs (0..19; Linux, per thread): its write and
    # checksums take the cores training and data loading leave idle first. The snapshot copy is not lowered.
    background_nice: int = 10
    # "auto": continue from the newest checkpoint under checkpoint.dir whose manifest verifies (falling back to
    # older ones, loudly); "none": start fresh; or the URI of one step directory (it must verify)
    resume: str = "auto"
    # a non-finite loss (or gradient norm) at step s: "skip" = roll back to the last commit before s and leave
    # out the global batch of step s; "rollback" = roll back and train the same batches again (a transient
    # fault; the same step failing twice stops); "stop" = stop with the step and the batch's sample ids
    on_nonfinite: str = "skip"
    max_rollbacks: int = 3  # rollbacks in one run before a non-finite loss stops it
    # A resumed loader position is refused when the saved plan inputs (split, seed, window, block size, cache
    # fingerprint, ...) differ from this run's: the position would index another sequence of batches. true
    # loads the position anyway and continues this run's own plan from there (a different sample order), also
    # from a commit made at another data.global_batch_size or for another cache (`dutycycle train --resume
    # --force` sets it).
    force_loader_state: bool = False
    # optimizer steps between peer-memory copies (trainer/checkpoint/peer.py): every K steps each rank's state is
    # kept in memory on its own node and on another node (Ray actors that outlive a worker group), and a
    # restarted or resized group resumes from there when it is at least as new as the newest storage commit: a
    # lost node costs at most K steps. Unset: 5 for an elastic Ray run (parallel.num_workers = [min, max]), else 0
    # (off; set it with ray.max_failures > 0 for a fixed-size run). Needs Ray (not --local or torchrun).
    memory_every: int | None = None

    def check(self, where: str) -> None:
        one_of(f"{where}.on_nonfinite", self.on_nonfinite, ("skip", "rollback", "stop"))
        not_negative(where, self, "every", "max_rollbacks", "failures_per_worker_hour")
        if self.memory_every is not None and self.memory_every < 0:
            raise ConfigError(f"{where}.memory_every = {self.memory_every} must be a number of steps >= 0 (0 = no "
                              "peer memory; leave it out for the default)")
        if self.failure_detect_s is not None and not 0 <= self.failure_detect_s < float("inf"):
            raise ConfigError(f"{where}.failure_detect_s = {self.failure_detect_s} must be a number of seconds >= 0 "
                              "(leave it out for Ray's own detection of a lost node)")
        if not 0 <= self.background_nice <= 19:
            raise ConfigError(f"{where}.background_nice = {self.background_nice} must be within 0..19 (nice steps "
                              "below the training thread; 0 = the same priority)")
        if self.keep < 2:
            raise ConfigError(f"{where}.keep = {self.keep} must be at least 2: a save replaces the oldest commit "
                              "only after it has committed itself, and a rollback may need the commit before the "
                              "newest")
        if self.resume == "":
            raise ConfigError(f'{where}.resume is empty; use "auto", "none" or the URI of a checkpoint step directory')
