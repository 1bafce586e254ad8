"""Hugging Face folders to and from meshwork run folders: ``python -m train.hf import|export``.

``import PATH --run-dir RUN`` reads a Hugging Face model folder straight onto ``--mesh`` and writes it as
step 0 of a run folder (parameters, a fresh optimizer state, the run metadata with the folder's
tokenizer); ``python -m train.train --init-from PATH --resume --run-dir RUN`` continues it (the
checkpoint wins over ``--init-from``, whose folder gives the architecture and tokenizer).
``export RUN [--step N] --out DIR`` restores a checkpoint's parameters onto ``--mesh`` in the canonical
layer layout (a pipeline's are re-laid) and writes a folder ``transformers`` reads, one tensor gathered at
a time (`checkpoints.hf.save_params`). The conversion itself lives in `checkpoints.hf`; this module only
wires it to run folders (it needs the model and the optimizer state, which ``checkpoints/`` may not import).

Examples:
    python -m train.hf import tests/fixtures/hf/llama_gqa --run-dir runs/gqa --mesh fsdp=4,tensor=2 --cpu-devices 8
    python -m train.hf export runs/gqa --out exported/gqa --dtype bfloat16 --max-shard-size 2GB
    python -m train.hf export runs/lora --out exported/adapters    # a run with adapters: a PEFT folder
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from checkpoints.argparser import Parser
from checkpoints.meta import RunMeta
from train.data.tokenizer import ByteTokenizer, HFTokenizer
from train.runtime.inference import add_device_args, restore_params, run_main, setup


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m train.hf", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a Hugging Face folder -> step 0 of a run folder")
    imp.add_argument("path", metavar="PATH", help="the Hugging Face model folder")
    imp.add_argument("--run-dir", required=True, metavar="RUN", help="the run folder to write (no checkpoints yet)")
    imp.add_argument("--tokenizer", default=None, metavar="FILE", help="default: the folder's tokenizer.json")
    imp.add_argument("--seed", type=int, default=0, help="the run's seed (its RNG state)")
    imp.add_argument(
        "--break-lock", action="store_true", help="take over the run folder's lock held by a run on another host"
    )
    add_device_args(imp)
    exp = sub.add_parser("export", help="a run folder's checkpoint -> a Hugging Face folder")
    exp.add_argument("run", nargs="?", default=None, metavar="RUN", help="the run folder")
    exp.add_argument(
        "--run-dir", default=None, metavar="RUN", help="the run folder, as import, generate and evaluate name it"
    )
    exp.add_argument("--step", type=int, default=None, metavar="N", help="default: the newest complete step")
    exp.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new or empty)")
    exp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="tensor dtype")
    exp.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="bytes per safetensors file, e.g. 2GB")
    exp.add_argument(
        "--merge-lora",
        action="store_true",
        help="a run with low-rank adapters: write the model with W + (alpha/r) * A @ B folded in; without it such a "
        "run is written as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)",
    )
    add_device_args(exp)
    return p


def import_folder(args) -> int:
    """``import``: the folder onto the mesh, saved as step 0 of ``--run-dir``."""
    from checkpoints import hf  # slow: ml_dtypes
    from train.setup.checks import check_run_dir  # slow: orbax

    config = hf.init_config(args.path)
    tokenizer_file = Path(args.tokenizer or Path(args.path) / hf.TOKENIZER_FILE)
    if not tokenizer_file.is_file():
        raise ValueError(f"{args.path}: no {hf.TOKENIZER_FILE}; pass --tokenizer FILE")
    tokenizer = HFTokenizer(tokenizer_file, hf.eod_token(args.path, tokenizer_file))
    check_run_dir(args.run_dir, resume=False, can_resume=False)  # import writes step 0: never onto a run
    par = setup(args, "import")
    import jax

    from train.runtime.training import hold_run_folder  # slow: orbax

    lock = hold_run_folder(
        args.run_dir, args.break_lock, jax.process_index(), lambda line: print(line, file=sys.stderr)
    )
    try:
        _import_onto(args, config, tokenizer, par)
    finally:
        if lock is not None:
            lock.release()
    return 0


def _import_onto(args, config, tokenizer, par) -> None:
    """Loads the folder's weights onto the mesh of ``par`` and saves them as step 0 of ``--run-dir``."""
    from checkpoints import hf  # slow: ml_dtypes
    from checkpoints.manager import CheckpointManager  # slow: orbax
    from train.runtime.state import StateLayout  # slow: jax

    t0 = time.perf_counter()
    layout = StateLayout(config, par)
    params = hf.load_params(args.path, config, layout.param_targets())
    state = layout.state_from_params(params, args.seed)
    meta = RunMeta.create(config, f"hf:{args.path}", par.mesh_shape, layout.rules, {"seed": args.seed}, tokenizer, None)
    manager = CheckpointManager(Path(args.run_dir) / "checkpoints", async_save=False)
    try:
        manager.save(0, state, meta.at(0, 0).to_json())
        manager.wait()
    finally:
        manager.close()
    print(
        f"imported {args.path} onto mesh {args.mesh} as step 0 of {args.run_dir} in {time.perf_counter() - t0:.1f} s; "
        f"continue with: python -m train.train --init-from {args.path} --resume --run-dir {args.run_dir} ..."
    )


