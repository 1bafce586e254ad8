"""The one prepared check for when a GPU is lent: correctness, attention speed, a short training run, one JSON.

Three parts, each within its share of ``--budget`` seconds (default 450, inside the 8 minutes one H100 is lent
for), each recorded in the JSON file even when it fails:

1. **Kernels against the reference.** Every attention kernel of the registry that runs on one device
   (`models.attention_registry.KERNELS`; the context-parallel ones are flash on one device) runs through its
   wrapper with the GPU path (Triton for ``flash``, cuDNN's custom call for ``cudnn``) on ``[2, 1024, 8, 128]``
   queries with 2 KV heads, causal, two packed documents, in float32 and bfloat16 (``cudnn``: bfloat16 only),
   output and the three gradients against `models.attention_reference.reference_attention` in float32: the
   largest error relative to the reference's largest magnitude.
2. **Attention speed.** ``flash``, ``cudnn`` and, if installed, tokamax (``tokamax.dot_product_attention``) at
   4k-32k tokens (batch 1, causal, 32 query heads, 8 KV heads, head_dim 128, bfloat16), forward plus backward:
   the median of ``--repeats`` timed calls, and TFLOP/s counted as FlashAttention-2 does (forward
   ``4 T^2 N H / 2`` causal, the backward 2.5 times it; Dao 2023).
3. **Training.** ``--model small`` for ``--steps`` (20) steps through `bench/throughput.py` (the real train
   step, synthetic tokens, bfloat16, flash), its MFU beside the cost model's prediction for this device kind
   (`sharding.costmodel`: the same layout priced on the kind's datasheet and fitted efficiency).

    python bench/gpu_check.py                    # on the GPU machine: writes gpu_check.json
    python bench/gpu_check.py --out check.json --lengths 4096,8192
On a machine without a GPU it says so and exits 1 before anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from models import attention_registry as registry  # noqa: E402
from models.attention_kernels import wrapper  # noqa: E402
from models.attention_reference import reference_attention  # noqa: E402
from models.config import get_config  # noqa: E402
from sharding import costmodel as cm  # noqa: E402
from sharding.devices.kinds import kind_from_device_kind_string  # noqa: E402
from sharding.parallel import CONTIGUOUS, UNSHARDED  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON file written")
    p.add_argument("--lengths", default="4096,8192,16384,32768", help="tokens per sequence timed")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per kernel and length (median)")
    p.add_argument("--model", default="small", help="the preset trained")
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--seq-len", type=int, default=2048, help="training sequence length")
    p.add_argument("--batch-size", type=int, default=8, help="training batch in sequences")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole script")
    return p.parse_args(argv)


def _inputs(dtype, length=1024, batch=2, heads=8, kv_heads=2, head_dim=128):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), jnp.float32)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    segments = jnp.asarray(np.repeat([1, 2], length // 2)[None].repeat(batch, 0), jnp.int32)
    return [x.astype(dtype) for x in (q, k, v)], d_out, segments


def check_kernels() -> list[dict]:
    """Every one-device kernel's output and gradients against the float32 reference (part 1)."""
    rows = []
    for record in registry.KERNELS:
        for dtype in ("float32", "bfloat16"):
            if record.dtypes and dtype not in record.dtypes:
                continue
            (q, k, v), d_out, seg = _inputs(jnp.dtype(dtype))
            run = wrapper(record)

            def loss(q, k, v, run=run):
                out = run(q, k, v, seg, causal=True, layout=CONTIGUOUS, par=UNSHARDED).astype(jnp.float32)
                return jnp.sum(out * d_out), out

            def want(q, k, v):
                out = reference_attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
                return jnp.sum(out * d_out), out

            row = {"kernel": record.name, "dtype": dtype}
            try:
                grad = lambda f, *x: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(*x)
                (_, got), got_grads = grad(loss, q, k, v)
                (_, ref), ref_grads = grad(want, *(x.astype(jnp.float32) for x in (q, k, v)))
                for name, a, b in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (ref, *ref_grads)):
                    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                    row[name] = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
            except Exception as e:  # a kernel that fails here is a finding, not the end of the check
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _tokamax():
    """``tokamax.dot_product_attention`` if tokamax is installed, else None."""
    try:
        import tokamax  # optional: not a dependency (JAX >= 0.11, Python >= 3.12)
    except ImportError:
        return None
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True)


