"""Library errors in the command line's words: each configuration field an error names becomes its flag.

`sharding`, `models` and `checkpoints` refuse values with `sharding.errors.ConfigError`, whose message
names configuration fields (``stage_layers=5,3``, ``mesh stage=4``, ``num_layers=8``). A user of the
command line sets those fields with flags, so the entry points print `render(error)`: the same message with
each field written as the flag that sets it (``--stage-layers 5,3``, ``--mesh stage=4``,
``--set num_layers=8``), one table (`FLAGS`) for every command.
"""

from __future__ import annotations

from models.config import DTYPES
from sharding.errors import ConfigError, Field, FieldText, Override

OVERRIDE_FLAG = "--set"
"""The flag that sets a model configuration field by name: ``--set FIELD=VALUE``."""

FLAGS: dict[str, str] = {
    # the mesh and how it spans processes
    "mesh": "--mesh",
    "mesh_outer": "--mesh-outer",
    "cluster": "--cluster",
    "simulate_cluster": "--simulate-cluster",
    # sharding rules
    "rules": "--rules",
    "rule": "--rule",
    # batch and sequence
    "batch_size": "--batch-size",
    "global_batch": "--batch",
    "seq_len": "--seq-len",
    "microbatches": "--microbatches",
    # pipeline
    "stage_layers": "--stage-layers",
    "pipeline_gather": "--pipeline-gather",
    "pipeline_repeats": "--pipeline-repeats",
    "pipeline_schedule": "--pipeline-schedule",
    # uneven batches over devices of unequal speed
    "hetero_batch": "--hetero-batch",
    "rebalance_every": "--rebalance-every",
    # attention and the length axis
    "attention": "--attention",
    "context_layout": "--context-layout",
    "context_shares": "--context-shares",
    "optimizer_sharding": "--optimizer-sharding",
    "logits": "--logits",
    # execution
    "remat": "--remat",
    "dtype": "--dtype",
    # the model
    "preset": "--model",
    "override": OVERRIDE_FLAG,  # a whole FIELD=VALUE item, as given
    "init_from": "--init-from",
    "tokenizer": "--tokenizer",
    # the run folder and the learning-rate schedule a checkpoint records
    "run_dir": "--run-dir",
    "keep": "--keep",
    "resume_step": "--resume-step",
    "discard_later": "--discard-later",
    "step": "--step",
    "break_lock": "--break-lock",
    "steps": "--steps",
    "decay_steps": "--decay-steps",
    "warmup": "--warmup",
    "lr": "--lr",
    "optimizer": "--optimizer",
    "schedule": "--schedule",
    "beta1": "--beta1",
    "beta2": "--beta2",
    "eps": "--eps",
    # Hugging Face export
    "max_shard_size": "--max-shard-size",
    "export_folder": "--out",
    # sampling
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "max_new_tokens": "--max-new-tokens",
    "prompt": "--prompt",
    # low-rank adapters (models.lora)
    "lora_rank": "--lora-rank",
    "lora_alpha": "--lora-alpha",
    "lora_targets": "--lora-targets",
    "lora_base_dtype": "--lora-base-dtype",
    "dpo_beta": "--dpo-beta",
}
"""Configuration field -> the flag that sets it. A field's value follows its flag after a space."""


def add_lora_base_dtype(group) -> None:
    """``--lora-base-dtype`` (the ``lora_base_dtype`` field, `models.config.ModelConfig`), defined once for the
    commands that train adapters (``train.train``, ``train.dpo``); None when not given (the field's default,
    float32)."""
    group.add_argument(
        FLAGS["lora_base_dtype"],
        default=None,
        choices=DTYPES,
        help="with --lora-rank: hold the frozen base in bfloat16 (half its memory; each layer widens it to "
        "the compute dtype as it computes) or float32 (default); the adapters stay float32",
    )


def flag_text(field: Field) -> str:
    """One field reference as a user types it: ``--flag VALUE``, or ``--set FIELD=VALUE`` for an override.

    A field no flag sets (one the library derives, such as the cost model's ``tick_schedule``) keeps the
    library's name (`sharding.errors.Field`).
    """
    if isinstance(field, Override):
        name = f"{OVERRIDE_FLAG} {field.name}"
        return name if field.value is None else f"{name}={field.value}"
    flag = FLAGS.get(field.name)
    if flag is None:
        return str(field)
    return flag if field.value is None else f"{flag} {field.value}"


def render(message: BaseException | str) -> str:
    """An error's message (or a line) as a command line prints it: the fields of a `ConfigError` (or of a
    `FieldText`) named by their flags, anything else as it is."""
    if isinstance(message, (ConfigError, FieldText)):
        return message.render(flag_text)
    return str(message)
