"""The pipeline: the model's execution mode over ``stage``, and what the run needs to know of it.

The pipeline is not a way of computing gradients: with a `sharding.pipeline.PipelinePlan` in the run's
`Parallelism`, the model itself runs its layer stack through `sharding.pipeline.run_pipeline`
(`models.transformer`), and the pipeline's M microbatches flow inside one forward and backward pass. So
`PipelineExecution` takes the gradient of the whole batch in one pass; what it owns are the pipeline's
specifics around the step: its checks, the check of the compiled step (`checked_pipeline`), the stage split
measured at start-up, its flags and its report lines.
"""

from __future__ import annotations

import dataclasses

import jax

from sharding.hlo import branch_collectives
from sharding.parallel import Parallelism
from train.strategies.protocol import GradientStrategy, LossFn


class PipelineExecution(GradientStrategy):
    """One forward and backward pass of the whole batch under ``par``, whose strategy is the
    `sharding.pipeline.PipelinePlan` the model runs its layers by."""

    reports_stats = True

    def gradients(self, loss_fn: LossFn, params, batch: dict, inputs=None):
        (loss_sum, aux), grads = jax.value_and_grad(lambda p: loss_fn(p, batch, self.par), has_aux=True)(params)
        if not isinstance(aux, tuple):
            return loss_sum, aux, grads, {}
        weight, stats = aux
        return loss_sum, weight, grads, self.stats_metrics(stats, weight)

    def compiled_check(self) -> str | None:
        if not self.par.pipeline.skip_empty:
            return None
        return "a pipeline is checked for collectives inside its skipped slots"

    def check_compiled(self, compiled_text: str) -> tuple[Parallelism, str | None]:
        return checked_pipeline(self.par, compiled_text)

    def priced(self, config, layout, batch: int, seq_len: int, backend: str):
        cost, _ = super().priced(config, layout, batch, seq_len, backend)
        return cost, "the device with the largest stage"

    def cost_notes(self) -> list[str]:
        if not self.par.pipeline.skip_empty:
            return []
        return [
            "  (the compiled figures count every slot of every pipeline step; the prediction only the slots that run)"
        ]

    def detail_lines(self, run, trainer) -> list[str]:
        from train import report

        lines = report.pipeline_lines(trainer, report.split_note(trainer))
        return lines + [report.head_line(trainer, run.data.batch_size)]

    @classmethod
    def check_run_batch(cls, run) -> None:
        """The pipeline's microbatches against its stages (`sharding.pipeline.check_microbatches`), then the
        batch against them: checked in that order, the value the first suggests also splits the batch.

        Raises:
          ValueError: Fewer microbatches than stages, interleaved 1F1B's not a multiple of the stages, or a
            ``--batch-size`` that ``--microbatches`` or data x fsdp x expert does not divide.
        """
        from sharding.pipeline import check_microbatches
        from train.checks import check_even_batch

        par = run.parallelism
        plan = par.pipeline
        repeats = plan.layout.repeats if plan.one_f_one_b else 1
        check_microbatches(plan.microbatches, plan.layout.stages, run.data.batch_size, par.data_parallel, repeats)
        check_even_batch(run)

    @classmethod
    def resolve(cls, config, par: Parallelism, log):
        """``--stage-layers auto``: the stage split measured on the devices (`train.calibrate`)."""
        if not par.pipeline.measure_stages:
            return par, None
        from train.calibrate import resolve_stages

        return resolve_stages(config, par, log), None

    @classmethod
    def measured(cls, run, par: Parallelism, log) -> Parallelism:
        """A planned gpipe split of unequal stages becomes ``--stage-layers auto`` (measured at start-up)."""
        plan = par.pipeline
        if plan.layout.repeats == 1 and len(set(plan.layout.stage_layers)) > 1:
            log("--plan auto: the stage split from speeds measured at start-up (as --stage-layers auto)")
            return par.replace(strategy=dataclasses.replace(plan, measure_stages=True))
        return par

    @classmethod
    def flags(cls, par: Parallelism) -> list[str]:
        plan = par.pipeline
        layout = plan.layout
        out = ["--stage-layers", ",".join(map(str, layout.stage_layers)), "--pipeline-schedule", plan.schedule]
        if layout.repeats > 1:
            out += ["--pipeline-repeats", str(layout.repeats)]
        if plan.gather != "once":
            out += ["--pipeline-gather", plan.gather]
        return out


def checked_pipeline(par: Parallelism, compiled_text: str) -> tuple[Parallelism, str | None]:
    """The pipeline plan to use, after making sure no stage can wait on another inside a skipped slot.

    The pipeline skips empty slots with conditionals that stages take differently. Collectives GSPMD puts
    inside a layer are normally among devices of one stage, but if it chose one that could involve other
    stages (a ``collective-permute``), devices would wait forever. Then the plan falls back to computing
    every slot (`PipelinePlan.skip_empty` False).

    Args:
      par: The run's layout (a pipeline strategy).
      compiled_text: ``compiled.as_text()`` of a step compiled with ``par``.

    Returns:
      ``(par, note)``: ``par`` itself and None when safe; else the fallback layout and a line saying why.
    """
    plan = par.pipeline
    if plan is None or not plan.skip_empty:
        return par, None
    unsafe = [c for c in branch_collectives(compiled_text, par.mesh) if not c.safe]
    if not unsafe:
        return par, None
    found = sorted({(c.op, c.name) for c in unsafe})
    kinds = sorted({op for op, _ in found})
    counts = ", ".join(f"{sum(op == kind for op, _ in found)} {kind}" for kind in kinds)
    names = ", ".join(name for _, name in found[:3]) + (", ..." if len(found) > 3 else "")
    note = (
        f"pipeline: the partitioner put {counts} ({names}) inside skipped layer slots, where stages that skip "
        f"them would leave others waiting; this run computes every slot instead (empty slots cost compute too)"
    )
    return par.replace(strategy=dataclasses.replace(plan, skip_empty=False)), note
