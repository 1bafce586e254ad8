"""Direct Preference Optimization of an imported model's low-rank adapters: ``python -m train.dpo``.

Reads a Hugging Face folder onto ``--mesh`` with fresh adapters (`models.lora`), trains them on preference
pairs (`train.data.preference`) with the DPO loss against the base model as the frozen reference
(`train.runtime.dpo`), and reports the held-out pairs' loss, reward margin and accuracy. With ``--run-dir`` the
adapters are checkpointed (the run folder ``train.hf export`` reads: a PEFT folder or ``--merge-lora``), and a
run with a checkpoint there resumes from it. docs/post-training.md has the commands.

Example:
    python -m train.dpo --init-from tests/fixtures/hf/llama_gqa --data pairs.jsonl --cpu-devices 8 --mesh fsdp=8 \
        --seq-len 32 --batch-size 8 --steps 60 --dpo-beta 0.5 --lr 1e-2 --run-dir runs/dpo
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from checkpoints.argparser import Parser
from checkpoints.meta import DPO, RunMeta
from models.config import LORA_TARGETS
from sharding.mesh import parse_axis_sizes
from train.data.tokenizer import HFTokenizer
from train.runtime.inference import add_device_args, run_main, setup
from train.setup.flagnames import add_lora_base_dtype


def build_parser():
    p = Parser(prog="python -m train.dpo", description=__doc__.split("\n\n")[0])
    p.add_argument("--init-from", required=True, metavar="PATH", help="the Hugging Face model folder (the base)")
    p.add_argument("--data", required=True, metavar="FILE", help="preference JSONL: prompt, chosen, rejected")
    p.add_argument("--tokenizer", default=None, metavar="FILE", help="default: the folder's tokenizer.json")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R", help="the adapters' rank")
    p.add_argument("--lora-alpha", type=float, default=16.0, metavar="A", help="the adapters' scale numerator")
    p.add_argument("--lora-targets", default=",".join(LORA_TARGETS), metavar="LIST", help="projections adapted")
    add_lora_base_dtype(p)
    p.add_argument("--dpo-beta", type=float, default=0.1, metavar="BETA", help="DPO's beta (pull to the reference)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens of one reply's side (a row holds two)")
    p.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    p.add_argument("--steps", type=int, default=100, help="the last step (a resumed run continues to it)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate (cosine decay over --steps)")
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up steps")
    p.add_argument("--heldout", type=float, default=0.2, help="share of the pairs held out")
    p.add_argument("--eval-every", type=int, default=10, metavar="N", help="steps between held-out evaluations")
    p.add_argument("--seed", type=int, default=0, help="the adapters' init, the pairs' order and held-out split")
    p.add_argument("--run-dir", default=None, metavar="RUN", help="checkpoint the adapters here; resume from it")
    add_device_args(p, "fsdp=-1")
    return p


def check_args(args) -> None:
    """The counts and fractions in range, before the data or any device is touched.

    Raises:
      ValueError: One line naming the flag and value, with a value that is accepted.
    """
    for flag, value, least, example in (
        ("--lora-rank", args.lora_rank, 1, 16),  # DPO's reference is the base: it trains adapters
        ("--batch-size", args.batch_size, 1, 8),
        ("--seq-len", args.seq_len, 1, 128),
        ("--steps", args.steps, 0, 100),
        ("--warmup", args.warmup, 0, 0),
        ("--eval-every", args.eval_every, 1, 10),
    ):
        if value < least:
            raise ValueError(f"{flag} {value}: must be >= {least}, e.g. {flag} {example}")
    if not 0.0 < args.heldout < 1.0:  # NaN fails too
        raise ValueError(f"--heldout {args.heldout}: must be a fraction > 0 and < 1, e.g. --heldout 0.2")
    if not Path(args.data).is_file():
        raise ValueError(f"--data {args.data}: no such file; give a JSONL file of prompt/chosen/rejected pairs")


def run(args) -> int:
    """Trains; prints one line per evaluation and the held-out accuracy before and after."""
    from checkpoints import hf  # slow: ml_dtypes
    from checkpoints.manager import CheckpointManager, base_reference, restore_state  # slow: orbax
    from train.data.preference import load_pairs  # slow: tokenizers
    from train.runtime.dpo import DPOTrainer, check_dpo  # slow: jax
    from train.runtime.optimizer import OptimizerConfig  # slow: optax

    check_args(args)
    if parse_axis_sizes(args.mesh).get("stage", 1) > 1:
        raise ValueError(f"--mesh {args.mesh}: DPO runs without pipeline stages; put those devices on fsdp")
    config = hf.init_config(
        args.init_from,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        **({"lora_base_dtype": args.lora_base_dtype} if args.lora_base_dtype else {}),
    )
    check_dpo(config, args.dpo_beta)
    tokenizer_file = Path(args.tokenizer or Path(args.init_from) / hf.TOKENIZER_FILE)
    tokenizer = HFTokenizer(tokenizer_file, hf.eod_token(args.init_from, tokenizer_file))
    pairs = load_pairs(args.data, tokenizer, args.seq_len, args.seed, args.heldout)
    b, length = args.batch_size, 2 * args.seq_len
    counts = {split: len(pairs[split].get("tokens", ())) for split in ("train", "heldout")}
    split, fewest = min(counts.items(), key=lambda item: item[1])
    if fewest < b:  # both batches are --batch-size pairs: the smaller split bounds it
        remedy = f"e.g. --batch-size {fewest}" if fewest else "give more pairs, or another --heldout"
        raise ValueError(
            f"--data {args.data}: {counts['train']} train and {counts['heldout']} held-out pairs, fewer {split} "
            f"pairs than --batch-size {b}; {remedy}"
        )
    par = setup(args, "DPO")
    optimizer = OptimizerConfig(lr=args.lr, warmup=args.warmup, decay_steps=max(args.steps, args.warmup + 1))
    trainer = DPOTrainer(config, optimizer, par, args.dpo_beta)
    layout = trainer.state_layout
    meta = RunMeta.create(
        config,
        f"hf:{args.init_from}",
        par.mesh_shape,
        layout.rules,
        {"seed": args.seed},
        tokenizer,
        None,
        base=base_reference(args.init_from),  # the checkpoint keeps the adapters, the base by reference
        objective=DPO,
    )
    manager = CheckpointManager(Path(args.run_dir) / "checkpoints", async_save=False) if args.run_dir else None
    if manager is not None and manager.latest_step() is not None:
        step = manager.latest_step()  # other adapters (or model, or objective) are refused before restoring
        RunMeta.from_json(manager.read_meta(step)).check_compatible(config, None, step, DPO, args.run_dir)
        state, _ = restore_state(manager, layout, base_folder=args.init_from)
    else:
        state = layout.state_from_params(hf.load_params(args.init_from, config, layout.param_targets()), args.seed)
    import jax

    def place(fields, rows):
        return jax.device_put({k: v[rows] for k, v in fields.items()}, trainer.batch_sharding(b, length))

    def evaluate(step):
        fn, held = trainer.eval_pairs(b, length), pairs["heldout"]
        sums = [fn(state["params"], place(held, np.arange(i, i + b))) for i in range(0, len(held["tokens"]) - b + 1, b)]
        total = {k: float(sum(s[k] for s in sums)) for k in sums[0]}
        n = total["pairs"]
        print(
            f"eval {step:6d}/{args.steps} | held-out DPO loss {total['loss_sum'] / n:.4f} | reward margin "
            f"{total['reward_margin_sum'] / n:.4f} | accuracy {total['reward_accuracy_sum'] / n:.3f} ({int(n)} pairs)",
            flush=True,
        )
        return total["reward_accuracy_sum"] / n

    step_fn, train = trainer.train_step(b, length), pairs["train"]
    order = np.random.default_rng(args.seed).permutation(len(train["tokens"]))
    first = int(state["step"])
    before = evaluate(first)
    t0 = time.perf_counter()
    for step in range(first + 1, args.steps + 1):
        rows = order[(np.arange(b) + (step - 1) * b) % len(order)]
        state, metrics = step_fn(state, place(train, rows), trainer.signals(False))
        if step % args.eval_every == 0 or step == args.steps:
            m = jax.device_get(metrics)
            print(
                f"step {step:6d}/{args.steps} | DPO loss {m['loss']:.4f} | reward margin {m['reward_margin']:.4f} | "
                f"accuracy {m['reward_accuracy']:.3f} | {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            after = evaluate(step)
    if manager is not None and args.steps > first:
        manager.save(args.steps, layout.adapters_state(state), meta.at(args.steps, args.steps * b).to_json())
        manager.wait()
        manager.close()
    if args.steps > first:
        print(f"held-out preference accuracy {before:.3f} -> {after:.3f} over steps {first}-{args.steps}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2: bad input, one line)."""
    return run_main(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
