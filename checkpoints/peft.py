"""Low-rank adapters as a PEFT adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``.

The format is the one Hugging Face's ``peft`` library reads for a LoRA adapter of a ``transformers`` causal
LM (its ``LoraConfig`` fields and its state-dict key names): for each adapted ``nn.Linear`` named ``NAME``
(``model.layers.{i}.self_attn.q_proj``; the same names as `checkpoints.hf_families.tensor_maps`' tensors
without ``.weight``), ``base_model.model.NAME.lora_A.weight [r, in_features]`` and
``base_model.model.NAME.lora_B.weight [out_features, r]``; the layer computes
``W x + (lora_alpha / r) * lora_B (lora_A x)`` (Hu et al., 2021, section 4.1; ``peft``'s ``scaling``).

meshwork's factors of a weight ``W [in..., out...]`` are ``W_lora_a [in..., r]`` and ``W_lora_b [r,
out...]`` (`models.lora`); the Hugging Face tensor of ``W`` is ``[out_flat, in_flat]`` with the
dimensions permuted as its `checkpoints.hf_families.TensorMap` says, so ``lora_A`` is ``W_lora_a``'s input
dimensions in that order, flattened and transposed, and ``lora_B`` likewise of ``W_lora_b``'s outputs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from checkpoints import hf
from checkpoints.hf import _host_value
from checkpoints.hf_families import TensorMap, tensor_maps
from models.config import LORA_SUFFIXES, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
"""``peft``'s prefix before a causal LM's own module names."""


def _factor_order(m: TensorMap, inputs: int) -> tuple[list[int], list[int]]:
    """meshwork's per-entry dimensions in the Hugging Face tensor's order: ``(input dims, output dims)``,
    each a list of meshwork's dimension indices (``inputs``: how many leading ones are inputs).

    Raises:
      ValueError: A map whose Hugging Face tensor is not ``[outputs..., inputs...]`` (not a linear layer).
    """
    outs = len(m.split[0])
    hf_to_ours = {hf: ours for ours, hf in enumerate(m.perm)}
    out_dims = [hf_to_ours[j] for j in range(outs)]
    in_dims = [hf_to_ours[j] for j in range(outs, len(m.perm))]
    if sorted(in_dims) != list(range(inputs)):
        raise ValueError(f"{m.hf_name} is not a linear layer's [out, in] weight over meshwork's inputs")
    return in_dims, out_dims


def adapter_tensors(config: ModelConfig, params: dict[str, Any], fetch=_host_value) -> dict[str, np.ndarray]:
    """The PEFT state dict of a model's adapters (module docstring), float32.

    Args:
      config: A model with adapters (``lora_rank`` > 0).
      params: Its parameters, canonical ``[layers, ...]`` stacks (arrays, possibly sharded).
      fetch: How an array (one factor) reaches the host as numpy (default: gathered over processes).

    Returns:
      ``{key: array}`` in the Hugging Face tensors' order.
    """
    suffix_a, suffix_b = LORA_SUFFIXES
    out = {}
    for m in tensor_maps(config):
        node = params
        for key in m.path[:-1]:
            node = node[key]
        name = m.path[-1]
        if name + suffix_a not in node:
            continue
        a, b = fetch(node[name + suffix_a]), fetch(node[name + suffix_b])
        inputs = a.ndim - 1 - len(m.lead(config.num_layers))
        in_dims, out_dims = _factor_order(m, inputs)
        for hf_name, at in m.entries(config.num_layers):
            one_a, one_b = a[at], b[at]  # [in..., r], [r, out...]
            lora_a = one_a.transpose(*in_dims, inputs).reshape(-1, config.lora_rank).T
            lora_b = one_b.transpose(0, *(1 + d - inputs for d in out_dims)).reshape(config.lora_rank, -1).T
            module = PREFIX + hf_name.removesuffix(".weight")
            out[module + ".lora_A.weight"] = np.ascontiguousarray(lora_a, np.float32)
            out[module + ".lora_B.weight"] = np.ascontiguousarray(lora_b, np.float32)
    return out


def adapter_config(config: ModelConfig, tensors: dict[str, np.ndarray], base_model: str | None) -> dict[str, Any]:
    """``adapter_config.json``: ``peft``'s ``LoraConfig`` fields for these adapters (no dropout, no bias)."""
    modules = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def save_adapters(
    folder: str | Path, config: ModelConfig, params: dict[str, Any], base_model: str | None = None, fetch=_host_value
) -> list[Path]:
    """Writes the adapters of ``params`` as a PEFT folder (module docstring); only the factors, float32.

    Args:
      folder: An empty or new folder.
      config: A model with adapters.
      params: Its parameters, canonical stacks.
      base_model: Written as ``base_model_name_or_path`` (the base model's folder), or None.
      fetch: As `adapter_tensors`.

    Returns:
      The two files written.
    """
    from safetensors.numpy import save_file  # optional: the data extra's safetensors

    tensors = adapter_tensors(config, params, fetch)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(adapter_config(config, tensors, base_model), indent=2) + "\n")
    return [folder / CONFIG_FILE, folder / WEIGHTS_FILE]


def weights_digest(folder: str | Path) -> str:
    """A fingerprint of a folder's weights: SHA-256 over its safetensors files, each file's name and the
    SHA-256 of its bytes, in name order (the index and ``config.json`` left out: the tensors are the base).

    It reads every byte (seconds per 10 GB at disk speed): a run whose checkpoints keep only adapters records
    it at the start and compares it on restore, so a folder whose weights changed is not silently used as the
    base of adapters trained on other weights. A resume does both on one folder, so the digest is kept for the
    process, keyed by each file's path, size, inode and modification and change times: a file rewritten or
    replaced since is read again.

    Raises:
      ValueError: As `checkpoints.hf.weight_files`.
    """
    paths = sorted(set(hf.weight_files(folder).values()))
    key = tuple((str(p.resolve()), *_stamp(p)) for p in paths)
    if key not in _DIGESTS:
        out = hashlib.sha256()
        for path in paths:
            with open(path, "rb") as f:
                out.update(path.name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
        _DIGESTS[key] = out.hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict[tuple, str] = {}
"""`weights_digest` of each set of files hashed in this process, by the files' paths and `_stamp`s."""


def _stamp(path: Path) -> tuple[int, int, int, int]:
    """What changes when a file is rewritten or replaced: size, inode, modification and change times (ns)."""
    st = path.stat()
    return st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns
