"""The XLA:CPU code generation of a default build, for the few checks whose tolerance is a default build's
float32 rounding.

`tests/conftest.py` compiles the suite with XLA:CPU's older elemental emitter (``--xla_cpu_use_fusion_emitters
=false``: about half the compile time). Both round IEEE float32 correctly per operation, but they may order a
fused reduction's sums differently, so two programs that compute the same gradients along different paths (a
recomputed forward against a saved one) can differ by a few units in the last place more under one than the
other. A check whose bound was set on a default build compiles its programs with `DEFAULT_CODEGEN`.
"""

import os

import jax

#: Compiler options (`jax.stages.Lowered.compile`) that restore the default emitter where the suite turned it
#: off; empty where it did not (a JAX whose XLA no longer has the flag).
DEFAULT_CODEGEN: dict[str, bool] = (
    {"xla_cpu_use_fusion_emitters": True}
    if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
    else {}
)


def compile_default(fn, *args):
    """``jax.jit(fn)`` compiled for ``args`` with a default build's code generation, called on them."""
    return jax.jit(fn).lower(*args).compile(DEFAULT_CODEGEN)(*args)
