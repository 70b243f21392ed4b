"""The ``[ray]`` config section: where and how a run launches on Ray Train (the cluster, placement, restarts,
the worker-group waits and elastic resizing); each key checked here, naming it (trainer/config.py holds the
others)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .configtree import not_negative, one_of, positive


@dataclass
class RaySection:
    address: str = ""  # "" starts (or joins) a local cluster; "auto" or ray://... joins an existing one
    storage_path: str = ""  # Ray Train run storage (absolute path or fsspec URI); "" = RUN_DIR/ray
    placement_strategy: str = "PACK"  # PACK, STRICT_PACK, SPREAD, STRICT_SPREAD
    label_selector: dict[str, str] = field(default_factory=dict)  # e.g. {"zone" = "us-east-1a"}
    accelerator_type: str = ""
    log_level: str = "WARNING"  # Ray Train's own console lines (INFO: resources, every rank's reports, ...)
    # Ray Train restarts the whole worker group this many times after a worker dies; the restarted workers resume
    # from the last committed checkpoint (checkpoint.resume = "auto"). 0 = a failed worker fails the run.
    max_failures: int = 0
    # how long a worker group may wait for its placement (all workers' resources at once) before the run fails
    # with a named reason; Ray Train's own default retries such a group forever. Raise it on an autoscaling
    # cluster, where nodes take minutes to join.
    start_timeout_s: float = 120.0
    # how often Ray Train's controller polls the workers. Each ray.train.report (a commit's pointer, an
    # evaluation's metrics, the final results) is taken from a worker at one poll, so at Ray's default (2 s) a
    # run's reports queue up and its end waits about 2 s per report still queued (14 s of a 16-step demo). One
    # status call per worker per interval: raise it for runs of hundreds of workers.
    health_check_interval_s: float = 0.5
    # Elastic runs (parallel.num_workers = [min, max]; trainer/cluster/elastic.py). The placement wait of each
    # worker-group start, instead of start_timeout_s: Ray Train sizes an elastic group from the resources it saw
    # reserved, so a group that is not placed within seconds was sized on a stale view (a node just lost), and Ray
    # Train retries at the size it then sees
    elastic_start_timeout_s: float = 5.0
    # how often Ray Train considers growing a healthy elastic group onto nodes that joined (Ray's
    # elastic_resize_monitor_interval_s, 60 s by default); a grow restarts the group from the newest commit
    resize_interval_s: float = 5.0
    # how often the driver polls Ray's node table for nodes lost or joined, telling Ray Train's resource view at
    # once (otherwise re-read every 20 s) and timing each resize for the account; 0 = no watch, and no wait for
    # the node table after a node loss (Ray's view alone: trainer/cluster/elastic.py)
    node_poll_s: float = 0.5

    def check(self, where: str) -> None:
        one_of(f"{where}.placement_strategy", self.placement_strategy,
                ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"))
        one_of(f"{where}.log_level", self.log_level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        not_negative(where, self, "max_failures")
        positive(where, self, "start_timeout_s")
        positive(where, self, "health_check_interval_s")
        positive(where, self, "elastic_start_timeout_s")
        not_negative(where, self, "resize_interval_s", "node_poll_s")
