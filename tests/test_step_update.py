"""The optimizer update of `train.runtime.step.Trainer.apply_gradients`: exact against optax, a non-finite step
leaves the state as it was (AdamW, updated inside the finite-step conditional, and Adafactor, updated before
it), and the compiled update does not copy the optimizer state nor hold new moments beside the old."""

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
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer


def _trainer(name="adamw"):
    return Trainer(
        get_config("test"),
        OptimizerConfig(decay_steps=8, warmup=1, name=name),
        Parallelism.of(make_mesh(parse_mesh("fsdp=8", 8)), get_rules("fsdp")),
    )


@pytest.fixture(scope="module")
def trainer():
    return _trainer()


@pytest.fixture(scope="module")
def trainers(trainer):
    """By optimizer name: AdamW (the module's trainer) and Adafactor, whose update has reductions and so runs
    before the conditional (`train.runtime.optimizer.ELEMENTWISE`)."""
    return {"adamw": trainer, "adafactor": _trainer("adafactor")}


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


def test_adafactor_updated_before_the_conditional_equals_optax_and_skips_a_non_finite_step(trainers):
    trainer = trainers["adafactor"]
    state = trainer.init_state(0)
    grads = _grads(state)

    @jax.jit
    def reference(params, opt_state, grads):  # weight 1: the mean gradient is the gradient
        updates, opt_state = trainer.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = reference(state["params"], state["opt_state"], grads)
    new, metrics = _apply(trainer, state, 3.5, 1.0, grads)
    assert bool(metrics["finite"])
    for got, want in zip(jax.tree.leaves((new["params"], new["opt_state"])), jax.tree.leaves((params, opt_state))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    before = jax.tree.map(np.asarray, new)
    skipped, metrics = _apply(trainer, new, np.nan, 1.0, _grads(new, 1))
    assert not bool(metrics["finite"])
    for got, want in zip(
        jax.tree.leaves((skipped["params"], skipped["opt_state"])),
        jax.tree.leaves((before["params"], before["opt_state"])),
    ):
        np.testing.assert_array_equal(np.asarray(got), want)


def _compiled(trainer, apply_gradients):
    """``apply_gradients`` compiled on the trainer's abstract state (donated), gradients laid out as the
    parameters."""
    abstract = trainer.abstract_state()
    grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract["params"])
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    stop = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=trainer.signal_sharding()["stop"])
    return jax.jit(apply_gradients, donate_argnums=0).lower(abstract, scalar, scalar, grads, stop).compile()


@pytest.fixture(scope="module")
def compiled_update(trainer):
    return _compiled(trainer, trainer.apply_gradients)


def _update_before_the_conditional(trainer):
    """The guard as it was: the whole optax update (new moments and updates of every parameter) computed
    before the `jax.lax.cond` that keeps either the new state or the old."""

    def apply_gradients(state, loss_sum, weight, grads, signals):
        grads = jax.tree.map(lambda g: g / jnp.maximum(weight, 1.0), grads)
        finite = jnp.isfinite(loss_sum) & jnp.isfinite(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        updates, new = trainer.tx.update(grads, state["opt_state"], state["params"])
        params, opt_state = jax.lax.cond(
            finite,
            lambda u, n, p, o: (optax.apply_updates(p, u), n),
            lambda u, n, p, o: (p, o),
            updates,
            new,
            state["params"],
            state["opt_state"],
        )
        return {**state, "params": params, "opt_state": opt_state}, finite

    return apply_gradients


def test_the_update_holds_no_second_copy_of_the_moments(trainer, compiled_update):
    """Computed inside the conditional, the update writes the donated moments and parameters in place: its
    temporaries are the mean gradient (one parameter-sized array: the gradients are not donated) and a few
    scalars. Computed before the conditional, the new moments (two parameter-sized arrays) were held beside
    the old ones, which the skipped branch still reads. `memory_analysis` is deterministic (here 462,864
    against 1,379,216 bytes, the parameters 459,328 bytes per device)."""
    params = sum(
        np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(trainer.abstract_state()["params"])
    )
    temp = compiled_update.memory_analysis().temp_size_in_bytes
    before = _compiled(trainer, _update_before_the_conditional(trainer)).memory_analysis().temp_size_in_bytes
    assert temp <= 1.01 * params, (temp, params)
    assert before - temp >= 1.99 * params, (before, temp, params)


def test_the_compiled_update_copies_no_state_and_puts_no_collective_in_a_conditional(trainer, compiled_update):
    """The update writes the donated state in place: no ``copy`` of a state argument in the compiled HLO
    (a guard by `jnp.where` made XLA copy the old moments, which its scheduler hoisted to the start of the
    step; see bench/RESULTS.md, "Pipeline step memory"). Its conditional holds no collective: a pipelined run
    checks the compiled step for those (`sharding.hlo.branch_collectives`) and would fall back to computing
    every slot."""
    text = compiled_update.as_text()
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