def export_run(args) -> int:
    """``export``: a checkpoint's parameters, canonical layout, written as a Hugging Face folder."""
    from checkpoints import hf, peft  # slow: ml_dtypes
    from models import lora  # slow: jax
    from train.setup.parser import parse_bytes  # slow: jax

    try:
        max_bytes = parse_bytes(args.max_shard_size, "--max-shard-size", "2GB")
    except argparse.ArgumentTypeError as e:  # one error line naming the flag, as every bad input gets
        raise ValueError(f"--max-shard-size {e}") from None
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: {'a file' if out.is_file() else 'not an empty folder'}; give a new folder")
    par = setup(args, "export")
    t0 = time.perf_counter()
    config, params, meta, step = restore_params(args.run_dir, args.step, par)
    if args.merge_lora and not config.lora_rank:
        raise ValueError(f"--merge-lora: {args.run_dir} has no low-rank adapters; export it without --merge-lora")
    if config.lora_rank and not args.merge_lora:
        files = peft.save_adapters(out, config, params, meta.preset.removeprefix("hf:"))
        print(f"exported the adapters of step {step} of {args.run_dir} to {out} (PEFT, {len(files)} files)")
        return 0
    if config.lora_rank:
        config, params = lora.merged(config, params)
    name = meta.tokenizer.get("name")
    with tempfile.TemporaryDirectory() as scratch:
        if name in (None, "", "bytes"):  # the bytes tokenizer, written as an equivalent tokenizer.json
            tokenizer = ByteTokenizer().save_json(Path(scratch) / hf.TOKENIZER_FILE)
        else:
            tokenizer = name if Path(name).is_file() else None
        if tokenizer is None:
            print(f"note: the run's tokenizer {name!r} is not a tokenizer.json here; none is written", file=sys.stderr)
        files = hf.save_params(
            out,
            config,
            params,
            dtype=args.dtype,
            max_shard_size=max_bytes,
            tokenizer=tokenizer,
            eos_token_id=meta.tokenizer.get("eod_id"),
        )
    print(
        f"exported step {step} of {args.run_dir} to {out} ({len(files)} files, {args.dtype}) in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2: bad input, one line)."""
    args = build_parser().parse_args(argv)
    if args.command == "export":  # the run folder as RUN or --run-dir (import's, generate's and evaluate's flag)
        folders = {args.run, args.run_dir} - {None}
        if len(folders) != 1:
            given = "two run folders" if folders else "no run folder"
            print(
                f"error: export: {given}; give one, e.g. python -m train.hf export runs/a --out hf/a", file=sys.stderr
            )
            return 2
        args.run_dir = folders.pop()
    return run_main(import_folder if args.command == "import" else export_run, args)


if __name__ == "__main__":
    sys.exit(main())
