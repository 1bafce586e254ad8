"""Errors that name configuration fields, so a command line can name its own flags instead.

A refused value is best reported by naming what to change. The library knows its configuration fields
(``ModelConfig.num_layers``, the mesh, a ``PipelinePlan``'s microbatches), not the flags or files a user
sets them with, so its errors carry references to fields as structured parts of the message:

    raise ConfigError(Field("microbatches", 3), ": fewer microbatches than the 4 stages; use ", Field("microbatches", 4))

``str()`` of that error is the library's view, ``microbatches=3: fewer microbatches than the 4 stages; use
microbatches=4``; a command line renders the same parts through its own table (`ConfigError.render`), e.g.
``--microbatches 3: ... use --microbatches 4``. Two kinds of reference:

* `Field`: a configuration field by name, with the value it had or should have.
* `Override`: a field of the model's configuration set by name as a ``FIELD=VALUE`` override
  (`models.config.parse_overrides`), which a command line spells with its override flag.

A field's value is kept as text, formatted by the raiser (``repr`` where the value is quoted); the library
view writes ``name=value``, or ``name value`` when the value holds an ``=`` itself (a mesh ``stage=4``).
A line that is not an error but names fields (a note a caller logs) is a `FieldText`; a caller that adds
its own words around a library error keeps the fields with `with_context`.
"""

from __future__ import annotations

from collections.abc import Callable


class Field:
    """A reference to one configuration field inside an error message.

    Attributes:
      name: The field's name (``num_layers``, ``mesh``, ``stage_layers``).
      value: The value as the message shows it (already formatted), or None to name the field alone.
    """

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: object = None):
        self.name = name
        self.value = None if value is None else str(value)

    def __str__(self) -> str:
        if self.value is None:
            return self.name
        return f"{self.name}{' ' if '=' in self.value else '='}{self.value}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (other.name, other.value) == (self.name, self.value)

    def __hash__(self) -> int:
        return hash((type(self), self.name, self.value))


class Override(Field):
    """A field of the model's configuration given as a ``FIELD=VALUE`` override.

    The library view is a `Field`'s (``num_layers=4``); the difference is for a command line, which
    sets these fields with one generic override flag rather than a flag of their own.
    """

    __slots__ = ()


Part = str | Field
"""One piece of a `ConfigError` message: literal text, or a reference to a field."""


def _joined(parts: tuple[Part, ...], name: Callable[[Field], str]) -> str:
    """``parts`` as one text, each field reference written as ``name(field)`` returns."""
    return "".join(part if isinstance(part, str) else name(part) for part in parts)


class ConfigError(ValueError):
    """A refused configuration: a `ValueError` whose message names fields, not flags.

    Args:
      *parts: The message in order: strings (literal text) and `Field` references, joined without
        separators.

    ``str(error)`` renders each reference as `Field.__str__` does; `render` lets a caller spell them
    its own way. Pickling keeps the library view's text (as a single literal part).
    """

    def __init__(self, *parts: Part):
        self.parts: tuple[Part, ...] = tuple(parts)
        super().__init__(self.render(str))

    def render(self, name: Callable[[Field], str]) -> str:
        """The message with each field reference written as ``name(field)`` returns."""
        return _joined(self.parts, name)

    def __str__(self) -> str:
        return self.render(str)

    def fields(self) -> tuple[Field, ...]:
        """The field references in the message, in order."""
        return tuple(part for part in self.parts if isinstance(part, Field))


class MissingFileError(ConfigError, FileNotFoundError):
    """A configuration field names a file that does not exist: a `ConfigError` (its message names the
    field, so a command line names its flag) that is also the `FileNotFoundError` callers catch."""


class FieldText(str):
    """A line that is not an error (a note, a hint) but names fields as a `ConfigError` does.

    It is the library view's text (a `str`, usable as one), with the parts kept for a command line to
    spell its own way (`ConfigError.render`'s ``name``).
    """

    parts: tuple[Part, ...]

    def __new__(cls, *parts: Part) -> FieldText:
        text = super().__new__(cls, _joined(parts, str))
        text.parts = tuple(parts)
        return text

    def render(self, name: Callable[[Field], str]) -> str:
        """The text with each field reference written as ``name(field)`` returns."""
        return _joined(self.parts, name)


def with_context(error: Exception, before: str = "", after: str = "") -> ValueError:
    """``error``'s message between ``before`` and ``after``, keeping its field references.

    For a caller that catches a library error and adds what it was doing: a `ConfigError` stays one (a
    command line can still spell its fields), anything else becomes a plain `ValueError` of the joined text.
    """
    if isinstance(error, ConfigError):
        return ConfigError(before, *error.parts, after)
    return ValueError(f"{before}{error}{after}")
