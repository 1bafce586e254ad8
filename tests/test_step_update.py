"""The optimizer update of `train.step.Trainer.apply_gradients`: exact against optax, a non-finite step
leaves the state as it was, and the compiled update does not copy the optimizer state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models.config import get_config
from sharding.hlo import branch_collectives
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import Parallelism
from sharding.rules import get_rules
from train.optimizer import OptimizerConfig
from train.step import Trainer


@pytest.fixture(scope="module")
def trainer():
    return Trainer(
        get_config("test"),
        OptimizerConfig(decay_steps=8, warmup=1),
        Parallelism.of(make_mesh(parse_mesh("fsdp=8", 8)), get_rules("fsdp")),
    )


# One jitted program each (built on first use, shared by the tests): run op by op, the normal draws and the
# optax reference compiled ~150 one-operation programs on the sharded arrays.
_JITTED = {}


def _grads(state, seed=0):
    """Standard normal gradients shaped as the parameters, a fixed draw per ``seed``."""
    leaves, tree = jax.tree.flatten(state["params"])
    shapes = tuple((x.shape, x.dtype, x.sharding) for x in leaves)
    if shapes not in _JITTED:

        def draw(key):
            keys = jax.random.split(key, len(shapes))
            return [jax.random.normal(k, shape, dtype) for k, (shape, dtype, _) in zip(keys, shapes)]

        # laid out as the parameters (the draw does not depend on the layout)
        _JITTED[shapes] = jax.jit(draw, out_shardings=[sharding for _, _, sharding in shapes])
    return tree.unflatten(_JITTED[shapes](jax.random.key(seed)))


def _apply(trainer, state, loss_sum, weight, grads):
    stop = jnp.zeros((8,), jnp.int32)
    if trainer not in _JITTED:
        _JITTED[trainer] = jax.jit(trainer.apply_gradients)
    return _JITTED[trainer](state, jnp.float32(loss_sum), jnp.float32(weight), grads, stop)


def test_a_finite_update_equals_optax_on_the_mean_gradient(trainer):
    state = trainer.init_state(0)
    grads = _grads(state)
    weight = 7.0

    @jax.jit
    def reference(params, opt_state, grads):  # optax's own update of the mean gradient
        mean = jax.tree.map(lambda g: g / weight, grads)
        updates, opt_state = trainer.tx.update(mean, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = reference(state["params"], state["opt_state"], grads)
    new, metrics = _apply(trainer, state, 3.5, weight, grads)
    assert bool(metrics["finite"]) and int(new["step"]) == 1
    for got, want in zip(jax.tree.leaves((new["params"], new["opt_state"])), jax.tree.leaves((params, opt_state))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", ["loss", "gradient"])
def test_a_non_finite_step_leaves_parameters_and_optimizer_state_unchanged(trainer, bad):
    state = trainer.init_state(0)
    state, _ = _apply(trainer, state, 2.0, 4.0, _grads(state, 1))  # moments nonzero, count 1
    before = jax.tree.map(np.asarray, state)
    grads = _grads(state, 2)
    if bad == "gradient":
        grads = jax.jit(lambda t: jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), t))(grads)
    new, metrics = _apply(trainer, state, np.nan if bad == "loss" else 2.0, 4.0, grads)
    assert not bool(metrics["finite"])
    assert int(new["step"]) == int(before["step"]) + 1
    for got, want in zip(
        jax.tree.leaves((new["params"], new["opt_state"])), jax.tree.leaves((before["params"], before["opt_state"]))
    ):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_the_compiled_update_copies_no_state_and_puts_no_collective_in_a_conditional(trainer):
    """The update writes the donated state in place: no ``copy`` of a state argument in the compiled HLO
    (a guard by `jnp.where` made XLA copy the old moments, which its scheduler hoisted to the start of the
    step; see bench/RESULTS.md, "Pipeline step memory"). Its conditional holds no collective: a pipelined run
    checks the compiled step for those (`sharding.hlo.branch_collectives`) and would fall back to computing
    every slot."""
    abstract = trainer.abstract_state()
    grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract["params"])
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    stop = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=trainer.signal_sharding()["stop"])
    compiled = jax.jit(trainer.apply_gradients, donate_argnums=0).lower(abstract, scalar, scalar, grads, stop).compile()
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    params = {line.split("=")[0].strip().lstrip("%") for line in entry.splitlines() if " parameter(" in line}
    copied = [
        line.strip()[:120]
        for line in entry.splitlines()
        if " copy(" in line and line.split("copy(", 1)[1].split(")")[0].lstrip("%") in params
    ]
    big = [line for line in copied if "[]" not in line.split("=", 1)[1].split(" copy(")[0]]
    assert not big, big
    assert branch_collectives(text, trainer.mesh) == []
