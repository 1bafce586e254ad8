"""Generation throughput: prefill and one-token decoding steps of `models.generation.Generator`.

Builds a preset with random parameters (seeded) on ``--mesh`` and times, after a warm-up that
compiles both, the prefill of ``--batch-size`` prompts of ``--prompt-len`` tokens and
``--new-tokens`` decoding steps, each to completion (``block_until_ready``). Reports prefill
tokens/s (prompt tokens / prefill time) and decode tokens/s (batch / median step time).

    python bench/generate.py --cpu-devices 8 --model small --mesh data=2,tensor=4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="small")
    p.add_argument("--mesh", default="data=2,tensor=4")
    p.add_argument("--rules", default="fsdp_tp")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--cpu-devices", type=int, default=None)
    args = p.parse_args(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
    import jax
    import numpy as np

    from models.config import get_config
    from models.generation import Generator, Sampling, init_cache
    from models.transformer import abstract_model, init_params
    from sharding.mesh import make_mesh, parse_mesh
    from sharding.parallel import Parallelism
    from sharding.rules import get_rules, tree_shardings

    config = get_config(args.model)
    par = Parallelism.of(make_mesh(parse_mesh(args.mesh, jax.device_count())), get_rules(args.rules))
    graphdef, abstract, names = abstract_model(config)
    shardings, _ = tree_shardings(abstract, names, par.mesh, par.rules)
    params = jax.jit(lambda k: init_params(config, k), out_shardings=shardings)(jax.random.key(0))
    generator = Generator(config, graphdef, params, par)
    prefill, step = generator.functions(Sampling())
    b, t, n = args.batch_size, args.prompt_len, args.new_tokens
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (b, t)).astype(np.int32)
    lengths = np.full(b, t, np.int32)

    def run():
        cache = init_cache(config, b, t + n, par)
        jax.block_until_ready(cache)
        start = time.perf_counter()
        token, cache = prefill(params, cache, generator._batch_sharding(tokens), generator._batch_sharding(lengths))
        token.block_until_ready()
        prefill_s = time.perf_counter() - start
        steps = []
        for i in range(n - 1):
            start = time.perf_counter()
            token, cache = step(params, cache, token, generator._batch_sharding(lengths + i), i + 1)
            token.block_until_ready()
            steps.append(time.perf_counter() - start)
        return prefill_s, steps

    run()  # compile
    prefill_s, steps = run()
    step_s = statistics.median(steps)
    print(
        f"{args.model} on {args.mesh} ({jax.device_count()} {jax.devices()[0].platform} devices), jax {jax.__version__}"
    )
    print("| batch | prompt | new | prefill (s) | prefill tokens/s | decode step (ms, median) | decode tokens/s |")
    print(f"| {b} | {t} | {n} | {prefill_s:.3f} | {b * t / prefill_s:,.0f} | {step_s * 1e3:.1f} | {b / step_s:,.0f} |")


if __name__ == "__main__":
    main()