def time_attention(lengths: list[int], repeats: int, deadline: float) -> list[dict]:
    """Forward + backward time and TFLOP/s of flash, cuDNN and tokamax (part 2)."""
    heads, kv_heads, head_dim = 32, 8, 128
    runs = {name: wrapper(registry.kernel(name)) for name in ("flash", "cudnn")}
    candidates = {
        n: (lambda r: lambda q, k, v: r(q, k, v, None, causal=True, layout=CONTIGUOUS, par=UNSHARDED))(r)
        for n, r in runs.items()
    }
    if (tk := _tokamax()) is not None:
        candidates["tokamax"] = tk
    rows = []
    for length in lengths:
        shape_q, shape_kv = (1, length, heads, head_dim), (1, length, kv_heads, head_dim)
        q = jnp.ones(shape_q, jnp.bfloat16)
        kv = jnp.ones(shape_kv, jnp.bfloat16)
        flops = 4 * length * length * heads * head_dim / 2 * 3.5  # causal; backward 2.5x the forward
        for name, fn in candidates.items():
            row = {"kernel": name, "tokens": length}
            if time.monotonic() > deadline:
                row["error"] = "skipped: out of time"
                rows.append(row)
                continue
            try:
                step = jax.jit(
                    jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
                )
                jax.block_until_ready(step(q, kv, kv))
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    jax.block_until_ready(step(q, kv, kv))
                    times.append(time.perf_counter() - t0)
                seconds = statistics.median(times)
                row.update(seconds=seconds, tflops=flops / seconds / 1e12)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def train(args, limit_s: float) -> dict:
    """``--model`` for ``--steps`` steps through bench/throughput.py, MFU beside the cost model's (part 3)."""
    command = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--json", "--model", args.model]
    command += ["--mesh", "fsdp=-1", "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    command += ["--dtype", "bfloat16", "--attention", "flash", "--steps", str(args.steps), "--skip", "5"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=limit_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {limit_s:.0f} s"}
    if out.returncode:
        return {"error": (out.stdout + out.stderr)[-3000:]}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    device = jax.devices()[0]
    kind = kind_from_device_kind_string(device.device_kind)
    if kind is not None:
        config = get_config(args.model, ["dtype=bfloat16", "attention=flash"])
        devices = jax.device_count()
        layout = cm.Layout({"fsdp": devices}, "fsdp_tp", 1, config.remat, attention="flash")
        cost = cm.estimate(config, args.batch_size, args.seq_len, layout)
        hw = cm.hardware_for(kind, devices, 0.0)
        seconds = cm.step_time(cost, hw, {}).total
        tokens_per_s = args.batch_size * args.seq_len / seconds
        result["predicted_step_s"] = seconds
        result["predicted_mfu"] = tokens_per_s * config.flops_per_token(args.seq_len) / (kind.peak_bf16_flops * devices)
    return result


def main(argv=None) -> int:
    args = parse(argv)
    platforms = {d.platform for d in jax.devices()}
    if platforms != {"gpu"}:
        print(
            f"gpu_check: no GPU here (JAX sees {', '.join(sorted(platforms))} devices); run it on a GPU machine",
            file=sys.stderr,
        )
        return 1
    deadline = time.monotonic() + args.budget
    report = {
        "jax": jax.__version__,
        "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for part, run in (
        ("kernels", check_kernels),
        (
            "attention_speed",
            lambda: time_attention(
                [int(x) for x in args.lengths.split(",")], args.repeats, deadline - 0.4 * args.budget
            ),
        ),
        ("train", lambda: train(args, max(30.0, deadline - time.monotonic()))),
    ):
        try:
            report[part] = run()
        except Exception:  # keep what the other parts found
            report[part] = {"error": traceback.format_exc()[-3000:]}
        args.out.write_text(json.dumps(report, indent=1))
    train_row = report.get("train", {})
    if "mfu" in train_row:
        predicted = train_row.get("predicted_mfu")
        print(
            f"{args.model}: MFU {train_row['mfu']:.1%} (cost model {'n/a' if predicted is None else f'{predicted:.1%}'})"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
