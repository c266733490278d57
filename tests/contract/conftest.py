import pytest


@pytest.fixture(scope="session", autouse=True)
def _servers(cluster_servers):
    """Every contract test may need the cluster servers (tests/conftest.py)."""
    yield
