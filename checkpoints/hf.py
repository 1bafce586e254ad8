"""Hugging Face Llama-family checkpoints in and out: ``config.json`` <-> `ModelConfig`, safetensors <-> parameters.

Reads folders written by ``transformers``' ``save_pretrained`` for ``LlamaForCausalLM``,
``MistralForCausalLM`` and ``Qwen2ForCausalLM`` (``config.json`` and ``model.safetensors``, or
sharded ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``) and writes
folders in that layout. Only safetensors are read: pickled ``pytorch_model.bin`` files are
refused, because unpickling runs code stored in the file.

Tensor names and layouts, one table per architecture family, are `checkpoints.hf_families`'s.

Reading places every array straight onto its sharding: `jax.make_array_from_callback` asks for
each device's block, and the callback reads only the rows and columns of that block from the
file (safetensors' ``get_slice``), so no process holds the whole model. Writing gathers one
tensor (one layer's slice of a stacked parameter) at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors' numpy reader returns it)
import numpy as np

from checkpoints.hf_families import MODEL_TYPES, TensorMap, check_exportable, family, read_block, tensor_maps
from models.config import PRESETS, ModelConfig, config_differences, moe_placement, parse_overrides
from sharding.errors import ConfigError, Field, Override, with_context

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
"""The ``config.json`` ``architectures`` meshwork reads."""

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""Bytes per safetensors file when exporting (``transformers``' default, 5 GB)."""

EXPORT_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}

_CONVERT = (
    'python -c "from transformers import AutoModelForCausalLM as M; '
    "M.from_pretrained('{src}').save_pretrained('{src}-safetensors', safe_serialization=True)\""
)


# config.json <-> ModelConfig ---------------------------------------------------------------------


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model folder.

    Raises:
      ValueError: a file or no such folder, a meshwork run folder, no ``config.json`` or not JSON (one line
        naming the path; a file inside a model folder suggests that folder).
    """
    folder = Path(folder)
    if folder.is_file():  # config.json or a weights file given for its folder
        inside = f", e.g. the one it is in, {folder.parent}" if (folder.parent / CONFIG_FILE).is_file() else ""
        raise ValueError(
            f"{folder}: a file, not a folder; give a Hugging Face model folder (config.json and *.safetensors){inside}"
        )
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder; give a Hugging Face model folder (config.json and *.safetensors)")
    if (folder / "checkpoints").is_dir():  # its config.json is the run's record, which reads as no architecture
        raise ConfigError(
            f"{folder}: a meshwork run folder (it has checkpoints/), not a Hugging Face model folder; give it as ",
            Field("run_dir"),
            f", or write one from it with python -m train.hf export {folder} ",
            Field("export_folder", "DIR"),
        )
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{folder}: no {CONFIG_FILE}; give a folder written by save_pretrained")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _rope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """``rope_*`` fields of `ModelConfig` from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (earlier versions)."""
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    fields = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "default":
        return {**fields, "rope_type": "default"}
    if kind != "llama3":
        raise ValueError(
            f"{where}: rope type {kind!r} is not supported (meshwork has default and llama3 rotary positions)"
        )
    names = {
        "factor": "rope_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_max_positions",
    }
    for key, name in names.items():
        if key not in rope:
            raise ValueError(f"{where}: llama3 rope scaling without {key!r}")
        fields[name] = rope[key]
    fields["rope_original_max_positions"] = int(fields["rope_original_max_positions"])
    for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
        fields[name] = float(fields[name])
    return {**fields, "rope_type": "llama3"}


def _refuse_unsupported(hf: dict[str, Any], arch: str, where: str) -> None:
    """Raises on a ``config.json`` field whose effect meshwork does not implement."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (meshwork's MLP is SwiGLU: silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{where}: {key}=true is not supported (meshwork has no output/MLP biases)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor={hf['partial_rotary_factor']} is not supported")
    window = hf.get("sliding_window")
    longest = hf.get("max_position_embeddings")
    qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if qwen:  # Qwen's sliding_window is in effect only with use_sliding_window
        types = set(hf.get("layer_types") or ["full_attention"])
        if hf.get("use_sliding_window") or types != {"full_attention"}:
            raise ValueError(
                f"{where}: sliding-window attention is in effect (use_sliding_window / layer_types); "
                "meshwork attends over the whole context"
            )
    if arch == "MixtralForCausalLM" and float(hf.get("router_jitter_noise") or 0.0):
        raise ValueError(
            f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not supported (meshwork routes exactly)"
        )
    if qwen:
        pass
    elif window is not None and (longest is None or window < longest):
        raise ValueError(
            f"{where}: sliding_window={window} is in effect (below max_position_embeddings={longest}); "
            "meshwork attends over the whole context"
        )


