"""A training run from a checked configuration and its trainer: the run folder held, the data opened, the state
restored or initialized, the loop run to ``--steps`` and its closing lines.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from checkpoints.lock import RunFolderLocked, RunLock
from checkpoints.manager import LoopCheckpoints, base_reference, restore_state
from checkpoints.meta import RunMeta
from checkpoints.verify import restore_falling_back
from models.attention import layout_shards
from train.data import context_permutation, load_dataset
from train.launcher.orphan import launcher_pid
from train.launcher.peers import any_process, sync_processes
from train.reports import fit, report
from train.runtime import agreement
from train.runtime.inference import fresh_state
from train.runtime.loop import DivergedLossError, LoopOptions, MetricsWriter, StopFlag, train_loop
from train.setup.config import RunConfig
from train.setup.configfile import write_record
from train.setup.flagnames import render


def hold_run_folder(run_dir: str, break_lock: bool, process_index: int, log):
    """The `checkpoints.lock.RunLock` of ``--run-dir``, taken by process 0 before anything in it is touched
    (None for the other processes, which share the folder by design); every process learns whether it was
    refused. ``break_lock`` is ``--break-lock``.

    Raises:
      checkpoints.lock.RunFolderLocked: (a ValueError) another run holds the folder.
    """
    lock, error = None, None
    if process_index == 0:
        try:
            # its notes name fields; under train.launch the lock also names the launcher, the process to stop
            lock = RunLock.acquire(run_dir, lambda line: log(render(line)), break_lock, launcher_pid())
        except ValueError as e:
            error = e
    if any_process(error is not None):  # the other processes stop with process 0, not at its first collective
        if error is not None:
            raise error
        raise RunFolderLocked(
            f"--run-dir {run_dir}: process 0 could not take the folder's lock (its error is in its log)"
        )
    return lock


def open_dataset(config: RunConfig, tokenizer, log):
    """The run's `train.data.Dataset`: ``--data`` opened (a raw source prepared on first use, in the cache).

    Raises:
      ValueError, FileNotFoundError, ImportError: as `train.data.load_dataset` (a bad line of a raw source, a
        split shorter than one sequence), naming the flag or the file.
    """
    data = config.data
    return load_dataset(
        data.spec,
        tokenizer,
        data.seq_len,
        data.batch_size,
        data.seed,
        data.heldout,
        data.cache_dir,
        log,
        permutation=_context_permutation(config, config.parallelism),
        text_field=data.text_field,
    )


def train(config: RunConfig, trainer, ckpt, latest, tokenizer, dataset, log) -> int:
    """Restores or initializes the state and runs the loop to ``--steps`` over ``dataset`` (`open_dataset`);
    returns 0."""
    import jax
    import numpy as np

    data = config.data
    with StopFlag() as stop:
        # The order along the length follows the trainer's context layout: measured shares
        # (--context-shares auto) are known only now, after the data was opened and checked.
        permutation = _context_permutation(config, trainer.par)
        if (permutation is None) != (dataset.permutation is None) or (
            permutation is not None and not np.array_equal(permutation, dataset.permutation)
        ):
            dataset = dataclasses.replace(dataset, permutation=permutation)
        state, (samples, iterator), latest = start_state(config, trainer, ckpt, latest, log)
        if jax.process_index() == 0 and config.record is not None:
            # Only once the run is accepted (resume checks passed): a refused command leaves the folder as it was.
            write_record(config.checkpoint.run_dir, config.record)
        writer = MetricsWriter(
            Path(config.checkpoint.run_dir),
            jax.process_index() == 0,
            latest,
            config.loop.trackers,
            None if config.record is None else config.record["flags"],
        )
        # adapters on an imported model: checkpoints keep the adapters, the base by reference to its folder
        by_reference = config.model.lora_rank and config.checkpoint.init_from is not None
        base = base_reference(config.checkpoint.init_from) if by_reference else None
        meta = RunMeta.create(
            config.model,
            config.preset,
            trainer.par.mesh_shape,
            trainer.rules,
            {
                "spec": data.spec,
                "seq_len": data.seq_len,
                "global_batch": data.batch_size,
                "seed": data.seed,
                "heldout": data.heldout,
            },
            tokenizer,
            trainer.state_layout.layout_meta(),
            config.schedule,
            trainer.par.optimizer_sharding,
            base,
        )
        checkpoints = LoopCheckpoints(ckpt, meta, None if base is None else trainer.state_layout.adapters_state)
        kinds = _device_kinds(config, log)
        try:
            state, summary = train_loop(
                trainer=trainer,
                state=state,
                dataset=dataset,
                options=LoopOptions.of(config, trainer.par.padded_length),
                samples=samples,
                iterator=iterator,
                checkpoints=checkpoints,
                writer=writer,
                log=log,
                stop=stop,
                check_compiled=lambda compiled: _check_compiled(config, compiled, kinds),
                compiler_options=agreement.mixed_kind_options(kinds),
            )
        except DivergedLossError as e:  # the parameters of step N-1 gave step N's loss: not a state to keep
            if e.step - 1 > (latest or 0):
                checkpoints.set_aside(e.step - 1, "diverged", log)
            raise
        finally:
            writer.close()
    t0 = time.perf_counter()
    checkpoints.finish(summary["step"])
    for line in report.summary_lines(summary, ckpt.directory, time.perf_counter() - t0):
        log(line)
    return 0


def _device_kinds(config: RunConfig, log) -> list[str]:
    """Every process's device kind (one process: its own); a job of several kinds is compiled with
    `train.runtime.agreement.MIXED_KIND_OPTIONS`, which the log names."""
    import jax

    kind = jax.local_devices()[0].device_kind
    if jax.process_count() == 1:
        return [kind]
    timeout = config.cluster.distributed().timeout
    kinds = agreement.exchange_kinds(agreement.client(), jax.process_index(), jax.process_count(), kind, timeout)
    if options := agreement.mixed_kind_options(kinds):
        log(
            f"device kinds {', '.join(sorted(set(kinds)))}: compiling with {', '.join(f'{k}={v}' for k, v in options.items())}"
        )
    return kinds


def _check_compiled(config: RunConfig, compiled, kinds: list[str]) -> str:
    """The fit of the compiled step (`train.reports.fit.check_compiled`) and, with several processes, their
    agreement on its collectives (`train.runtime.agreement.check_same_collectives`), before the first step."""
    import jax

    line = fit.check_compiled(config, compiled)
    if jax.process_count() == 1:
        return line
    agreed = agreement.check_same_collectives(
        compiled.as_text(),
        client=agreement.client(),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        kinds=kinds,
        timeout_s=config.cluster.distributed().timeout,
    )
    return f"{line}\n{agreed}"


def start_state(config: RunConfig, trainer, ckpt, latest, log):
    """``(state, (samples, iterator), step)``: the latest checkpoint re-laid onto this run's mesh and layout, or a fresh
    state (`train.runtime.inference.fresh_state`: ``--init-from``'s weights or a random init; step None); ``samples`` and
    ``iterator`` are the saved data position and input pipeline state (`train.data.TrainBatches.state`). A step whose
    arrays do not read is set aside and the next older one restored (`checkpoints.verify.restore_falling_back`)."""
    import jax

    if latest is None:
        return fresh_state(config, trainer.state_layout, ckpt.directory, log), (0, None), None
    _check_optimizer(config, ckpt, latest)
    t0 = time.perf_counter()
    (state, meta), latest = restore_falling_back(
        ckpt.directory,
        latest,
        lambda step: restore_state(ckpt, trainer.state_layout, step, config.checkpoint.init_from),
        lambda line: log(render(line)),  # its notes name fields
        explicit=config.checkpoint.resume_step is not None,
        any_failed=any_process,
        reload=ckpt.reload,
        sync=sync_processes,
        leader=jax.process_index() == 0,
    )
    for line in report.resume_lines(config, trainer, meta, latest, time.perf_counter() - t0):
        log(line)
    return state, (meta.samples, meta.data.get("iterator")), latest


def _check_optimizer(config: RunConfig, ckpt, step: int) -> None:
    """Refuses to resume with another ``--optimizer``: its state has another structure (a checkpoint saved before
    the optimizer was recorded holds AdamW's).

    Raises:
      ValueError: Naming the saved optimizer and the flag that resumes it.
    """
    try:
        saved = (ckpt.read_meta(step).get("schedule") or {}).get("optimizer", "adamw")
    except Exception:  # an unreadable step is the restore's to report (and fall back from)
        return
    if saved != config.optimizer.name:
        raise ValueError(
            f"--optimizer {config.optimizer.name}: the checkpoint of step {step} in {ckpt.directory} "
            f"holds {saved}'s optimizer state; resume with --optimizer {saved}, or use another --run-dir"
        )


def _context_permutation(config: RunConfig, par):
    """The token order of ``par``'s context layout (the trainer's, uneven shares measured) along ``--seq-len``
    (None: natural)."""
    shares = par.context_shares if isinstance(par.context_shares, tuple) else None
    return context_permutation(
        config.data.seq_len, layout_shards(config.model.attention, par), par.context_layout, shares
    )
