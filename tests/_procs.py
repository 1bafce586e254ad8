"""Helpers for tests that run ``python -m train.train`` in separate processes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def clean_env(**extra) -> dict[str, str]:
    """The environment for a child trainer: CPU only, device count left to --cpu-devices.

    The suite's other XLA flags (the conftest's fast code generation) are kept.
    """
    env = dict(os.environ)
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, **env) -> subprocess.Popen:
    """Starts a trainer with stdout and stderr going to ``log``."""
    handle = open(log, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "train.train", *args],
        cwd=ROOT,
        env=clean_env(**env),
        stdout=handle,
        stderr=subprocess.STDOUT,
    )


def run(args: list[str], log: Path, timeout: float = 300, **env) -> int:
    process = start(args, log, **env)
    try:
        return process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()


def wait_for_line(log: Path, pattern: str, process: subprocess.Popen, timeout: float = 240) -> re.Match:
    """Polls ``log`` until a line matches ``pattern``; fails if the process ends first."""
    deadline = time.monotonic() + timeout
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            match = regex.search(line)
            if match:
                return match
        if process.poll() is not None:
            raise AssertionError(f"process ended ({process.returncode}) before {pattern!r}:\n{log.read_text()}")
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"timed out waiting for {pattern!r}:\n{log.read_text()}")


def losses(run_dir: Path, key: str = "train/loss") -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if key in record:
            out[record["step"]] = record[key]
    return out