def config_from_hf(hf: dict[str, Any], where: str = CONFIG_FILE, **changes) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face ``config.json``.

    Args:
      hf: the parsed ``config.json``.
      where: its path, for messages.
      **changes: execution fields to set (``dtype``, ``attention``, ...).

    Returns:
      The architecture of the checkpoint (``qkv_bias`` for Qwen2; ``head_dim`` from the file, or
      ``hidden_size / num_attention_heads``).

    Raises:
      ValueError: an architecture other than `ARCHITECTURES`, a missing field, or a field
        whose effect meshwork does not implement (sliding-window attention in effect, a rope type
        other than default and llama3, attention or MLP biases, another activation); one line
        naming the field.
    """
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"{where}: architectures {archs} not supported; meshwork reads {', '.join(ARCHITECTURES)}")
    arch = archs[0]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise ValueError(f"{where}: no {key!r} field")
    _refuse_unsupported(hf, arch, where)
    heads = int(hf["num_attention_heads"])
    fields = dict(
        vocab_size=int(hf["vocab_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        embed_dim=int(hf["hidden_size"]),
        mlp_dim=int(hf["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        max_positions=int(hf.get("max_position_embeddings") or ModelConfig.max_positions),
        **_rope_fields(hf, where),
    )
    if arch == "MixtralForCausalLM":
        for key in ("num_local_experts", "num_experts_per_tok"):
            if key not in hf:
                raise ValueError(f"{where}: no {key!r} field")
        fields.update(
            num_experts=int(hf["num_local_experts"]),
            experts_per_token=int(hf["num_experts_per_tok"]),
            router_aux_coef=float(hf.get("router_aux_loss_coef", 0.02)),
        )
    elif arch == "Qwen3MoeForCausalLM":
        fields.update(_qwen3_moe_fields(hf, fields["num_layers"], where))
    try:
        return ModelConfig(**fields, **changes)
    except ValueError as e:
        raise with_context(e, f"{where}: ") from None


def _qwen3_moe_fields(hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a ``Qwen3MoeForCausalLM`` ``config.json``.

    Qwen3-MoE makes layer ``i`` a mixture when ``i`` is not in ``mlp_only_layers`` and ``(i + 1) %
    decoder_sparse_step == 0``; meshwork's placement is ``first_dense_layers`` dense layers, then every
    ``moe_every``-th (`ModelConfig.layer_kinds`), so the pair is found whose placement is the same.

    Raises:
      ValueError: a missing field, or a placement meshwork's two fields cannot express (one line).
    """
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes the second
    if experts is None:
        raise ValueError(f"{where}: no 'num_experts' field")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in hf:
            raise ValueError(f"{where}: no {key!r} field")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense_only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    kinds = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    if True not in kinds:
        raise ValueError(f"{where}: no layer is a mixture of experts (mlp_only_layers, decoder_sparse_step)")
    first = max(kinds.index(True) + 1 - step, 0)  # the dense layers before the first period
    if moe_placement(num_layers, first, step) != kinds or (num_layers - first) % step:
        raise ValueError(
            f"{where}: mlp_only_layers={sorted(dense_only)} with decoder_sparse_step={step} places the mixtures "
            "of experts where meshwork cannot (it has first_dense_layers dense layers, then every moe_every-th)"
        )
    return dict(
        num_experts=int(experts),
        experts_per_token=int(hf["num_experts_per_tok"]),
        moe_mlp_dim=int(hf["moe_intermediate_size"]),
        norm_topk=bool(hf.get("norm_topk_prob", False)),
        router_aux_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        moe_every=step,
        first_dense_layers=first,
    )


