import os

import pytest


@pytest.fixture
def nvme_dir(tmp_path):
    """A directory on a file system that takes O_DIRECT (tmp_path is on disk here)."""
    d = tmp_path / "nvme"
    d.mkdir()
    return str(d)


def blobs(n, size, seed=0):
    rnd = __import__("random").Random(seed)
    return [bytes(rnd.getrandbits(8) for _ in range(64)) * (size // 64) + os.urandom(size % 64) for _ in range(n)]
