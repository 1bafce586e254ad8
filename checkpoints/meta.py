"""The metadata stored with every checkpoint step (the ``meta`` item), and the check a resume makes.

`RunMeta` is the one schema: the model config and the preset it came from, the mesh and rules it was
saved from, the data position and settings, the tokenizer, the stage layout of the layer stacks, the
JAX version and the time. It reads and writes the JSON of earlier checkpoints unchanged
(`RunMeta.from_json` accepts missing keys). `RunMeta.check_compatible` refuses a checkpoint saved with
another model, tokenizer or vocabulary, naming what differs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from models.config import ModelConfig, config_differences
from sharding.errors import ConfigError, Field, FieldText, Override, Part
from sharding.parallel import REPLICATED

HF_PRESET = "hf:"
"""The prefix of a run's recorded preset when its model was imported: ``hf:`` + the ``--init-from`` folder."""
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "lora_base_dtype")
"""The model's fields that set its low-rank adapters, each set by a flag of its own (``--lora-rank`` ...)."""
NEXT_TOKEN = "next-token"
"""The objective of a run of ``train.train``: next-token prediction (pretraining or supervised fine-tuning)."""
DPO = "dpo"
"""The objective of a run of ``train.dpo``: direct preference optimisation against a frozen reference."""
_COMMANDS = {NEXT_TOKEN: "python -m train.train", DPO: "python -m train.dpo"}


