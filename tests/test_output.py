"""The fused output projection and loss: vocabulary-parallel equals gathered, and where each applies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli_errors import raises_as_cli

from models.config import get_config
from models.output import cross_entropy_sums, output_loss_sums, project_logits
from models.transformer import abstract_model, init_params, loss_sums
from sharding import hlo
from sharding.mesh import make_mesh, parse_mesh
from sharding.parallel import UNSHARDED, Accumulation, Parallelism
from sharding.rules import get_rules, tree_shardings
from sharding.vocab import choose_output, output_traffic, vocab_split
from train.runtime.optimizer import OptimizerConfig
from train.runtime.step import Trainer

MESHES = ["fsdp=8", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2", "data=2,fsdp=4"]


def _batch(config, batch=16, length=24, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch, length + 1)).astype(np.int32)
    mask = (rng.random((batch, length)) > 0.2).astype(np.float32)
    return tokens[:, :-1], tokens[:, 1:], mask


def _sharded_loss_and_grads(config, params, names, mesh_spec, tokens, targets, mask):
    graphdef, _, _ = abstract_model(config)
    mesh, rules = make_mesh(parse_mesh(mesh_spec, 8)), get_rules("fsdp_tp")
    shardings, _ = tree_shardings(params, names, mesh, rules)

    @jax.jit
    def run(p):
        par = Parallelism.of(mesh, rules)
        return jax.value_and_grad(lambda p: loss_sums(graphdef, p, tokens, targets, mask, par=par), has_aux=True)(p)

    with jax.default_matmul_precision("highest"):
        return run(jax.device_put(params, shardings))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_vocab_parallel_loss_and_gradients_equal_gathered(mesh_spec, tied):
    config = get_config("test", ["num_layers=2", f"tie_embeddings={tied}"])
    _, _, names = abstract_model(config)
    params = jax.jit(lambda k: init_params(config, k))(jax.random.key(0))
    tokens, targets, mask = _batch(config)
    (want, want_weight), want_grads = _sharded_loss_and_grads(
        config.replace(logits="gathered"), params, names, mesh_spec, tokens, targets, mask
    )
    (got, got_weight), got_grads = _sharded_loss_and_grads(
        config.replace(logits="vocab_parallel"), params, names, mesh_spec, tokens, targets, mask
    )
    assert float(got_weight) == float(want_weight) == mask.sum()
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for path, a in jax.tree_util.tree_leaves_with_path(want_grads):
        b = dict(jax.tree_util.tree_leaves_with_path(got_grads))[path]
        scale = float(jnp.max(jnp.abs(a)))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5 * scale, err_msg=str(path))


def test_gathered_loss_is_the_cross_entropy_of_the_logits():
    config = get_config("test", ["num_layers=1"])
    graphdef, _, _ = abstract_model(config)
    params = jax.jit(lambda k: init_params(config, k))(jax.random.key(2))
    tokens, targets, mask = _batch(config, batch=2, length=8)
    from models.transformer import apply

    logits = np.asarray(apply(graphdef, params, tokens, par=UNSHARDED), np.float64)
    logits -= logits.max(-1, keepdims=True)
    nll = np.log(np.exp(logits).sum(-1)) - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    loss, weight = loss_sums(graphdef, params, tokens, targets, mask, par=UNSHARDED)
    np.testing.assert_allclose(float(loss), (nll * mask).sum(), rtol=1e-5)
    assert float(weight) == mask.sum()


def test_vocab_parallel_in_bfloat16_follows_the_gathered_loss():
    config = get_config("test", ["num_layers=1"], dtype="bfloat16")
    _, _, names = abstract_model(config)
    params = jax.jit(lambda k: init_params(config, k))(jax.random.key(3))
    tokens, targets, mask = _batch(config)
    (want, _), want_grads = _sharded_loss_and_grads(
        config.replace(logits="gathered"), params, names, "fsdp=8", tokens, targets, mask
    )
    (got, _), got_grads = _sharded_loss_and_grads(
        config.replace(logits="vocab_parallel"), params, names, "fsdp=8", tokens, targets, mask
    )
    np.testing.assert_allclose(float(got), float(want), rtol=1e-2)
    a, b = want_grads["unembed"], got_grads["unembed"]
    assert float(jnp.max(jnp.abs(a - b))) <= 2e-2 * float(jnp.max(jnp.abs(a)))


def test_outside_the_rules_the_loss_is_computed_directly():
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    w = jax.random.normal(jax.random.key(1), (16, 40))
    targets = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    mask = jnp.ones((2, 5))
    want = cross_entropy_sums(project_logits(x, w), targets, mask)
    got = output_loss_sums(x, w, targets, mask, impl="vocab_parallel", par=UNSHARDED)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_auto_picks_vocab_parallel_for_large_vocabularies_and_few_tokens():
    rules, mesh = get_rules("fsdp_tp"), {"data": 1, "stage": 1, "fsdp": 8, "sequence": 1, "tensor": 1}
    split, _ = vocab_split(rules, mesh, 32000, 256, rows=8)
    assert split.group_axes == ("fsdp",) and split.shards == 8
    gathered, parallel = output_traffic(split, 32000, 256, tokens=512)
    assert parallel < gathered / 3
    assert choose_output("auto", rules, mesh, 32000, 256, 8, 512) == split
    # A small vocabulary, or many tokens per device: gathering the weight moves fewer bytes.
    assert choose_output("auto", rules, mesh, 512, 128, 16, 128) is None
    assert choose_output("auto", rules, mesh, 32000, 4096, 1024, 8192) is None
    assert choose_output("gathered", rules, mesh, 32000, 256, 8, 512) is None


@pytest.mark.parametrize(
    "rules, mesh, vocab, why",
    [
        ("dp", {"data": 8}, 32000, "not split"),
        ("fsdp_tp", {"stage": 2, "fsdp": 4}, 32000, "pipeline"),
        ("fsdp_tp", {"fsdp": 8}, 32004, "not divisible"),
    ],
)
def test_vocab_parallel_refuses_layouts_it_cannot_split(rules, mesh, vocab, why):
    full = {"data": 1, "stage": 1, "fsdp": 1, "sequence": 1, "tensor": 1, **mesh}
    with pytest.raises(ValueError, match=why):
        choose_output("vocab_parallel", get_rules(rules), full, vocab, 256, 8, 512)
    assert choose_output("auto", get_rules(rules), full, vocab, 256, 8, 512) is None
    with raises_as_cli(ValueError, match="--logits"):
        choose_output("sometimes", get_rules(rules), full, vocab, 256, 8, 512)


def test_vocab_parallel_step_never_gathers_the_output_weight():
    """The point of it: no device holds the whole [embed, vocab] weight or its whole gradient."""
    config = get_config("test", ["num_layers=1", "vocab_size=4096"], logits="vocab_parallel")
    trainer = Trainer(
        config, OptimizerConfig(), Parallelism.of(make_mesh(parse_mesh("fsdp=8", 8)), get_rules("fsdp_tp"))
    )
    text = trainer.compile_train_step(8, 32).as_text()
    whole = config.embed_dim * config.vocab_size * 4
    big = [c for c in hlo.collectives(text) if c.result_bytes >= whole]
    assert not big, big
    gathered = Trainer(config.replace(logits="gathered"), OptimizerConfig(), trainer.par)
    assert any(c.result_bytes >= whole for c in hlo.collectives(gathered.compile_train_step(8, 32).as_text()))


def test_vocab_parallel_train_step_with_microbatches_matches_gathered():
    config = get_config("test", ["num_layers=2", "vocab_size=1024"])
    mesh, rules = make_mesh(parse_mesh("fsdp=4,tensor=2", 8)), get_rules("fsdp_tp")
    tokens, targets, mask = _batch(config, batch=8, length=16, seed=4)
    batch = {
        "tokens": tokens,
        "targets": targets,
        "loss_mask": mask,
        "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (8, 16)).copy(),
        "segment_ids": np.ones((8, 16), np.int32),
    }
    results = []
    for logits in ("gathered", "vocab_parallel"):
        trainer = Trainer(
            config.replace(logits=logits), OptimizerConfig(), Parallelism.of(mesh, rules, Accumulation(2))
        )
        sharding = trainer.batch_sharding(8, 16)
        placed = {k: jax.device_put(v, sharding) for k, v in batch.items()}
        with jax.default_matmul_precision("highest"):
            _, metrics = trainer.train_step(8, 16)(trainer.init_state(0), placed, trainer.signals(False))
        results.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)
