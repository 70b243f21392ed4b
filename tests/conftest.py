"""Shared fixtures: a local Ray cluster, a local S3-compatible server, generated data only."""

from __future__ import annotations

import os
import tempfile

import pytest
from dutycycle.trainer.cluster.local import start_local_ray

from .support.objectstore import moto_server

# Tests never reach the network: keep Ray and Daft from phoning home.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("DAFT_ANALYTICS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# Every Ray start in the tests (and in their subprocesses) makes its own cluster, never joins one that another
# process left running on this machine (ray.init() with no address would).
os.environ["RAY_ADDRESS"] = "local"  # subprocesses started by tests inherit it
# Node-local cache state (verified-shard records, node copies of remote shards, the memory ledger) goes to a
# folder of this test session, shared with the processes it starts, never the machine's default one.
os.environ.setdefault("DUTYCYCLE_NODE_DIR", tempfile.mkdtemp(prefix="dc-node-"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster with 2 CPUs and a small object store, shut down after the session."""
    import ray

    start_local_ray(num_cpus=2, object_store_bytes=256 * 1024**2)  # a cluster of its own, never one found here
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 (free port); yields the endpoint URL."""
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """Point s3fs and Daft at the local server through the AWS env vars; yields a fresh bucket URI."""
    import uuid

    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"dc-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.mkdir(bucket)
    s3fs.S3FileSystem.clear_instance_cache()
    yield f"s3://{bucket}"
    s3fs.S3FileSystem.clear_instance_cache()


def pytest_collection_modifyitems(items):
    """A test that uses the session's Ray cluster is marked ``ray`` (``-m "not ray"`` leaves it out); tests that
    start a cluster of their own, in a subprocess, carry the mark by hand."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
