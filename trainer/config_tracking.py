"""The ``[tracking]`` config section: where a run is recorded in MLflow (launch/tracking.py does the recording),
each key checked here, naming it. Checked without importing MLflow: whether it is installed is asked by the
driver before Ray starts."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dutycycle.engine.errors import ConfigError

# MLflow's own limits on a tag key (mlflow.utils.validation): letters, digits and _ - . / space, at most 250
_TAG_KEY = re.compile(r"^[\w\-./ ]{1,250}$")


@dataclass
class TrackingSection:
    # "" = no tracking. A local directory (a SQLite database DIR/mlflow.db with the artifacts in DIR/artifacts;
    # no server: `mlflow ui --backend-store-uri sqlite:///DIR/mlflow.db`), a "sqlite:///path.db" file, or any
    # tracking URI MLflow takes (http(s)://, databricks, postgresql://, ...). Needs the `tracking` extra.
    mlflow_uri: str = ""
    experiment: str = ""  # the MLflow experiment (created when missing); "" = run.name
    run_name: str = ""  # the MLflow run's name; "" = the run directory's last path component
    # where a *new* experiment keeps its artifacts (any URI MLflow takes); "" = the store's default (DIR/artifacts
    # for a local directory)
    artifact_location: str = ""
    tags: dict[str, str] = field(default_factory=dict)  # extra tags on the MLflow run, e.g. {team = "vision"}
    # upload RUN_DIR/model.safetensors as the run's "model/" artifact (off: the summary still names its path)
    log_model: bool = True

    def check(self, where: str) -> None:
        if self.mlflow_uri != self.mlflow_uri.strip():
            raise ConfigError(f"{where}.mlflow_uri = {self.mlflow_uri!r} has surrounding spaces; remove them")
        if self.mlflow_uri.startswith("sqlite:") and not self.mlflow_uri.startswith("sqlite:///"):
            raise ConfigError(f"{where}.mlflow_uri = {self.mlflow_uri!r} is not a SQLite URI MLflow reads; write "
                              "sqlite:///relative/path.db or sqlite:////absolute/path.db")
        for key in self.tags:
            if not _TAG_KEY.match(key):
                raise ConfigError(f"{where}.tags key {key!r} is not an MLflow tag key (letters, digits, _ - . / "
                                  "and spaces, up to 250 characters)")
