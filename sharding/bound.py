"""A registry record that holds the function performing it.

The records of `sharding.dispatch` (a mixture of experts' dispatches) and `models.attention_registry` (the
attention kernels) are data the cost model, the planner, config validation and the report read without JAX;
the function that performs each needs JAX and lives in the model (`models.moe`, `models.attention_kernels`),
which binds it to its record where it is defined (`BindsRun.bind`). From then on the record holds it: the
model runs ``record.run``, and nothing looks a function up by the record's name.

This module imports nothing of the project and no JAX.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["BindsRun", "require_bound"]


class BindsRun:
    """Mixin for a frozen record with a ``name``: one function bound to it (`bind`), read back as `run`.

    The function is held outside the record's fields, so it takes no part in equality, hashing or ``repr``
    (a record stays the value the cost model compares).

    Class attributes:
      what: How messages call such a record (``attention``, ``expert dispatch``).
      bound_in: The module expected to bind the functions, for the message of an unbound record.
    """

    what = "record"
    bound_in = "the model"

    def bind(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """Makes ``run`` the function that performs this record; returns it (usable as a decorator).

        Raises:
          ValueError: When a function is already bound to it.
        """
        if self.__dict__.get("_run") is not None:
            raise ValueError(f"{self.what} {self.name}: two functions perform it")  # type: ignore[attr-defined]
        object.__setattr__(self, "_run", run)  # a frozen dataclass: its fields stay as constructed
        return run

    @property
    def run(self) -> Callable[..., Any]:
        """The function bound to this record (`bind`).

        Raises:
          LookupError: When none is bound (``bound_in`` was not imported, or defines none for it).
        """
        run = self.__dict__.get("_run")
        if run is None:
            raise LookupError(f"{self.what} {self.name}: no function in {self.bound_in} performs it")  # type: ignore[attr-defined]
        return run


def require_bound(records) -> None:
    """Checks that every one of ``records`` holds its function (called where the functions are bound, on import,
    so a record the cost model may choose but nothing performs fails there, not at a run's first step).

    Raises:
      LookupError: Naming the first record without one.
    """
    for record in records:
        record.run  # noqa: B018  (the property raises for an unbound record)
