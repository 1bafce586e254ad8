"""Test setup: eight simulated CPU devices and a persistent compilation cache, configured before JAX starts.

The cache folder is made fresh under the system's temp dir for each pytest session (and removed at its
end), so runs stay independent while the many tests that compile the same step (the CLI runs, the
multi-process jobs, which inherit the environment) compile it once. Under pytest-xdist the workers inherit
the controller's environment and share its folder; only the process that made it removes it.
"""

import os
import subprocess
import sys
import tempfile


def _xla_accepts(flag: str) -> bool:
    """Whether this JAX's XLA starts with ``flag`` in XLA_FLAGS (a child process: an unknown flag aborts)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


# Eight simulated devices, and the CPU backend's code generation at its cheapest: the suite's programs are
# tiny, so its time is almost all compiling. LLVM's optimisation passes were most of that (about a quarter less
# CPU time on the pipeline tests at optimisation level 0), and of what is left, most went to XLA:CPU's newer
# MLIR fusion emitters: the older elemental emitter compiles in about half the CPU time (the whole suite about
# 3,180 -> 2,030 CPU s; a 1F1B test step's compile 26 -> 6 s). XLA's HLO passes and the partitioner run as in a
# default build, so the collectives are a default build's; compiled temporaries can differ by a few KiB (that
# step's 6.56 -> 6.55 MiB); arithmetic is IEEE float32 either way (no fast math), with fused sums possibly in
# another order (`tests/_codegen.py` for the checks bounded by a default build's rounding). Subprocesses (CLI
# runs, multi-process jobs) inherit the flags.
_TEST_XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
# A flag a JAX release no longer knows stops the process at start-up (XLA refuses unknown flags), so this one
# is tried in a child first, once per session: xdist workers inherit the controller's XLA_FLAGS, which hold the
# flag exactly where the child accepted it, so they do not try again.
_OPTIONAL_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in _TEST_XLA_FLAGS:
    if _flag.split("=")[0] not in _flags:
        _flags = f"{_flags} {_flag}".strip()
for _flag in _OPTIONAL_XLA_FLAGS:
    if _flag.split("=")[0] not in _flags and "PYTEST_XDIST_WORKER" not in os.environ and _xla_accepts(_flag):
        _flags = f"{_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_OWN_CACHE = "PYTEST_XDIST_WORKER" not in os.environ or "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshwork-jax-cache-")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import shutil  # noqa: E402
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


# The longest modules, longest first (CPU seconds per module, measured module by module on 2 cores; the
# multi-process ones also keep a second core busy). Under `--dist loadfile` pytest-xdist hands out whole
# modules in collection order once its reordering by test count is off (`pytest_configure`); by count, the
# multi-process module (4 tests, over 2 minutes) came last, and one worker ran it alone for a minute after the
# other had finished. Longest first, the many short modules fill in at the end and both workers finish
# together. A module missing here runs after these, in collection order: list a new one that takes more than
# about 20 s. The order changes nothing else: which modules share a worker was never fixed.
_LONGEST_FIRST = (
    "test_pipeline.py",
    "test_multiprocess.py",
    "test_context_parallel.py",
    "test_pipeline_1f1b.py",
    "test_hetero.py",
    "test_launch.py",
    "test_planner.py",
    "test_train.py",
    "test_moe.py",
    "test_faults.py",
    "test_run_folder.py",
    "test_pipeline_zb.py",
    # measured 2026-12-07 (CPU s, one process): these ran after every listed module, in name order, so the
    # last of them (test_zero.py) could keep one worker busy after the other had run out of modules
    "test_sequence_parallel.py",  # 54
    "test_lora.py",  # 48
    "test_cuda_lowering.py",  # 44
    "test_zero.py",  # 36
    "test_activation_memory.py",  # 27
    "test_flash_attention.py",
    "test_ring_attention.py",
    "test_configfile.py",
    "test_hf_runs.py",
    "test_output.py",
    "test_stage_speeds.py",
    "test_costmodel.py",
    "test_model.py",
    "test_hf.py",
    "test_data.py",
    "test_verify.py",
    "test_records.py",
    "test_optimizers.py",
    "test_generate.py",
    "test_lost_process.py",
    "test_divergence.py",
    "test_step_update.py",
    "test_agreement.py",  # 19
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the collection order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
