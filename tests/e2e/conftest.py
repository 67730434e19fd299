"""``cache``: for the RL-loop tests of this folder, a module's tiny models in a cache of its own,
and no Ray left behind."""

import os

import pytest


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    os.environ["HYBRIDFLOW_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    import ray
    if ray.is_initialized():
        ray.shutdown()
