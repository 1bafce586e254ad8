"""Attention benchmark: memory of flash vs reference attention (CPU) and speed on GPU.

Two modes:

* default (any backend, meant for CPU): for lengths 1k..32k (batch 1, 8 heads, head_dim 128,
  causal, float32) lowers and compiles `jax.jit(jax.grad(loss))` for `flash_attention`
  (Pallas, interpret mode on CPU) and `flash_attention_reference`, and tabulates
  `compiled.memory_analysis().temp_size_in_bytes` with the ratio at each doubling of the
  length. Nothing is executed, so the 32k reference (a 32 GiB score matrix) is only compiled.
* `--gpu`: TFLOP/s of the forward and forward+backward passes (causal, bfloat16, head_dim 128)
  of our kernel against `jax.nn.dot_product_attention` (implementation 'xla' and 'cudnn')
  and `jax.experimental.pallas.ops.gpu.attention.mha`, at lengths 4k..32k.

FLOP count (FlashAttention-2, Dao 2023, Section 4.1): forward = 4 * batch * heads * q_length
* kv_length * head_dim (two matmuls), halved for causal; backward = 2.5 x forward (five
matmuls, with recomputation), so forward+backward = 3.5 x forward.

Run by hand, e.g. `python bench/attention.py` or `python bench/attention.py --gpu --out
bench/results/attention_gpu.md`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models.kernels.flash_attention import flash_attention, flash_attention_reference  # noqa: E402

CPU_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
GPU_LENGTHS = (4096, 8192, 16384, 32768)


def _header(title: str) -> list[str]:
    device = jax.devices()[0]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"# {title}",
        "",
        f"JAX {jax.__version__}, device: {device.device_kind} ({device.platform}, "
        f"{jax.device_count()} device(s)), date: {now}.",
        "",
    ]


def _temp_bytes(fn, length: int, heads: int, head_dim: int) -> int:
    """Temp bytes of the compiled gradient of sum(fn(q, k, v)) (lowered and compiled only)."""
    shape = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _ratio(values: list[int | None], i: int) -> str:
    if i == 0 or not values[i] or not values[i - 1]:
        return "-"
    return f"{values[i] / values[i - 1]:.2f}"


def _mib(x: int | None) -> str:
    return "error" if x is None else f"{x / 2**20:,.1f}"


def memory_table(lengths, heads: int, head_dim: int) -> list[str]:
    """Markdown table of forward+backward temp bytes for flash and the reference."""
    variants = {
        "flash": lambda q, k, v: flash_attention(q, k, v, causal=True),
        "reference": lambda q, k, v: flash_attention_reference(q, k, v, causal=True),
    }
    results: dict[str, list[int | None]] = {name: [] for name in variants}
    for length in lengths:
        for name, fn in variants.items():
            start = time.perf_counter()
            try:
                results[name].append(_temp_bytes(fn, length, heads, head_dim))
            except Exception as e:  # noqa: BLE001 - report and continue with the table.
                print(f"{name} at {length}: {type(e).__name__}: {e}", file=sys.stderr)
                results[name].append(None)
            print(f"  compiled {name} at {length} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    lines = _header("Attention forward+backward temporary memory (compiled, not run)") + [
        f"`jax.jit(jax.grad(loss)).lower(...).compile().memory_analysis().temp_size_in_bytes`, "
        f"batch 1, {heads} heads, head_dim {head_dim}, causal, float32. Ratio: temp bytes over "
        "those at half the length (flash should stay near 2, the reference near 4).",
        "",
        "| length | flash temp (MiB) | flash ratio | reference temp (MiB) | reference ratio |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, length in enumerate(lengths):
        f, r = results["flash"], results["reference"]
        lines.append(f"| {length} | {_mib(f[i])} | {_ratio(f, i)} | {_mib(r[i])} | {_ratio(r, i)} |")
    return lines


# ----------------------------------------------------------------------------------------
# GPU speed
# ----------------------------------------------------------------------------------------


def _gpu_variants(sm_scale: float):
    """name -> attention(q, k, v) for causal bf16 inputs [B, T, N, H]."""

    def ours(q, k, v):
        return flash_attention(q, k, v, causal=True, sm_scale=sm_scale)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=sm_scale, implementation="xla")

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=sm_scale, implementation="cudnn")

    def pallas_mha(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        return pallas_attention.mha(q, k, v, None, sm_scale=sm_scale, causal=True)

    return {"meshwork flash": ours, "cudnn": cudnn, "pallas mha": pallas_mha, "xla": xla}


def _median_seconds(fn, args, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def causal_forward_flops(batch: int, heads: int, length: int, head_dim: int) -> float:
    """FlashAttention-2 (Dao 2023, Sec. 4.1): 4 * B * N * T * S * H, halved for causal."""
    return 4.0 * batch * heads * length * length * head_dim / 2


def speed_table(lengths, heads: int, head_dim: int, tokens: int, warmup: int, iters: int, budget_s: float) -> list[str]:
    """Markdown table of TFLOP/s (forward, forward+backward) for each variant and length."""
    deadline = time.perf_counter() + budget_s
    sm_scale = head_dim**-0.5
    rows = []
    for length in lengths:
        batch = max(1, tokens // length)
        key = jax.random.PRNGKey(length)
        q, k, v = (
            jax.random.normal(kk, (batch, length, heads, head_dim), jnp.bfloat16) for kk in jax.random.split(key, 3)
        )
        flops = causal_forward_flops(batch, heads, length, head_dim)
        for name, attn in _gpu_variants(sm_scale).items():
            cells = []
            for mode in ("fwd", "fwd+bwd"):
                if time.perf_counter() > deadline:
                    cells.append("skipped (time budget)")
                    continue
                try:
                    if mode == "fwd":
                        fn = jax.jit(attn)
                        count = flops
                    else:
                        fn = jax.jit(
                            jax.grad(lambda q, k, v, a=attn: jnp.sum(a(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
                        )
                        count = 3.5 * flops
                    seconds = _median_seconds(fn, (q, k, v), warmup, iters)
                    cells.append(f"{count / seconds / 1e12:.1f} ({seconds * 1e3:.2f} ms)")
                except Exception as e:  # noqa: BLE001 - one failure must not stop the table.
                    message = str(e).splitlines()[0][:80] if str(e) else ""
                    cells.append(f"error: {type(e).__name__} {message}".replace("|", "/"))
                print(f"  {name} {mode} at {length}: {cells[-1]}", file=sys.stderr)
            rows.append(f"| {length} | {batch} | {name} | {cells[0]} | {cells[1]} |")
        del q, k, v
    return (
        _header("Causal attention speed on GPU")
        + [
            f"bfloat16, causal, {heads} heads, head_dim {head_dim}, batch = {tokens} tokens / "
            f"length. Median of {iters} timed calls after {warmup} warm-ups "
            "(`jax.block_until_ready`), including dispatch.",
            "",
            "FLOPs (FlashAttention-2, Dao 2023, Section 4.1): forward = 4 * batch * heads * "
            "length^2 * head_dim / 2 (causal); forward+backward = 3.5 x forward (the backward "
            "counted as 2.5 x forward).",
            "",
            "| length | batch | variant | forward TFLOP/s (time) | forward+backward TFLOP/s (time) |",
            "| ---: | ---: | --- | ---: | ---: |",
        ]
        + rows
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=(
            "Benchmark meshwork's Pallas flash attention. Default: compile-only temp memory of "
            "forward+backward, flash vs reference, lengths 1k-32k (CPU is fine). --gpu: TFLOP/s "
            "against jax.nn.dot_product_attention (xla, cudnn) and Pallas's own mha."
        )
    )
    parser.add_argument("--gpu", action="store_true", help="measure speed on the GPU instead of compiled memory")
    parser.add_argument(
        "--out",
        default=None,
        help="markdown output file (default bench/results/attention_cpu.md, "
        "or bench/results/attention_gpu.md with --gpu)",
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=None, help="sequence lengths (default 1k..32k, or 4k..32k with --gpu)"
    )
    parser.add_argument("--heads", type=int, default=None, help="heads (default 8; 16 with --gpu)")
    parser.add_argument("--head-dim", type=int, default=128, help="head_dim (default 128)")
    parser.add_argument("--tokens", type=int, default=32768, help="--gpu: batch * length (default 32768)")
    parser.add_argument("--warmup", type=int, default=2, help="--gpu: warm-up calls")
    parser.add_argument("--iters", type=int, default=5, help="--gpu: timed calls (median)")
    parser.add_argument(
        "--budget", type=float, default=420.0, help="--gpu: seconds after which remaining cells are skipped"
    )
    args = parser.parse_args(argv)

    if args.gpu:
        lines = speed_table(
            args.lengths or GPU_LENGTHS,
            args.heads or 16,
            args.head_dim,
            args.tokens,
            args.warmup,
            args.iters,
            args.budget,
        )
        out = args.out or "bench/results/attention_gpu.md"
    else:
        lines = memory_table(args.lengths or CPU_LENGTHS, args.heads or 8, args.head_dim)
        out = args.out or "bench/results/attention_cpu.md"
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
