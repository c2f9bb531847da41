"""Shared integration fixtures: one local Ray instance per test session (2 CPUs, no dashboard).

Use it by naming the fixture: `def test_x(ray_session): ...`. Actors must be killed by the test that made them; the
instance is shut down once, at the end of the session.
"""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
