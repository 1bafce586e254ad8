"""Throughput of meshwork's real train step on synthetic tokens.

Builds the same `train.runtime.step.Trainer` that ``python -m train.train`` uses, feeds it
a fixed batch of random tokens (one document per row), and times each step to
completion (``block_until_ready``). Reports the median step time over steps
``--skip + 1`` and later (the first steps include compilation and warm-up),
tokens/s in all and per device, model TFLOP/s per device, and MFU where the
devices' peak is known.

Model FLOPs per token follow Chowdhery et al., PaLM (2022), Appendix B:
``6 * N + 12 * L * H * Q * T`` (N non-embedding parameters, L layers, H heads,
Q head_dim, T sequence length); see `models.config.ModelConfig.flops_per_token`.

    python bench/throughput.py --cpu-devices 8 --model test --mesh fsdp=8
    python bench/throughput.py --json ...     # one JSON object, for bench/peer_maxtext.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="test", help="model preset")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="ModelConfig overrides")
    p.add_argument("--mesh", default="fsdp=-1", help="mesh, as for train.train")
    p.add_argument("--rules", default="fsdp_tp", help="rules preset")
    p.add_argument("--rule", action="append", default=[], help="rule overrides")
    p.add_argument("--batch-size", type=int, default=8, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the preset's)")
    p.add_argument("--remat", default=None, help="remat policy (default: the preset's)")
    p.add_argument("--attention", default=None, help="attention implementation (default: the preset's)")
    p.add_argument(
        "--logits",
        default=None,
        help="output projection and loss: auto, gathered or vocab_parallel (default: the preset's, auto)",
    )
    p.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation steps")
    p.add_argument("--steps", type=int, default=10, help="steps to run")
    p.add_argument("--skip", type=int, default=2, help="leading steps left out of the median")
    p.add_argument("--cpu-devices", type=int, default=None, help="simulated CPU devices")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table row")
    return p.parse_args(argv)


def measure(args) -> dict:
    """Runs the steps and returns the figures (see the module docstring)."""
    import jax
    import numpy as np

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from models.config import get_config
    from sharding.devices import peak_flops
    from sharding.mesh import make_mesh, parse_mesh
    from sharding.parallel import Accumulation, Parallelism
    from sharding.rules import get_rules
    from sharding.vocab import choose_for_batch
    from train.runtime.optimizer import OptimizerConfig
    from train.runtime.step import Trainer

    changes = {
        k: v
        for k, v in (
            ("dtype", args.dtype),
            ("remat", args.remat),
            ("attention", args.attention),
            ("logits", args.logits),
        )
        if v
    }
    config = get_config(args.model, args.set, **changes)
    mesh = make_mesh(parse_mesh(args.mesh, jax.device_count()))
    par = Parallelism.of(mesh, get_rules(args.rules, args.rule), Accumulation(args.microbatches))
    trainer = Trainer(config, OptimizerConfig(decay_steps=max(args.steps, 2), warmup=1), par)
    B, T = args.batch_size, args.seq_len
    split = choose_for_batch(
        config.logits, trainer.rules, dict(mesh.shape), config.vocab_size, config.embed_dim, (B, T)
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (B, T + 1)).astype(np.int32)
    host = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
        "segment_ids": np.ones((B, T), np.int32),
        "loss_mask": np.ones((B, T), np.float32),
    }
    sharding = trainer.batch_sharding(B, T)
    batch = {k: jax.device_put(v, sharding) for k, v in host.items()}
    signals = trainer.signals(False)
    state = trainer.init_state(0)
    step = trainer.train_step(B, T)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch, signals)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    kept = times[args.skip :]
    step_time = statistics.median(kept)
    devices = mesh.devices.size
    tokens_per_s = B * T / step_time
    flops_per_token = config.flops_per_token(T)
    peaks = [peak_flops(d) for d in mesh.devices.ravel()]
    peak = None if any(p is None for p in peaks) else sum(peaks)
    return {
        "framework": "meshwork",
        "model": args.model,
        "overrides": args.set,
        "mesh": args.mesh,
        "batch": B,
        "seq_len": T,
        "dtype": config.dtype,
        "remat": config.remat,
        "attention": config.attention,
        "logits": config.logits,
        "loss_layout": "gathered" if split is None else "vocab_parallel",
        "params": config.num_params,
        "devices": devices,
        "step_times": times,
        "median_step_time": step_time,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / devices,
        "model_tflops_per_device": tokens_per_s * flops_per_token / devices / 1e12,
        "mfu": tokens_per_s * flops_per_token / peak if peak else None,
        "loss_last": float(metrics["loss"]),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "machine": platform.processor() or platform.machine(),
        "date": datetime.date.today().isoformat(),
    }


def table_row(r: dict) -> str:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    return (
        f"| {r['model']} {' '.join(r['overrides'])} | {r['mesh']} | {r['batch']}x{r['seq_len']} | {r['dtype']} | "
        f"{r['remat']} | {r['loss_layout']} | {r['median_step_time'] * 1000:.0f} | {r['tokens_per_s']:,.0f} | "
        f"{r['tokens_per_s_per_device']:,.0f} | {r['model_tflops_per_device']:.4f} | {mfu} |"
    )


HEADER = (
    "| model | mesh | batch x length | dtype | remat | loss | median step (ms) | tokens/s | tokens/s/device | "
    "model TFLOP/s/device | MFU |\n|---|---|---|---|---|---|---:|---:|---:|---:|---:|"
)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"JAX {result['jax']} on {result['backend']} ({result['machine']}), {result['date']}; "
            f"median over steps {args.skip + 1}-{args.steps}\n"
        )
        print(HEADER)
        print(table_row(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
