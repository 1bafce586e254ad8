"""Every train step lowered for CUDA on this CPU-only machine: the GPU paths CPU never runs.

`jax.export.export(jax.jit(f), platforms=["cuda"])` lowers a jitted function for a platform that is not
present (lowering only: nothing is compiled or run). Each configuration below builds its `Trainer`, lowers
its jitted train step from abstract arguments (`Trainer.abstract_train_args`: `jax.ShapeDtypeStruct`s with
their shardings on the 8 simulated devices) once (`_lowered`, cached for the module), and checks the
StableHLO module a GPU would compile:

* the custom calls are the expected ones: the flash kernel's three Triton calls (forward, dq, dk/dv,
  ``__gpu$xla.gpu.triton`` named ``flash_attention_forward``/``_dq``/``_dkv``) wherever a kernel runs flash
  attention per block; none for the kernels XLA partitions itself (``reference``, ``dot_product``);
* no CPU fallback slipped in: the Pallas interpreter, which the kernels choose by the platform they are
  lowered for (`jax.lax.platform_dependent`), would add ``while`` loops over the kernel's grid where a
  Triton call is expected, so a flash lowering has exactly the loops of the same step with the reference
  attention.

Covered: every registered attention kernel, uneven per-device counts, every pipeline schedule with both
gather modes, a mixture of experts on an expert mesh with both of its dispatches (the ring and the
fixed-buffer all-to-all), context parallelism (ring, Ulysses, USP) and generation's decoding step. ROCm
lowers the same Triton calls (checked for the plain flash step).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

from models import attention_registry
from models.config import get_config
from models.generation import CACHE_NAMES, Generator, Sampling, cache_shape
from sharding import pipeline as pl
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Accumulation, Parallelism, UnevenBatch
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer

TRITON = "__gpu$xla.gpu.triton"
FLASH_KERNELS = ("flash_attention_forward", "flash_attention_dq", "flash_attention_dkv")
# Custom calls without a compatibility guarantee that export refuses to serialise unless told; lowering
# alone is what is checked, so the check is turned off for them.
CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
CUDNN_MASKED = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
DISABLED = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (TRITON, *CUDNN, *CUDNN_MASKED)]

BATCH, SEQ = 8, 64
FLASH_BASED = {"flash", "ring", "ulysses", "usp"}
"""The kernels that run our flash kernel per block, so their lowering carries its Triton calls."""


@contextlib.contextmanager
def _cudnn_present():
    """JAX's cuDNN attention asks the installed cuDNN for its version and the GPU for its compute capability
    while tracing (a CPU-only jaxlib has neither, and refuses); for a lowering made here, answer as cuDNN 9.10
    on a Hopper GPU would. Test-only: patches JAX's private cuDNN module, where it has those functions."""
    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not all(hasattr(fused, n) for n in ("check_cudnn_version", "check_compute_capability")):
        pytest.skip("this JAX's cuDNN attention asks the GPU in another way")
    with (
        mock.patch.object(fused, "check_cudnn_version", lambda: 91000),
        mock.patch.object(fused, "check_compute_capability", lambda capability: float(capability) <= 9.0),
        mock.patch.object(
            fused, "is_cuda_compute_capability_equal", lambda capability: capability == "9.0", create=True
        ),
    ):
        yield


@contextlib.contextmanager
def _target_gpu():
    """Newer JAX (0.12) reads the target GPU's compute capability while lowering a Triton kernel, from the
    local device or an abstract device; a CPU-only machine has neither, so for a lowering made here it is
    told the target is an H100. Test-only: patches JAX's private GPU table, where this JAX has one."""
    try:
        from jax._src import gpu_info  # optional: JAX >= 0.12 only
    except ImportError:
        yield
        return
    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        yield


def _export(fn, platform: str, args, cudnn: bool = False) -> str:
    """The StableHLO text of ``fn`` exported for ``platform`` from abstract ``args`` (lowering only)."""
    exported = jax.export.export(fn, platforms=[platform], disabled_checks=DISABLED)
    with _target_gpu(), _cudnn_present() if cudnn else contextlib.nullcontext():
        return exported(*args).mlir_module()


@functools.cache
def _lowered(config_key: tuple, mesh_spec: str, rules: str, plan_key: tuple = (), platform: str = "cuda") -> str:
    """The StableHLO text of the train step of ``get_config(*config_key)`` on ``mesh_spec`` under ``rules``,
    exported for ``platform``; ``plan_key`` ``("uneven", counts)`` or ``("pipeline", schedule, gather,
    repeats)`` picks the strategy (else one pass of accumulation). One lowering per configuration."""
    config = get_config(config_key[0], list(config_key[1:]))
    mesh = make_mesh(parse_mesh(mesh_spec, 8))
    batch, plan = BATCH, None
    if not plan_key:
        strategy = Accumulation(1)
    elif plan_key[0] == "uneven":
        strategy, batch = UnevenBatch(plan_key[1]), sum(plan_key[1])
    else:
        _, schedule, gather, repeats = plan_key
        layout, _ = pl.plan_layout(config.num_layers, mesh.shape["stage"], repeats)
        strategy, plan = Accumulation(1), pl.PipelinePlan(layout, mesh.shape["stage"], schedule=schedule, gather=gather)
    trainer = Trainer(config, OptimizerConfig(), Parallelism.of(mesh, rules, strategy, pipeline=plan))
    step = trainer.train_step(batch, SEQ)
    return _export(step, platform, trainer.abstract_train_args(batch, SEQ), cudnn=config.attention == "cudnn")


def custom_calls(text: str) -> set[str]:
    """The custom-call targets of a StableHLO module."""
    return set(re.findall(r"custom_call @([\w$.]+)", text))


def loops(text: str) -> int:
    """The number of ``while`` loops in a StableHLO module."""
    return text.count("stablehlo.while")


def check_flash(text: str) -> None:
    """The module runs the flash kernel through Triton: only Triton custom calls, each of the three kernels."""
    assert custom_calls(text) == {TRITON}
    for name in FLASH_KERNELS:
        assert f'name = "{name}"' in text, name


def check_kernel(text: str, attention: str) -> None:
    """The custom calls of a step whose model runs ``attention``."""
    if attention in FLASH_BASED:
        check_flash(text)
    elif attention == "cudnn":  # the train batch's document mask (segment ids) goes in as a bias
        assert custom_calls(text) == {*CUDNN_MASKED}
    else:
        assert custom_calls(text) == set()


BASE = ("fsdp=4,tensor=2", "fsdp_tp")
CONTEXT = {"ring": "data=2,sequence=4", "ulysses": "data=2,sequence=4", "usp": "data=2,context=2,sequence=2"}
"""The mesh each context-parallel kernel splits the length on; every other kernel runs on `BASE`."""


def _kernel_mesh(name: str) -> str:
    return CONTEXT.get(name, BASE[0])


@pytest.mark.parametrize("attention", attention_registry.names())
def test_each_attention_kernel_lowers_its_gpu_path(attention):
    """Every registered kernel's train step lowers for CUDA with its GPU path (Triton for the flash-based
    ones), and a flash-based one has no more loops than the reference attention on the same mesh: no
    interpreter loop where a Triton call is expected."""
    mesh = _kernel_mesh(attention)
    dtype = attention_registry.kernel(attention).dtypes[:1] or ("float32",)
    text = _lowered(("test", f"attention={attention}", f"dtype={dtype[0]}"), mesh, "fsdp_tp")
    check_kernel(text, attention)
    if attention in FLASH_BASED - {"ring", "usp"}:  # ring passes blocks around in a loop of its own
        assert loops(text) == loops(_lowered(("test", "attention=reference"), mesh, "fsdp_tp"))


def test_the_interpreter_is_what_cpu_lowers():
    """The same flash step lowered for CPU carries the Pallas interpreter (the loops the CUDA check above
    rules out) and no Triton call: the check can fail."""
    text = _lowered(("test", "attention=flash"), *BASE, platform="cpu")
    assert custom_calls(text) == set()
    assert loops(text) > loops(_lowered(("test", "attention=reference"), *BASE))


def test_rocm_lowers_the_same_triton_kernels():
    check_flash(_lowered(("test", "attention=flash"), *BASE, platform="rocm"))


def test_uneven_counts_lower_with_flash():
    """Uneven per-device microbatch counts (a loop whose trip count differs per device) around flash."""
    text = _lowered(("test", "attention=flash"), "data=2,fsdp=4", "fsdp", ("uneven", (3, 3, 3, 3, 1, 1, 1, 1)))
    check_flash(text)


@pytest.mark.parametrize("gather", pl.GATHERS)
@pytest.mark.parametrize("schedule", list(pl.Schedule))
def test_every_pipeline_schedule_lowers_with_flash(schedule, gather):
    """Each schedule (circular on two chunks per stage) with each gather mode: the flash kernel inside the
    stage program (a map nested in the pipeline's) lowers to its Triton calls."""
    repeats = 2 if schedule == pl.Schedule.CIRCULAR else 1
    text = _lowered(
        ("test", "attention=flash"), "stage=2,fsdp=4", "fsdp_tp", ("pipeline", schedule.value, gather, repeats)
    )
    check_flash(text)


@pytest.mark.parametrize("capacity", ["0", "1.0"])
def test_moe_on_an_expert_mesh_lowers_both_dispatches(capacity):
    """A mixture of experts split over ``expert=4``: dropless (the ring: all-gather, reduce-scatter) and with
    a capacity (fixed-buffer all-to-all; cf * k = 2 < 4), with flash attention. The grouped products
    (`jax.lax.ragged_dot`) lower to XLA ops, not a custom call."""
    text = _lowered(("moe-test", "attention=flash", f"capacity_factor={capacity}"), "expert=4,fsdp=2", "fsdp")
    check_flash(text)
    collective = "all_to_all" if capacity != "0" else "reduce_scatter"
    assert f"stablehlo.{collective}" in text


def test_generation_decode_step_lowers():
    """Generation's one-token decoding step (the cache read with the reference attention) for CUDA."""
    config = get_config("test", ["attention=flash"])
    par = Parallelism.of(make_mesh(parse_mesh(BASE[0], 8)), BASE[1])
    trainer = Trainer(config, OptimizerConfig(), par)
    params = trainer.abstract_state()["params"]
    shape = cache_shape(config, BATCH, SEQ)
    cache = jax.ShapeDtypeStruct(shape, jnp.dtype(config.dtype), sharding=par.sharding(CACHE_NAMES, shape))
    _, step = Generator(config, trainer.graphdef, params, par).functions(Sampling())
    vector = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    text = _export(
        step, "cuda", (params, {"k": cache, "v": cache}, vector, vector, jax.ShapeDtypeStruct((), jnp.int32))
    )
    assert custom_calls(text) == set()
    assert "stablehlo.dot_general" in text


def test_the_gpu_check_says_there_is_no_gpu_and_fails(capsys, tmp_path):
    """bench/gpu_check.py on this CPU: one line saying so, exit 1, nothing written."""
    spec = importlib.util.spec_from_file_location(
        "gpu_check", Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path / "check.json")]) == 1
    assert capsys.readouterr().err.strip() == "gpu_check: no GPU here (JAX sees cpu devices); run it on a GPU machine"
    assert not (tmp_path / "check.json").exists()