def init_config(folder: str | Path, preset: str | None = None, overrides: Sequence[str] = (), **changes) -> ModelConfig:
    """The `ModelConfig` of a run that starts from a Hugging Face folder (``--init-from FOLDER``).

    The architecture comes from the folder's ``config.json``; ``--set`` may change execution fields
    (``dtype``, ``remat``, ``attention``, ``logits``) and may repeat an architecture field's value, but
    not change it, and ``--model`` may only name a preset of the same architecture.

    Args:
      folder: the model folder.
      preset: ``--model`` when given, else None.
      overrides: the ``--set FIELD=VALUE`` items.
      **changes: execution fields from their own flags (``--dtype`` ...).

    Raises:
      ValueError: as `read_hf_config` and `config_from_hf`; a ``--model`` or ``--set`` whose architecture
        differs from the folder's, naming the field, both values and the remedy.
    """
    where = str(Path(folder) / CONFIG_FILE)
    base = config_from_hf(read_hf_config(folder), where)
    sets = parse_overrides(overrides)
    for name, value in sets.items():
        if name in ModelConfig.ARCHITECTURE_FIELDS and value != getattr(base, name):
            raise ConfigError(
                Override(name, value),
                f": conflicts with {where} ({name}={getattr(base, name)}); ",
                Field("init_from"),
                " takes the architecture from the folder, drop ",
                Override(name),
            )
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(
                Field("preset", repr(preset)), ": unknown preset; with ", Field("init_from"), ", drop ", Field("preset")
            )
        diff = config_differences(PRESETS[preset].architecture(), base)
        if diff:
            name, (ours, theirs) = next(iter(diff.items()))
            raise ConfigError(
                Field("preset", preset),
                f": conflicts with {where} ({name} {ours} in the preset, {theirs} in the folder); ",
                Field("init_from"),
                " takes the architecture from the folder, drop ",
                Field("preset"),
            )
    try:
        return base.replace(**{**changes, **sets})
    except ValueError as e:
        raise with_context(e, f"{where}: ") from None


def eod_token(folder: str | Path, tokenizer: str | Path | None = None) -> str | None:
    """The end-of-document token: ``config.json``'s ``eos_token_id`` (the first of a list) in the tokenizer.

    Args:
      folder: the model folder.
      tokenizer: the ``tokenizer.json`` to look the id up in (default: the folder's).

    Returns:
      The token's text, or None when ``config.json`` sets no ``eos_token_id``, there is no tokenizer or it does
      not load (the caller's load of it, `train.data.tokenizer.HFTokenizer`, says why in one line).
    """
    eos = token_id(read_hf_config(folder).get("eos_token_id"))
    path = Path(tokenizer) if tokenizer is not None else Path(folder) / TOKENIZER_FILE
    if eos is None or not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).id_to_token(eos)
    except Exception:  # the library raises its own exception types (not JSON, not a tokenizer)
        return None


def token_id(value) -> int | None:
    """A special token id of ``config.json`` (an int, a list: its first, or null) as an int or None."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def config_to_hf(
    config: ModelConfig, *, dtype: str = "float32", eos_token_id: int | None = None, bos_token_id: int | None = None
) -> dict[str, Any]:
    """A ``config.json`` for `config` in the family `family` names (`check_exportable`).

    Rotary settings are written both as ``rope_parameters`` (transformers 5) and as
    ``rope_theta`` + ``rope_scaling`` (earlier versions).

    Raises:
      ValueError: a model no supported family holds (`check_exportable`).
    """
    rope: dict[str, Any] = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    scaling = None
    if config.rope_type == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": config.rope_factor,
            "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_max_positions,
        }
        rope.update(scaling)
    architecture = family(config)
    model_type = MODEL_TYPES[architecture]
    mlp_dim = config.expert_dim if architecture == "MixtralForCausalLM" else config.mlp_dim
    out = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "intermediate_size": mlp_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_positions,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
    }
    if architecture == "MixtralForCausalLM":
        out.update(
            num_local_experts=config.num_experts,
            num_experts_per_tok=config.experts_per_token,
            router_aux_loss_coef=config.router_aux_coef,
            router_jitter_noise=0.0,
            output_router_logits=False,
            sliding_window=None,
            attention_dropout=0.0,
        )
    out.update(bos_token_id=bos_token_id, eos_token_id=eos_token_id, dtype=dtype, torch_dtype=dtype, use_cache=True)
    if architecture == "Qwen3MoeForCausalLM":
        out.update(
            moe_intermediate_size=config.expert_dim,
            num_experts=config.num_experts,
            num_experts_per_tok=config.experts_per_token,
            norm_topk_prob=config.norm_topk,
            decoder_sparse_step=config.moe_every,
            mlp_only_layers=list(range(config.first_dense_layers)),
            router_aux_loss_coef=config.router_aux_coef,
            output_router_logits=False,
            attention_dropout=0.0,
        )
    if model_type.startswith("qwen"):
        out.update(use_sliding_window=False, sliding_window=None)
    if model_type in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=False)
    elif model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    return out


# Reading -----------------------------------------------------------------------------------------


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the single file.

    Raises:
      ValueError: no safetensors in the folder (pickled ``pytorch_model*.bin`` only: refused with
        why and how to convert), or an index naming a missing file.
    """
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from None
        files = {name: folder / file for name, file in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise ValueError(f"{index}: names {path.name}, which is missing")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="numpy") as f:
            return {name: single for name in f.keys()}
    pickled = sorted(folder.glob("pytorch_model*.bin")) + sorted(folder.glob("*.pt")) + sorted(folder.glob("*.pth"))
    if pickled:
        raise ValueError(
            f"{folder}: only pickled weights ({pickled[0].name}); meshwork reads only safetensors because "
            f"unpickling runs code from the file; convert where you trust it: {_CONVERT.format(src=folder)}"
        )
    raise ValueError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")