@dataclasses.dataclass(frozen=True)
class RunMeta:
    """What a checkpoint step records besides the arrays.

    Attributes:
      model: `ModelConfig.to_dict` of the run.
      preset: The ``--model`` preset.
      mesh: Axis -> size of the mesh it was saved from.
      rules: ``{"name": ..., "table": {logical: [mesh axes]}}``.
      data: ``spec``, ``seq_len``, ``global_batch``, ``seed``, ``heldout`` and, once saved, ``samples``
        (sequences consumed: the data position) and ``iterator`` (the input pipeline's state).
      tokenizer: ``name``, ``fingerprint``, ``vocab_size``, ``eod_id``.
      pipeline: The stage layout of the layer stacks (`sharding.pipeline.StageLayout.to_meta`), or None
        for the canonical ``[layers, ...]`` stacks.
      schedule: The learning-rate schedule's flags: ``steps``, ``decay_steps``, ``warmup`` (steps) and
        ``lr``, and the optimizer's: ``optimizer``, ``schedule``, ``beta1``, ``beta2``, ``eps`` (absent in
        checkpoints saved before they were recorded: AdamW, cosine); None in checkpoints saved before any was.
      optimizer_sharding: Where the saved parameters and optimizer moments were laid out
        (`sharding.parallel.Parallelism.optimizer_sharding`: ``replicated``, or ``data``, split over it); for
        the record: a checkpoint stores the values, whatever the layout, and restores onto either.
      base: With low-rank adapters on an imported model, the frozen base's source: ``{"folder": the
        ``--init-from`` folder, "sha256": `checkpoints.peft.weights_digest` of its weights}``; the checkpoint's
        state then holds the adapters' parameters alone (and their optimizer state), and a restore reads the
        base from the folder after checking its digest (`checkpoints.manager.restore_state`). None: the state
        holds every parameter.
      jax_version: The JAX that saved it.
      saved_at: Local time of the save, ISO 8601.
      step: The step, once saved.
    """

    model: dict[str, Any]
    preset: str
    mesh: dict[str, int]
    rules: dict[str, Any]
    data: dict[str, Any]
    tokenizer: dict[str, Any]
    pipeline: dict[str, Any] | None = None
    schedule: dict[str, Any] | None = None
    optimizer_sharding: str = REPLICATED
    base: dict[str, str] | None = None
    objective: str = NEXT_TOKEN
    jax_version: str = ""
    saved_at: str = ""
    step: int | None = None

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        preset: str,
        mesh_shape,
        rules,
        data: dict[str, Any],
        tokenizer,
        pipeline: dict[str, Any] | None,
        schedule: dict[str, Any] | None = None,
        optimizer_sharding: str = REPLICATED,
        base: dict[str, str] | None = None,
        objective: str = NEXT_TOKEN,
    ) -> RunMeta:
        """The metadata of a run about to train (the data position and step are set at each save)."""
        import jax

        return cls(
            model=config.to_dict(),
            preset=preset,
            mesh=dict(mesh_shape),
            rules={"name": rules.name, "table": rules.as_dict()},
            data=dict(data),
            tokenizer={
                "name": tokenizer.name,
                "fingerprint": tokenizer.fingerprint,
                "vocab_size": tokenizer.vocab_size,
                "eod_id": tokenizer.eod_id,
            },
            pipeline=pipeline,
            schedule=None if schedule is None else dict(schedule),
            optimizer_sharding=optimizer_sharding,
            base=None if base is None else dict(base),
            objective=objective,
            jax_version=jax.__version__,
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )

    def at(self, step: int, samples: int, iterator: dict | None = None) -> RunMeta:
        """This metadata for a save of ``step`` after ``samples`` sequences; ``iterator`` is the input
        pipeline's state (`train.data.TrainBatches.state`: Grain's iterator state, the same on every process)."""
        data = {**self.data, "samples": int(samples)}
        if iterator is not None:
            data["iterator"] = iterator
        return dataclasses.replace(self, step=step, data=data, saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def to_json(self) -> dict[str, Any]:
        """The JSON-friendly dict stored as the ``meta`` item (``step`` only once saved)."""
        out = dataclasses.asdict(self)
        if out["step"] is None:
            del out["step"]
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> RunMeta:
        """Reads a ``meta`` item (earlier checkpoints included: missing keys take their defaults)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in value.items() if k in fields}
        for name in ("model", "mesh", "rules", "data", "tokenizer"):
            known.setdefault(name, {})
        known.setdefault("preset", "?")
        # Saved before the objective was recorded: train.dpo's runs recorded only the seed as their data.
        known.setdefault("objective", DPO if set(known["data"]) == {"seed"} else NEXT_TOKEN)
        return cls(**known)

    def model_config(self, **changes) -> ModelConfig:
        """The saved `ModelConfig` (fields newer than the checkpoint take their defaults), with ``changes``.

        Raises:
          ValueError: Metadata without a model, or an invalid change.
        """
        if not self.model:
            raise ValueError("the checkpoint's metadata records no model config")
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in self.model.items() if k in fields}).replace(**changes)

    @property
    def samples(self) -> int:
        """Sequences consumed when saved (the data position)."""
        return int(self.data.get("samples", 0))

    def schedule_change(self, current: dict[str, Any], step: int) -> str | None:
        """One line saying how ``current`` (as `schedule`) changes the learning-rate schedule saved at
        ``step``, or None when it does not (or when the checkpoint predates the record)."""
        changed = _changed_fields(self.schedule, current)
        if not changed:
            return None
        return FieldText(
            f"note: the learning-rate schedule changes at step {step}: ",
            *changed,
            " (the rate of every later step follows the new schedule)",
        )

    def batch_change(self, seq_len: int, global_batch: int, step: int) -> str | None:
        """One line saying that ``seq_len`` or ``batch_size`` differs from the run saved at ``step``, or None.

        The data position is kept in sequences consumed (`samples`), so later steps read on from there with
        the new shape; the tokens per step, and so the gradient noise and the learning rate's effect, change.
        """
        saved = {"seq_len": self.data.get("seq_len"), "batch_size": self.data.get("global_batch")}
        changed = _changed_fields(saved, {"seq_len": seq_len, "batch_size": global_batch})
        if not changed:
            return None
        return FieldText(
            f"note: the batch changes at step {step}: ",
            *changed,
            f" (the data read on from the {self.samples:,} sequences consumed; tokens per step change)",
        )

    def check_compatible(
        self, config: ModelConfig, tokenizer, step: int, objective: str = NEXT_TOKEN, run_dir: str | None = None
    ) -> None:
        """Refuses a checkpoint saved with another objective, model, tokenizer or vocabulary.

        Another objective is refused first: continuing a DPO run as next-token training (or the other way
        round) would carry on its step count in the same folder, and checkpoint retention would delete the
        other run's steps. A DPO run's checkpoint holds its adapters only, the base by reference: adapters of
        another rank, scale or targets are refused naming just those fields (restoring them would fail on the
        factors' shapes).

        Args:
          tokenizer: This run's tokenizer, or None to leave the tokenizer unchecked.
          objective: This run's (`NEXT_TOKEN` or `DPO`).
          run_dir: The run folder, named when a DPO run's adapters differ (None: named without a value).

        Raises:
          ConfigError: Naming the differing fields, their saved and current values, and the fields to resume
            with; or the checkpoint's objective, the command that continues it and another run folder.
        """
        if self.objective != objective:
            raise ConfigError(
                f"the checkpoint at step {step} is from a {self.objective} run ({_COMMANDS.get(self.objective)}); "
                f"continuing it as {objective} would carry on its steps and retention would delete them: resume "
                f"it with {_COMMANDS.get(self.objective)}, or use another ",
                Field("run_dir"),
            )
        diff = config_differences(self.model, config)
        if diff and objective == DPO and set(diff) <= set(LORA_FIELDS):
            changed = [
                p
                for i, (k, (a, b)) in enumerate(diff.items())
                for p in (", " * bool(i), Field(k), f" (saved {a}, now {b})")
            ]
            again = [p for i, (k, (a, _)) in enumerate(diff.items()) for p in (" " * bool(i), Field(k, a))]
            raise ConfigError(
                Field("run_dir", run_dir),
                f": its step {step} holds other adapters: ",
                *changed,
                "; resume with ",
                *again,
                ", or use another ",
                Field("run_dir"),
            )
        if diff:
            fields = ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, (a, b) in diff.items())
            # The adapters' fields have flags of their own (and an override of lora_rank alone leaves no
            # targets); an imported model's architecture comes from its folder, which refuses overrides.
            imported = self.preset.startswith(HF_PRESET)
            # saved without adapters: the adapters' fields are left out (an empty --lora-targets cannot be typed)
            plain = diff.get("lora_rank", (None,))[0] == 0
            sets = [
                part
                for k, (a, _) in diff.items()
                if (k in LORA_FIELDS and not plain) or (k not in LORA_FIELDS and not imported)
                for part in (" ", Field(k, a) if k in LORA_FIELDS else Override(k, a))
            ]
            if plain:
                sets += [", leaving out", *(part for k in diff if k in LORA_FIELDS for part in (" ", Field(k)))]
            model = (
                Field("init_from", self.preset.removeprefix(HF_PRESET)) if imported else Field("preset", self.preset)
            )
            raise ConfigError(
                f"the checkpoint at step {step} was saved with a different model: {fields}; resume with ",
                model,
                *sets,
                ", or use another ",
                Field("run_dir"),
            )
        saved = self.tokenizer
        if tokenizer is None:  # a caller that checks the tokenizer itself (train.dpo reads the base's)
            return
        if saved.get("vocab_size") not in (None, tokenizer.vocab_size):
            raise ConfigError(
                f"the checkpoint at step {step} was trained on a vocabulary of {saved['vocab_size']} "
                f"tokens ({saved.get('name')}); this run's tokenizer has {tokenizer.vocab_size} "
                f"({tokenizer.name}); pass ",
                Field("tokenizer", saved.get("name")),
            )
        if saved.get("fingerprint") not in (None, tokenizer.fingerprint):
            raise ConfigError(
                f"the checkpoint at step {step} was trained with tokenizer {saved.get('name')!r} "
                f"({saved.get('fingerprint')}); this run uses {tokenizer.name!r} ({tokenizer.fingerprint}); pass ",
                Field("tokenizer", saved.get("name")),
            )


def _changed_fields(saved: dict[str, Any] | None, current: dict[str, Any]) -> tuple[Part, ...]:
    """``field=saved -> now`` (a `Field` each, comma-separated) for each of ``current``'s fields that ``saved``
    records with another value; empty when none differs."""
    saved = saved or {}
    changed = [Field(k, f"{saved[k]} -> {v}") for k, v in current.items() if saved.get(k) is not None and saved[k] != v]
    return tuple(part for i, field in enumerate(changed) for part in ((", ", field) if i else (field,)))
