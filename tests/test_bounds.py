"""Values without a sensible bound are refused at once, in one line naming the flag and a value that works."""

import math

import pytest
from _cli_errors import raises_as_cli

from models.generation import Sampling
from train import generate, hf, train
from train.launcher.distributed import MAX_CPU_DEVICES, check_cpu_devices


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cpu_devices_is_bounded_by_a_count_and_by_host_memory():
    check_cpu_devices(8, available=16 * 2**30)
    check_cpu_devices(MAX_CPU_DEVICES, available=2**40)  # plenty of memory: the count bounds
    with pytest.raises(
        ValueError,
        match=rf"^--cpu-devices 100000: at most {MAX_CPU_DEVICES} simulated CPU devices; "
        r"this host has 64\.0 GiB available, at least 4 MiB per device, "
        r"e\.g\. --cpu-devices 8$",
    ):
        check_cpu_devices(100_000, available=64 * 2**30)
    with pytest.raises(
        ValueError,
        match=r"^--cpu-devices 32: at most 16 simulated CPU devices; this host has "
        r"0\.1 GiB available",
    ):
        check_cpu_devices(32, available=64 * 2**20)  # 64 MiB / 4 MiB per device
    with pytest.raises(ValueError, match=r"^--cpu-devices 0: must be positive"):
        check_cpu_devices(0)


def test_a_huge_cpu_device_count_is_refused_before_jax_grows(tmp_path, capsys):
    code = train.main(["--model", "test", "--cpu-devices", "100000", "--steps", "1", "--run-dir", str(tmp_path / "r")])
    assert code == 2
    line = one_error_line(capsys)
    assert line.startswith("error: --cpu-devices 100000: at most ") and line.endswith("e.g. --cpu-devices 8")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_temperature_must_be_finite_and_not_negative(value):
    with raises_as_cli(ValueError, match=rf"^--temperature {value}: must be a finite number >= 0 \(0 is greedy\)"):
        Sampling(temperature=value)


def test_generate_refuses_temperature_nan_in_one_line(tmp_path, capsys):
    code = generate.main(["--run-dir", str(tmp_path / "none"), "--prompt", "a", "--temperature", "nan"])
    assert code == 2
    assert one_error_line(capsys).startswith("error: --temperature nan: must be a finite number >= 0")


@pytest.mark.parametrize("size", ["0", "abc", "0GB", "nan"])
def test_export_refuses_a_shard_size_that_is_not_bytes(tmp_path, capsys, size):
    code = hf.main(["export", str(tmp_path / "none"), "--out", str(tmp_path / "out"), "--max-shard-size", size])
    assert code == 2
    line = one_error_line(capsys)
    assert line == f"error: --max-shard-size {size!r}: expected bytes > 0, e.g. --max-shard-size 2GB", line
    assert "--device-memory" not in line and not (tmp_path / "out").exists()
