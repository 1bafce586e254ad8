"""meshwork against MaxText, side by side: same machine, same JAX, same model, same mesh.

Creates, if missing, a virtual environment (Python >= 3.12, from ``--python`` or
``$MESHWORK_PEER_PYTHON``, default ``python3.12``) holding ``maxtext[tpu]==0.2.5`` (the
``tpu`` extra only brings its dependencies; with ``JAX_PLATFORMS=cpu`` it runs on
CPU) and meshwork installed into the same environment, so both use one JAX. Then,
for each configuration, it alternates the two frameworks run by run (A B A B ...,
``--pairs`` pairs) on 8 simulated CPU devices, reads each run's per-step times from
step 3 on (earlier steps include compilation, and MaxText's asynchronous dispatch
makes them misleading), and reports each configuration's median ratio of
meshwork's tokens/s to MaxText's.

Both frameworks train on synthetic tokens with bfloat16 compute and float32
weights, scanned layers, untied embeddings, no dropout. MaxText runs with its
defaults otherwise (``remat_policy=full``); meshwork with its own defaults
(``--logits auto``) and the remat policy and attention given per configuration (`CONFIGS`),
and the table states both.

Before each run the script waits until no other process uses a CPU heavily
(``--quiet-wait``), so that the two frameworks see the same machine.

    python bench/peer_maxtext.py                       # all configurations, 3 pairs
    python bench/peer_maxtext.py --configs base-fsdp8 --pairs 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAXTEXT = "maxtext[tpu]==0.2.5"
DEFAULT_VENV = ROOT / ".peer-venv"

# name -> (model dims, mesh, steps, meshwork remat, meshwork attention); dims are MaxText's names, translated for meshwork
# below. The large configuration costs tens of seconds per step on a 2-core CPU: fewer steps.
BASE = dict(
    base_emb_dim=256,
    base_num_decoder_layers=4,
    base_num_query_heads=4,
    base_num_kv_heads=4,
    head_dim=64,
    base_mlp_dim=1024,
    vocab_size=32000,
    max_target_length=512,
    per_device_batch_size=1,
)
LARGE = dict(
    base_emb_dim=512,
    base_num_decoder_layers=8,
    base_num_query_heads=8,
    base_num_kv_heads=8,
    head_dim=64,
    base_mlp_dim=2048,
    vocab_size=32000,
    max_target_length=1024,
    per_device_batch_size=1,
)
CONFIGS = {
    "base-fsdp8": (BASE, {"fsdp": 8}, 10, "full", "reference"),
    "base-fsdp4-tensor2": (BASE, {"fsdp": 4, "tensor": 2}, 10, "full", "reference"),
    # At length 1024 on CPU, jax.nn.dot_product_attention's XLA path is 19% faster than our reference
    # (bench/RESULTS.md); MaxText also runs its own dot-product attention here.
    "large-fsdp8": (LARGE, {"fsdp": 8}, 7, "full", "dot_product"),
}
DEVICES = 8
SKIP = 3  # steps 0, 1, 2 (MaxText numbering) / 1, 2, 3 (meshwork) are left out: the median is over steps 3+
MAXTEXT_SETTINGS = "remat_policy=full, scan_layers, bf16 compute / f32 weights, attention autoselected (dot_product)"


def ensure_venv(venv: Path, python: str) -> Path:
    """The venv's python, creating the venv with MaxText and meshwork if missing."""
    py = venv / "bin" / "python"
    marker = venv / ".meshwork-peer-ready"
    if marker.exists():
        return py
    exe = shutil.which(python) or python
    version = subprocess.run(
        [exe, "-c", "import sys; print(sys.version_info[:2] >= (3, 12))"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYENV_VERSION="3.12.1"),
    )
    if version.stdout.strip() != "True":
        raise SystemExit(f"--python {python}: MaxText 0.2.5 needs Python >= 3.12 (e.g. --python python3.12)")
    print(f"creating {venv} with {MAXTEXT} and meshwork (a few minutes)", flush=True)
    subprocess.run([exe, "-m", "venv", str(venv)], check=True, env=dict(os.environ, PYENV_VERSION="3.12.1"))
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", MAXTEXT, "-e", str(ROOT)], check=True
    )
    marker.write_text("ok\n")
    return py


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
        PYTHONUNBUFFERED="1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    return env


def _meshwork_settings(remat: str, attention: str) -> str:
    return f"--remat {remat}, --logits auto, --attention {attention}, bf16 compute / f32 weights"


def run_meshwork(py: Path, dims: dict, mesh: dict, steps: int, remat: str, attention: str) -> dict:
    sets = {
        "vocab_size": dims["vocab_size"],
        "embed_dim": dims["base_emb_dim"],
        "num_layers": dims["base_num_decoder_layers"],
        "num_heads": dims["base_num_query_heads"],
        "num_kv_heads": dims["base_num_kv_heads"],
        "head_dim": dims["head_dim"],
        "mlp_dim": dims["base_mlp_dim"],
    }
    command = [
        str(py),
        str(ROOT / "bench" / "throughput.py"),
        "--json",
        "--model",
        "test",
        "--mesh",
        ",".join(f"{k}={v}" for k, v in mesh.items()),
        "--batch-size",
        str(dims["per_device_batch_size"] * DEVICES),
        "--seq-len",
        str(dims["max_target_length"]),
        "--dtype",
        "bfloat16",
        "--remat",
        remat,
        "--attention",
        attention,
        "--steps",
        str(steps),
        "--skip",
        str(SKIP),
    ]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    out = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"meshwork failed:\n{out.stdout}\n{out.stderr}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "tokens_per_s": result["tokens_per_s"],
        "step_time": result["median_step_time"],
        "jax": result["jax"],
        "step_times": result["step_times"],
        "loss_layout": result["loss_layout"],
    }