class _Files:
    """Open safetensors files, one handle each, for the callbacks of one import."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._open: dict[Path, Any] = {}

    def handle(self, name: str):
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="numpy")
        return self._open[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handle(name).get_slice(name).get_shape())


def check_tensors(folder: str | Path, config: ModelConfig, files: dict[str, Path] | None = None) -> None:
    """Checks that every tensor `config` needs is in the folder with its shape, reading headers only.

    Raises:
      ValueError: a missing tensor or one of the wrong shape; one line naming tensor and file.
    """
    files = weight_files(folder) if files is None else files
    opened = _Files(files)
    first = next(iter(sorted(set(files.values()))), Path(folder))
    for m in tensor_maps(config):
        for name in m.names(config.num_layers):
            if name not in files:
                where = INDEX_FILE if (Path(folder) / INDEX_FILE).is_file() else first.name
                raise ValueError(f"{Path(folder) / where}: tensor {name} is missing")
            shape = opened.shape(name)
            if shape != m.hf_shape:
                raise ValueError(
                    f"{files[name]}: tensor {name} has shape {list(shape)}, config.json implies {list(m.hf_shape)}"
                )


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_params(folder: str | Path, config: ModelConfig, targets: dict[str, Any]) -> dict[str, Any]:
    """Reads a Hugging Face folder's tensors straight onto their shardings.

    Each array is built with `jax.make_array_from_callback`; the callback for a device's block
    reads only that block's rows and columns of the file (``safe_open(...).get_slice(name)[...]``),
    so a process reads what its devices hold and never the whole model. Stored bfloat16/float16
    values are converted to each target's dtype.

    Args:
      folder: the model folder (``config.json`` + safetensors).
      config: its `ModelConfig` (`config_from_hf`); the layer stack must be canonical ``[L, ...]``.
      targets: meshwork's params tree of `jax.ShapeDtypeStruct` with ``sharding`` set (e.g. from
        `models.transformer.abstract_model` and `sharding.rules.tree_shardings`).

    Returns:
      The params tree of `jax.Array`, each on its target's sharding, in its target's dtype.

    Raises:
      ValueError: as `weight_files` and `check_tensors` (before any array is built), or a target
        whose shape differs from the config's.
    """
    import jax

    files = weight_files(folder)
    check_tensors(folder, config, files)
    opened = _Files(files)
    params: dict[str, Any] = {}
    for m in tensor_maps(config):
        target = _get(targets, m.path)
        lead = m.lead(config.num_layers)
        expected = lead + m.shape
        if tuple(target.shape) != expected:
            raise ValueError(
                f"target {'/'.join(m.path)} has shape {tuple(target.shape)}, the config implies {expected}"
            )
        dtype = np.dtype(target.dtype)

        def callback(index, m=m, dtype=dtype, shape=expected, lead=lead):
            index = tuple(slice(*s.indices(size)[:2]) for s, size in zip(index, shape))
            names = dict((at, name) for name, at in m.entries(config.num_layers))
            rows = np.ndindex(*(s.stop - s.start for s in index[: len(lead)]))
            blocks = []
            for offset in rows:
                name = names[tuple(s.start + o for s, o in zip(index, offset))]
                blocks.append(read_block(lambda name=name: opened.handle(name).get_slice(name), m, index[len(lead) :]))
            sizes = tuple(s.stop - s.start for s in index[: len(lead)])
            return np.stack(blocks).reshape(*sizes, *blocks[0].shape).astype(dtype)

        _set(params, m.path, jax.make_array_from_callback(expected, target.sharding, callback))
    return params


# Writing -----------------------------------------------------------------------------------------


def _host_value(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-process) array gathered to this host as numpy."""
    import jax

    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _hf_tensor(params: dict[str, Any], m: TensorMap, at: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """One Hugging Face tensor from meshwork's params (``at``: its layer row and expert), gathered alone."""
    value = _get(params, m.path)
    value = _host_value(value[at] if at else value)
    flat = value.transpose(np.argsort(m.perm)).reshape(m.hf_shape)
    return np.ascontiguousarray(flat.astype(dtype))


def save_params(
    folder: str | Path,
    config: ModelConfig,
    params: dict[str, Any],
    *,
    dtype: str = "float32",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    tokenizer: str | Path | None = None,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Writes a Hugging Face folder ``transformers`` reads: ``config.json``, safetensors, index, tokenizer.

    Tensors are gathered one at a time (one layer of a stacked parameter), converted to
    ``dtype`` and written in files of at most ``max_shard_size`` bytes (a tensor larger than that
    gets a file of its own): ``model.safetensors`` when one file holds all, else
    ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``. Only process 0
    writes; every process takes part in the gathers.

    Args:
      folder: where to write (created; must be empty unless ``overwrite``).
      config: the model.
      params: meshwork's params tree (arrays, possibly sharded over a mesh), canonical layer stack.
      dtype: ``float32``, ``bfloat16`` or ``float16`` (`EXPORT_DTYPES`).
      max_shard_size: bytes per safetensors file.
      tokenizer: a ``tokenizer.json`` to copy, or None.
      eos_token_id, bos_token_id: written to ``config.json`` and ``generation_config.json``.
      overwrite: allow a non-empty folder.

    Returns:
      The files written, in order.

    Raises:
      ConfigError: an unknown ``dtype``, a non-positive ``max_shard_size``, or a non-empty folder (the field
        ``export_folder``).
    """
    import jax
    from safetensors.numpy import save_file

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(Field("dtype", dtype), f": choose one of {', '.join(EXPORT_DTYPES)}")
    if max_shard_size <= 0:
        raise ConfigError(
            Field("max_shard_size", max_shard_size), ": must be a positive number of bytes, e.g. 5000000000"
        )
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise ConfigError(Field("export_folder", folder), ": not empty; give a new folder")
    np_dtype = EXPORT_DTYPES[dtype]
    check_exportable(config)
    entries = [(name, m, at) for m in tensor_maps(config) for name, at in m.entries(config.num_layers)]
    shards: list[list[tuple[str, TensorMap, tuple[int, ...]]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1].hf_shape) * np_dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    writer = jax.process_index() == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
    written, weight_map, total = [], {}, 0
    for k, shard in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _hf_tensor(params, m, layer, np_dtype) for name, m, layer in shard}
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: file for name in tensors})
        if writer:
            save_file(tensors, str(folder / file), metadata={"format": "pt"})
            written.append(folder / file)
    if not writer:
        return []
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        written.append(folder / INDEX_FILE)
    hf = config_to_hf(config, dtype=dtype, eos_token_id=eos_token_id, bos_token_id=bos_token_id)
    (folder / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    written += [folder / CONFIG_FILE, folder / "generation_config.json"]
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / TOKENIZER_FILE)
        written.append(folder / TOKENIZER_FILE)
        (folder / TOKENIZER_CONFIG_FILE).write_text(
            json.dumps(tokenizer_config(tokenizer, eos_token_id, bos_token_id), indent=2) + "\n"
        )
        written.append(folder / TOKENIZER_CONFIG_FILE)
    _readable(written)
    return written


def tokenizer_config(tokenizer: str | Path, eos_token_id: int | None, bos_token_id: int | None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` that lets ``transformers.AutoTokenizer`` load an exported ``tokenizer.json``.

    ``PreTrainedTokenizerFast`` reads the vocabulary, normalisation and special tokens from ``tokenizer.json``;
    this file names that class and which tokens end and begin a sequence (looked up by id in the tokenizer).

    Args:
      tokenizer: the ``tokenizer.json`` exported beside it.
      eos_token_id, bos_token_id: the ids ``config.json`` names, or None.

    Returns:
      The JSON object to write.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for field, token in (("eos_token", eos_token_id), ("bos_token", bos_token_id)):
        text = None if token is None else tok.id_to_token(int(token))
        if text is not None:
            out[field] = text
    return out


def _readable(files: Sequence[Path]) -> None:
    """Gives written files the modes of any new file under the process's umask (safetensors writes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for f in files:
        os.chmod(f, 0o666 & ~mask)
