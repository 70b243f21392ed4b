"""The loader tests' shared cache: 203 samples of distinct pixels in 4 shards, train and val splits."""

from __future__ import annotations

import pytest

from ..support.cachemaker import make_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("loader") / "cache")
    make_cache(uri, 203, shape=(8, 8, 3), shards=4, splits={"train": 0.8, "val": 0.2})
    return uri