def run_maxtext(py: Path, dims: dict, mesh: dict, workdir: Path, steps: int) -> dict:

    config = subprocess.run(
        [
            str(py),
            "-c",
            "import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))",
        ],
        capture_output=True,
        text=True,
        env=_env(),
    ).stdout.strip()
    overrides = {
        **dims,
        "ici_fsdp_parallelism": mesh.get("fsdp", 1),
        "ici_tensor_parallelism": mesh.get("tensor", 1),
        "dataset_type": "synthetic",
        "steps": steps,
        "enable_checkpointing": "false",
        "dtype": "bfloat16",
        "weight_dtype": "float32",
        "remat_policy": "full",
        "scan_layers": "true",
        "dropout_rate": 0.0,
        "run_name": "peer",
        "base_output_directory": str(workdir),
    }
    command = [str(py), "-m", "maxtext.trainers.pre_train.train", config, *(f"{k}={v}" for k, v in overrides.items())]
    out = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=workdir)
    text = out.stdout + out.stderr
    times = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"completed step: (\d+), seconds: ([\d.]+)", text)}
    if out.returncode or len(times) < steps:
        raise SystemExit(f"MaxText failed ({out.returncode}):\n{text[-4000:]}")
    step_time = statistics.median(t for s, t in times.items() if s >= SKIP)
    tokens = dims["per_device_batch_size"] * DEVICES * dims["max_target_length"]
    return {"tokens_per_s": tokens / step_time, "step_time": step_time, "step_times": [times[k] for k in sorted(times)]}


def _busy_processes(threshold: float = 20.0) -> list[str]:
    """Other processes using more than ``threshold`` percent of a CPU (not this script or its children)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,pcpu=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines() if len(line.split(None, 3)) == 4]
    ours, parents = {os.getpid()}, {int(r[0]): int(r[1]) for r in rows}
    busy = []
    for pid, _, cpu, args in rows:
        chain, p = set(), int(pid)
        while p in parents and p not in chain and p > 1:
            chain.add(p)
            p = parents[p]
        if not chain & ours and float(cpu) > threshold and not args.startswith(("ps ", "[")):
            busy.append(f"{pid} {cpu}% {args[:80]}")
    return busy


def wait_for_quiet(limit_s: float) -> str:
    """Waits (up to ``limit_s``) until no other process is busy; returns the 1-minute load average then."""
    start = time.time()
    while (busy := _busy_processes()) and time.time() - start < limit_s:
        print(f"waiting for other processes to finish: {busy}", flush=True)
        time.sleep(20)
    if busy:
        print(f"still busy after {limit_s:.0f} s, measuring anyway: {busy}", flush=True)
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--python",
        default=os.environ.get("MESHWORK_PEER_PYTHON", "python3.12"),
        help="interpreter (>= 3.12) for the shared venv; or set $MESHWORK_PEER_PYTHON",
    )
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the shared virtual environment")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--pairs", type=int, default=3, help="A B pairs per configuration")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=900.0,
        help="seconds to wait, before each run, for other busy processes to finish",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--json-out", type=Path, default=None, help="also write every run's figures here")
    args = parser.parse_args()
    py = ensure_venv(args.venv, args.python)
    lines, record = [], []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            dims, mesh, steps, remat, attention = CONFIGS[name]
            ratios, ours, theirs = [], [], []
            for pair in range(args.pairs):
                load_a = wait_for_quiet(args.quiet_wait)
                a = run_meshwork(py, dims, mesh, steps, remat, attention)
                load_b = wait_for_quiet(args.quiet_wait)
                b = run_maxtext(py, dims, mesh, Path(tmp), steps)
                ours.append(a["tokens_per_s"])
                theirs.append(b["tokens_per_s"])
                ratios.append(a["tokens_per_s"] / b["tokens_per_s"])
                record.append(
                    {"config": name, "pair": pair + 1, "meshwork": a, "maxtext": b, "load_before": [load_a, load_b]}
                )
                print(
                    f"{name} pair {pair + 1}: meshwork {a['tokens_per_s']:,.0f} tok/s ({a['step_time']:.3f} s, "
                    f"load {load_a}), MaxText {b['tokens_per_s']:,.0f} tok/s ({b['step_time']:.3f} s, load {load_b}), "
                    f"ratio {ratios[-1]:.3f}",
                    flush=True,
                )
            lines.append(
                f"| {name} | {','.join(f'{k}={v}' for k, v in mesh.items())} | {steps} | "
                f"{_meshwork_settings(remat, attention)} (loss: {a['loss_layout']}) | "
                f"{statistics.median(ours):,.0f} | {statistics.median(theirs):,.0f} | "
                f"{', '.join(f'{r:.3f}' for r in ratios)} | **{statistics.median(ratios):.3f}** |"
            )
    header = (
        f"JAX {a['jax']}, {platform.processor() or platform.machine()}, {DEVICES} simulated CPU devices, "
        f"{datetime.date.today().isoformat()}; median step time over steps {SKIP}+ of each run; "
        f"`python bench/peer_maxtext.py --pairs {args.pairs}` ({(time.time() - started) / 60:.0f} min). "
        f"MaxText: {MAXTEXT_SETTINGS}.\n\n"
        f"| configuration | mesh | steps per run | meshwork settings | meshwork tok/s (median) | "
        f"MaxText tok/s (median) | ratio per pair | median ratio |\n|---|---|---:|---|---:|---:|---|---:|"
    )
    table = header + "\n" + "\n".join(lines)
    print("\n" + table)
    if args.out:
        args.out.write_text(table + "\n")
    if args.json_out:
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
