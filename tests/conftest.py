"""Test setup: eight simulated CPU devices, configured before JAX starts its backend."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
from pathlib import Path  # noqa: E402

# bench/costmodel_grid.py: the cost-model grid the tests and the bench share.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """About 1 MB of real text: a slice of the standard library's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    folder = tmp_path_factory.mktemp("corpus")
    for path in sorted(root.glob("*.py"))[:60]:
        shutil.copy(path, folder / path.name)
    return folder


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A tokenized-corpus cache shared by the session's runs."""
    return tmp_path_factory.mktemp("cache")
