"""GPU correctness check of the compiled (non-interpret) flash attention kernel.

For a few shapes (causal and not, grouped- and multi-query, packed segments, odd lengths,
float32 and bfloat16) compares the forward output and dq, dk, dv (random cotangent) of
`flash_attention(..., interpret=False)` against `flash_attention_reference` run in float32 on
the same (dtype-rounded) inputs, and prints a PASS/FAIL table with the max errors relative to
max |reference|. Each case is caught separately, so one failure does not hide the others.
Exit status 1 if any case fails. Runs in well under 2 minutes on one H200.

Usage: `python bench/gpu_flash_check.py` (needs a GPU backend); `--interpret` runs the same
cases through the Pallas interpreter (a slow dry run of the script on CPU).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from models.kernels.flash_attention import (  # noqa: E402
    flash_attention,
    flash_attention_reference,
)
from models.kernels.flash_blocks import BlockSizes  # noqa: E402

# (name, batch, q_length, kv_length, heads, kv_heads, head_dim, causal, segments, dtype, blocks)
# float32 kernels use IEEE (non-tensor-core) dots, which Triton compiles slowly (~40 s for a
# head_dim 128 case on an H200), so most float32 cases use head_dim <= 64 and small tiles.
B16 = BlockSizes(16, 16, 16, 16, 16, 16)
B32 = BlockSizes(32, 32, 32, 32, 32, 32)
CASES = [
    ("f32 causal gqa segments", 1, 384, 384, 4, 2, 128, True, True, "float32", None),
    ("f32 causal mqa T<S odd", 1, 200, 500, 4, 1, 64, True, False, "float32", B32),
    ("f32 causal T>S h40 segs", 1, 130, 70, 4, 2, 40, True, True, "float32", B16),
    ("bf16 causal gqa", 2, 2048, 2048, 8, 2, 128, True, False, "bfloat16", None),
    ("bf16 mha", 1, 1024, 1024, 8, 8, 128, False, False, "bfloat16", None),
    ("bf16 segments odd", 1, 777, 333, 4, 4, 64, False, True, "bfloat16", None),
    ("bf16 causal mqa segments", 1, 1000, 1000, 8, 1, 128, True, True, "bfloat16", None),
]
BUDGET_S = 110.0  # Cases not started by then are reported as SKIPPED.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def _segments(key, batch: int, length: int):
    """Sorted random segment ids, 1 to 5 segments per row."""
    ids = jax.random.randint(key, (batch, length), 0, 5)
    return jnp.sort(ids, axis=1).astype(jnp.int32)


def _relative_error(a, b) -> float:
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run_case(batch, q_len, kv_len, heads, kv_heads, head_dim, causal, segments, dtype, blocks, interpret=False):
    """Returns relative errors of (out, dq, dk, dv)."""
    keys = jax.random.split(jax.random.PRNGKey(q_len * 7 + kv_len), 6)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, head_dim), dtype)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    kwargs = {"causal": causal}
    if segments:
        kwargs["q_segment_ids"] = _segments(keys[4], batch, q_len)
        kwargs["kv_segment_ids"] = _segments(keys[4], batch, kv_len)

    def flash(q, k, v):
        return flash_attention(q, k, v, block_sizes=blocks, interpret=interpret, **kwargs)

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, **kwargs)

    def value_and_grads(fn, q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(d_out.astype(out.dtype)))

    got = jax.jit(lambda q, k, v: value_and_grads(flash, q, k, v))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(lambda q, k, v: value_and_grads(reference, q, k, v))(*f32)
    return [_relative_error(a, b) for a, b in zip(got, want)]


def main() -> int:
    interpret = "--interpret" in sys.argv[1:]
    device = jax.devices()[0]
    print(f"JAX {jax.__version__}, backend {jax.default_backend()}, device {device.device_kind}")
    if jax.default_backend() == "cpu" and not interpret:
        print("warning: no GPU backend; the kernels will be compiled for CPU and fail.")
    print("| case | shape (B,T,S,N,K,H) | causal | segments | dtype | out | dq | dk | dv | result | time |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |")
    failures = skipped = 0
    deadline = time.perf_counter() + BUDGET_S
    for name, b, t, s, n, kh, h, causal, segs, dtype, blocks in CASES:
        start = time.perf_counter()
        shape = f"{b},{t},{s},{n},{kh},{h}"
        if start > deadline:
            skipped += 1
            print(
                f"| {name} | {shape} | {causal} | {segs} | {dtype} | - | - | - | - "
                f"| SKIPPED (over {BUDGET_S:.0f}s) | - |",
                flush=True,
            )
            continue
        try:
            errors = run_case(b, t, s, n, kh, h, causal, segs, jnp.dtype(dtype), blocks, interpret)
            ok = all(e <= TOLERANCE[dtype] for e in errors)  # NaN compares False.
            cells = [f"{e:.1e}" for e in errors]
            result = "PASS" if ok else f"FAIL (tol {TOLERANCE[dtype]:g})"
        except Exception as e:  # noqa: BLE001 - report each case.
            ok = False
            cells = ["-"] * 4
            result = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
            traceback.print_exc(file=sys.stderr)
        failures += not ok
        elapsed = time.perf_counter() - start
        print(
            f"| {name} | {shape} | {causal} | {segs} | {dtype} | {' | '.join(cells)} | {result} | {elapsed:.1f}s |",
            flush=True,
        )
    print(f"{len(CASES) - failures - skipped}/{len(CASES)} passed, {failures} failed, {skipped} skipped")
    return 1 if failures or skipped else 0


if __name__ == "__main__":
    sys.exit(main())
