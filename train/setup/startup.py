"""Start-up of ``python -m train.train`` once the devices are up: ``--plan auto``, the checks against the machine,
then the mesh and the `train.runtime.step.Trainer` with the start-up report.
"""

from __future__ import annotations

import time

from sharding.mesh import make_mesh
from train.data.tokenizer import load_tokenizer
from train.reports import fit, report
from train.runtime import step
from train.setup import strategy_setup
from train.setup.auto_plan import apply_plan
from train.setup.calibrate import resolve_context_shares, resolve_counts
from train.setup.checks import check_attention_platform, check_simulated_devices, optimizer_sharding_note, validate
from train.setup.config import RunConfig
from train.setup.mesh_fit import resolve_mesh_or_suggest


def prepare(config: RunConfig, devices, log):
    """Resolves what needs the devices (``--plan auto``, the ``-1`` mesh axis, the context layout), loads
    the tokenizer and runs every check; returns ``(config, tokenizer)``.

    Raises:
      ValueError: As `train.setup.checks.validate`.
    """
    config = apply_plan(config, devices, log)
    check_simulated_devices(config.parallelism.mesh_shape, devices, config.cluster.cpu_devices)
    check_attention_platform(config.model.attention, devices)
    config = resolve_mesh_or_suggest(config, len(devices))
    if (note := optimizer_sharding_note(config.parallelism)) is not None:  # an elastic restart's data=-1 on fewer
        log(note)
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.eod_token)
    validate(config, len(devices), tokenizer)
    config = fit.resolve_budget(config, devices)
    fit.check_estimate(config)  # a state that cannot fit any layout is refused before anything is built
    return config, tokenizer


def build_trainer(config: RunConfig, log):
    """The mesh and the `train.runtime.step.Trainer` of ``config``, with the start-up report.

    Resolves what the strategy left to measure (e.g. uneven counts) and, where it asks, checks the compiled step
    (`train.setup.strategy_setup.check_compiled`: a pipeline's skipped slots), rebuilding the trainer with its fallback.
    """
    import jax

    par = config.parallelism
    outer = par.outer
    if outer is not None and jax.process_count() == 1:
        log("note: one process, so --mesh-outer has no effect")
        outer = None
    mesh = make_mesh(par.mesh_shape, outer=outer)
    par, speeds = resolve_counts(config, par.on(mesh), log)  # --hetero-batch auto measures, kinds reads datasheets
    par = resolve_context_shares(config, par, log)  # --context-shares auto measures the ring's devices
    trainer = step.Trainer(config.model, config.optimizer, par)
    notes = []
    if (checked_for := strategy_setup.compiled_check(trainer.par)) is not None:
        log(f"compiling the train step ({checked_for}) ...")
        t0 = time.perf_counter()
        compiled = trainer.compile_train_step(config.data.batch_size, trainer.par.positions(config.data.seq_len))
        seconds = time.perf_counter() - t0
        log(f"compiled the train step in {seconds:.1f} s (later compilations of it are cached)")
        checked, note = strategy_setup.check_compiled(trainer.par, compiled.as_text())
        if note:
            notes.append(note)
            trainer = step.Trainer(config.model, config.optimizer, checked)
        else:  # the dry run's compilation of the same step then comes from the cache: it reports this one's time
            trainer.startup_compile_seconds = seconds
    for line in report.startup(config, trainer, speeds, notes):
        log(line)
    return trainer
