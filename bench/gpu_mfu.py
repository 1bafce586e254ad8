"""MFU on one GPU at length 4096: our flash kernel against ``jax.nn.dot_product_attention``.

The one prepared GPU check of model FLOPs utilisation. For the largest preset that fits one device (tried in
the order of ``--models``, largest first; a run that fails with out-of-memory moves on to the
next preset), runs `bench/throughput.py` (meshwork's real train step, synthetic tokens) twice:
``--attention flash`` (our Pallas FlashAttention-2 kernel) and ``--attention dot_product``
(JAX's own implementation, ``jax.nn.dot_product_attention``). Each run is a separate process
(GPU memory freed between runs) with a time limit, and the whole script keeps to ``--budget``
seconds (default 450, within the 8 minutes the issue allows).

MFU = model FLOP/s / the device's peak dense bf16 FLOP/s (`sharding.devices`), model FLOPs per
token by PaLM's count (Chowdhery et al., 2022, appendix B; `ModelConfig.flops_per_token`).

    python bench/gpu_mfu.py                     # on the GPU machine
    python bench/gpu_mfu.py --out mfu.md        # also write the markdown table
    python bench/gpu_mfu.py --cpu-smoke         # the same path on CPU, tiny model (script check only)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OOM")


def run_one(model: str, attention: str, args, limit_s: float) -> tuple[dict | None, str]:
    """One throughput run in its own process: ``(result, "")`` or ``(None, why it failed)``."""
    command = [
        sys.executable,
        str(ROOT / "bench" / "throughput.py"),
        "--json",
        "--model",
        model,
        "--mesh",
        "fsdp=-1",
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--dtype",
        "bfloat16",
        "--remat",
        args.remat,
        "--attention",
        attention,
        "--steps",
        str(args.steps),
        "--skip",
        "3",
        *sum((["--set", s] for s in args.set), []),
    ]
    if args.cpu_smoke:
        command += ["--cpu-devices", "1"]
    start = time.time()
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=limit_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {limit_s:.0f} s"
    print(f"  {model} {attention}: exit {out.returncode} in {time.time() - start:.0f} s", flush=True)
    if out.returncode:
        text = out.stdout + out.stderr
        oom = any(marker in text for marker in OOM_MARKERS)
        return None, ("out of memory" if oom else "failed") + ":\n" + text[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), ""


def row(r: dict) -> str:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (peak unknown)"
    return (
        f"| {r['model']} | {r['attention']} | {r['batch']}x{r['seq_len']} | {r['remat']} | "
        f"{r['median_step_time'] * 1000:.0f} | {r['tokens_per_s']:,.0f} | {r['model_tflops_per_device']:.1f} | "
        f"{mfu} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--models", default="7b,1b,125m", help="presets to try, largest first")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    p.add_argument("--remat", default="full", help="remat policy")
    p.add_argument("--steps", type=int, default=8, help="steps per run (median over steps 4 and later)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="ModelConfig overrides")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole script")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    p.add_argument(
        "--cpu-smoke", action="store_true", help="check the script on CPU: the test preset at length 256, 5 steps"
    )
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.models, args.seq_len, args.steps = "test", 256, 5
    start = time.time()
    results, notes = [], []
    for model in args.models.split(","):
        left = args.budget - (time.time() - start)
        if left < 60:
            notes.append(f"{model}: not tried, {left:.0f} s of the budget left")
            break
        flash, why = run_one(model, "flash", args, left * 0.6)
        if flash is None:
            notes.append(f"{model} flash: {why.splitlines()[0]}")
            if why.startswith("out of memory"):
                continue  # try the next, smaller preset
            print(why, file=sys.stderr)
            break
        results.append(flash)
        left = args.budget - (time.time() - start)
        baseline, why = run_one(model, "dot_product", args, max(left - 5, 1))
        if baseline is None:
            notes.append(f"{model} dot_product: {why.splitlines()[0]}")
            print(why, file=sys.stderr)
        else:
            results.append(baseline)
        break  # the largest preset that fits is measured
    header = (
        ""
        if not results
        else (
            f"JAX {results[0]['jax']} on {results[0]['backend']} ({results[0]['machine']}), {results[0]['date']}; "
            f"`python bench/gpu_mfu.py`; median step over steps 4-{args.steps}\n\n"
            "| model | attention | batch x length | remat | median step (ms) | tokens/s | model TFLOP/s | MFU |\n"
            "|---|---|---|---|---:|---:|---:|---:|\n"
        )
    )
    table = header + "\n".join(row(r) for r in results) + "".join(f"\n\n{n}" for n in notes)
    print("\n" + table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0 if len(results) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
