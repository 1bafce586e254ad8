"""Cluster descriptions a user writes: spec strings and inventory files.

* ``parse_cluster("h100:8,a100:8@400Gbps")``: one host per item, from a flag or a config field.
* ``load_inventory("cluster.json")``: a JSON (or YAML) file; see :func:`load_inventory`;
  ``save_inventory`` / ``inventory_to_dict`` write one back.
* ``inventory_from_flag(value)``: a path to an existing file, else a cluster spec.

Bandwidths with units (``parse_bandwidth``): a lower-case ``b`` is bits, an upper-case ``B`` bytes;
results are bytes/s.

This module imports nothing of the project but `sharding.devices` and calls no JAX at import time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from sharding.devices.inventory import Host, Inventory
from sharding.devices.kinds import (
    _FIGURES,
    ALIASES,
    DEFAULT_INTER_HOST_BANDWIDTH,
    KINDS,
    DeviceKind,
    _is_positive_int,
    _is_positive_number,
    _normalise,
    get_kind,
)
from sharding.errors import ConfigError, Field, MissingFileError

# --- Parsing -----------------------------------------------------------------------

_CLUSTER_EXAMPLE = "h100:8,a100:8@400Gbps"
_BANDWIDTH_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMGgTt])(b|B)(?:ps|/s)\s*$")
# Decimal prefixes; a lower-case g or t reads as G or T (``400gbps``: neither letter means anything smaller),
# but m stays refused: it is milli, not mega. The case of b/B is the unit itself (bits or bytes).
_PREFIX = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "g": 1e9, "T": 1e12, "t": 1e12}


def parse_bandwidth(text: str) -> float:
    """Parses a bandwidth with units into bytes/s.

    A lower-case ``b`` means bits, an upper-case ``B`` bytes: ``"400Gbps"`` and
    ``"400Gb/s"`` give 50e9, ``"50GB/s"`` and ``"50GBps"`` give 50e9. Prefixes k, M,
    G, T are decimal; ``k``/``K``, ``g``/``G`` and ``t``/``T`` are read alike
    (``"400gbps"`` is ``"400Gbps"``), ``M`` only upper-case (``m`` would be milli).

    Args:
        text: E.g. ``"400Gbps"``, ``"3.2Tb/s"``, ``"50GB/s"``.

    Returns:
        Bytes/s.

    Raises:
        ValueError: When the text is not a positive number followed by a unit.
    """
    match = _BANDWIDTH_RE.match(text)
    value = float(match.group(1)) if match else 0.0
    if not match or value <= 0:
        raise ValueError(
            f"bad bandwidth {text!r}: expected a positive number and a unit (a prefix k, M, G or T, then b "
            "for bits or B for bytes, then ps or /s), e.g. '400Gbps' (gigabits/s) or '50GB/s' (gigabytes/s)"
        )
    per_second = value * _PREFIX[match.group(2)]
    return per_second / 8 if match.group(3) == "b" else per_second


def parse_cluster(spec: str, inter_host_bandwidth: float | None = None, field: str = "cluster") -> Inventory:
    """Parses a cluster spec into an inventory, one host per item.

    Grammar: ``ITEM[,ITEM...][@BANDWIDTH]`` where ``ITEM`` is ``KIND:COUNT`` (one host
    of COUNT devices) or ``KIND:COUNTxHOSTS`` (HOSTS such hosts), ``KIND`` any name
    :func:`get_kind` accepts, and ``BANDWIDTH`` the per-host inter-host bandwidth with
    units (see :func:`parse_bandwidth`): one, at the end, for every host (the cost model
    prices one inter-host link speed). Hosts are named ``host0``, ``host1``, ...

    Examples: ``"h100:8,a100:8"``, ``"h100:8x4@3200Gbps"``, ``"4090:2"``.

    Args:
        spec: The spec.
        inter_host_bandwidth: Bytes/s per host; used when the spec has no ``@`` part.
            Defaults to :data:`DEFAULT_INTER_HOST_BANDWIDTH`.
        field: The configuration field the spec came from (``cluster``,
            ``simulate_cluster``), named in errors so a command line can name its flag.

    Returns:
        The inventory.

    Raises:
        ConfigError: On an empty spec, a malformed item, an unknown kind (the message
            lists the known kinds), a count or host repeat <= 0, a bad bandwidth, a
            bandwidth per item (more than one ``@``), or a bandwidth given both in the
            spec and as an argument. Messages name ``field`` with the spec and show a
            valid example.
    """
    body, bandwidth = _split_bandwidth(spec, inter_host_bandwidth, field)
    hosts: list[Host] = []
    for item in body.split(","):
        kind, count, repeat = _parse_item(item, spec, field)
        for _ in range(repeat):
            hosts.append(Host(kind=kind, count=count, name=f"host{len(hosts)}"))
    return Inventory(hosts=tuple(hosts), inter_host_bandwidth=bandwidth)


def _split_bandwidth(spec: str, inter_host_bandwidth: float | None, field: str) -> tuple[str, float]:
    example = Field(field, _CLUSTER_EXAMPLE)
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(Field(field, repr(spec)), ": empty cluster spec; expected e.g. ", example)
    body, at, bw_text = spec.partition("@")
    if not at:
        if inter_host_bandwidth is None:
            return body, DEFAULT_INTER_HOST_BANDWIDTH
        return body, inter_host_bandwidth
    if "@" in bw_text or "," in bw_text:
        one = ",".join(item.partition("@")[0].strip() for item in spec.split(","))
        raise ConfigError(
            Field(field, repr(spec)),
            ": the spec takes one @BANDWIDTH, at the end, for all hosts (not one per item); e.g. ",
            Field(field, f"{one}@{bw_text.partition(',')[0].partition('@')[0].strip() or '400Gbps'}"),
        )
    if inter_host_bandwidth is not None:
        raise ConfigError(
            Field(field, repr(spec)),
            ": gives a bandwidth after '@' and inter_host_bandwidth was also passed; give one of them",
        )
    try:
        return body, parse_bandwidth(bw_text)
    except ValueError as err:
        raise ConfigError(Field(field, repr(spec)), f": {err}; e.g. ", example) from None


def _parse_item(item: str, spec: str, field: str) -> tuple[DeviceKind, int, int]:
    where = (Field(field, repr(spec)), f", item {item.strip()!r}")
    name, colon, count_text = item.strip().partition(":")
    if not name or not colon:
        raise ConfigError(*where, ": expected KIND:COUNT, e.g. ", Field(field, _CLUSTER_EXAMPLE))
    try:
        kind = get_kind(name)
    except ValueError as err:
        raise ConfigError(*where, f": {err}") from None
    count_part, times, repeat_part = count_text.strip().lower().partition("x")
    count = _positive_int(count_part or count_text.strip(), where, "device count", "h100:8")  # 'h100:x' names x
    repeat = _positive_int(repeat_part, where, "host repeat", "h100:8x2") if times else 1
    return kind, count, repeat


def _positive_int(text: str, where: tuple, what: str, example: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise ConfigError(*where, f": {what} must be a positive integer, got {text.strip()!r}; e.g. {example!r}")
    return value


# --- Files -------------------------------------------------------------------------

_FILE_KEYS = {"hosts", "inter_host_bandwidth", "inter_host_bandwidth_gbps", "kinds"}
_HOST_KEYS = {"kind", "count", "name", "repeat"}
_KIND_KEYS = {"label", "source", *_FIGURES}
_FILE_EXAMPLE = '{"inter_host_bandwidth_gbps": 400, "hosts": [{"kind": "h100", "count": 8}]}'


def load_inventory(path: str | os.PathLike) -> Inventory:
    """Loads an inventory from a JSON file, or YAML when the name ends ``.yaml``/``.yml``.

    Format (JSON shown; YAML has the same structure)::

        {
          "inter_host_bandwidth_gbps": 400,          # optional; Gb/s (bits) per host
          "hosts": [
            {"kind": "h100", "count": 8},            # name defaults to host<i>
            {"kind": "a100", "count": 8, "name": "node-b", "repeat": 2}
          ],
          "kinds": {                                  # optional
            "a100": {"memory_bandwidth": 1.9e12},    # override figures of a table kind
            "mi300x": {"label": "AMD MI300X", "peak_bf16_flops": 1.307e15,
                       "memory_bytes": 192e9, "memory_bandwidth": 5.3e12,
                       "intra_host_bandwidth": 64e9, "source": "..."}  # a new kind
          }
        }

    Instead of ``inter_host_bandwidth_gbps``, ``"inter_host_bandwidth"`` takes bytes/s
    (a number) or a string with units (``"400Gbps"``). Figures in ``"kinds"`` are in
    FLOP/s, bytes and bytes/s; a new kind's missing figures are unknown (``None``).
    A host with ``"repeat": n`` stands for n hosts named ``name-0 .. name-(n-1)``.

    Args:
        path: The file.

    Returns:
        The inventory.

    Raises:
        FileNotFoundError: When the file does not exist.
        ImportError: For a YAML file when pyyaml is not installed.
        ValueError: On malformed content; the message names the file and the field.
    """
    path = os.fspath(path)
    data = _read_document(path)
    where = path
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object at the top, e.g. {_FILE_EXAMPLE}")
    _check_keys(data, _FILE_KEYS, where)
    kinds = _file_kinds(data.get("kinds", {}), f"{where}: kinds", where)
    hosts = _file_hosts(data.get("hosts"), kinds, where)
    bandwidth = _file_bandwidth(data, where)
    try:
        return Inventory(hosts=tuple(hosts), inter_host_bandwidth=bandwidth)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _read_document(path: str) -> Any:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: not a text file (byte {err.start} is {raw[err.start]:#04x}, not UTF-8); give a JSON or YAML "
            f"inventory, e.g. {_FILE_EXAMPLE}, or a cluster spec such as h100:8"
        ) from None
    if path.lower().endswith((".yaml", ".yml")):
        try:
            import yaml  # lazy: pyyaml is optional
        except ImportError:
            raise ImportError(
                f"{path}: reading YAML needs pyyaml; write the inventory as JSON or `pip install pyyaml`"
            ) from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)  # yaml's own text spans lines, with a caret under the spot
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"{path}: not valid YAML{at}: {problem}; e.g. {_FILE_EXAMPLE}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None


def _check_keys(obj: Mapping, allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}"
        )


def _file_kinds(section: Any, where: str, path: str) -> dict[str, DeviceKind]:
    """Table kinds with the file's overrides applied, plus the file's new kinds."""
    if not isinstance(section, dict):
        raise ValueError(f"{where}: expected an object of kind name -> figures")
    kinds: dict[str, DeviceKind] = {}
    for name, fields in section.items():
        name = str(name)  # YAML reads a key such as 4090 as a number
        field_where = f"{where}.{name}"
        if not isinstance(fields, dict):
            raise ValueError(f"{field_where}: expected an object of figures")
        _check_keys(fields, _KIND_KEYS, field_where)
        for field in _FIGURES:
            _check_figure(fields.get(field), f"{field_where}.{field}")
        key = ALIASES.get(_normalise(name), _normalise(name))
        if key in KINDS:
            kind = dataclasses.replace(KINDS[key], **fields)
        else:
            kind = _new_kind(key, fields, path)
        kinds[kind.name] = kind
    return kinds


def _new_kind(name: str, fields: Mapping, path: str) -> DeviceKind:
    return DeviceKind(
        name=name,
        label=str(fields.get("label", name)),
        source=str(fields.get("source", f"inventory file {path}")),
        **{f: fields.get(f) for f in _FIGURES},
    )


def _check_figure(value: Any, where: str) -> None:
    """A figure in a file: null (unknown) or a positive number."""
    if value is None:
        return
    if not _is_positive_number(value):
        raise ValueError(f"{where}: must be a positive number or null, got {value!r}")


def _file_hosts(section: Any, kinds: Mapping[str, DeviceKind], path: str) -> list[Host]:
    if not isinstance(section, list) or not section:
        raise ValueError(f"{path}: hosts: expected a non-empty list, e.g. {_FILE_EXAMPLE}")
    hosts: list[Host] = []
    for i, entry in enumerate(section):
        where = f"{path}: hosts[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f'{where}: expected an object like {{"kind": "h100", "count": 8}}')
        _check_keys(entry, _HOST_KEYS, where)
        kind = _host_kind(entry.get("kind"), kinds, where)
        count = _file_positive_int(entry.get("count"), f"{where}.count")
        repeat = _file_positive_int(entry.get("repeat", 1), f"{where}.repeat")
        name = entry.get("name", None)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"{where}.name: expected a non-empty string, got {name!r}")
        for r in range(repeat):
            host_name = (name if repeat == 1 else f"{name}-{r}") if name else f"host{len(hosts)}"
            hosts.append(Host(kind=kind, count=count, name=host_name))
    return hosts


def _host_kind(name: Any, kinds: Mapping[str, DeviceKind], where: str) -> DeviceKind:
    if isinstance(name, int) and not isinstance(name, bool):
        name = str(name)  # YAML reads `kind: 4090` as a number
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.kind: expected a kind name such as 'h100', got {name!r}")
    key = _normalise(name)
    key = ALIASES.get(key, key)
    if key in kinds:
        return kinds[key]
    try:
        return get_kind(name)
    except ValueError as err:
        raise ValueError(f'{where}.kind: {err} (or define it under "kinds")') from None


def _file_positive_int(value: Any, where: str) -> int:
    if not _is_positive_int(value):
        raise ValueError(f"{where}: must be a positive integer, got {value!r}")
    return value


def _file_bandwidth(data: Mapping, where: str) -> float:
    """Bytes/s per host from ``inter_host_bandwidth_gbps`` or ``inter_host_bandwidth``."""
    if "inter_host_bandwidth" in data and "inter_host_bandwidth_gbps" in data:
        raise ValueError(f"{where}: give inter_host_bandwidth or inter_host_bandwidth_gbps, not both")
    if "inter_host_bandwidth_gbps" in data:
        gbps = data["inter_host_bandwidth_gbps"]
        if not _is_positive_number(gbps):
            raise ValueError(
                f"{where}: inter_host_bandwidth_gbps: must be a positive number of gigabits/s, got {gbps!r}"
            )
        return gbps * 1e9 / 8
    value = data.get("inter_host_bandwidth", DEFAULT_INTER_HOST_BANDWIDTH)
    if isinstance(value, str):
        try:
            return parse_bandwidth(value)
        except ValueError as err:
            raise ValueError(f"{where}: inter_host_bandwidth: {err}") from None
    if not _is_positive_number(value):
        raise ValueError(
            f"{where}: inter_host_bandwidth: must be a positive number of bytes/s "
            f"or a string such as '400Gbps', got {value!r}"
        )
    return float(value)


def inventory_to_dict(inventory: Inventory) -> dict[str, Any]:
    """The file form of an inventory; :func:`load_inventory` reads it back equal.

    Kinds that differ from the table (or are not in it) are written under ``"kinds"``.

    Args:
        inventory: The inventory.

    Returns:
        A JSON-serialisable dict.

    Raises:
        ValueError: When two different kinds share a name (the file format keys kinds
            by name).
    """
    kinds: dict[str, Any] = {}
    by_name: dict[str, DeviceKind] = {}
    for kind in inventory.kinds_present:
        if by_name.setdefault(kind.name, kind) != kind:
            raise ValueError(f"cannot write an inventory with two different kinds named {kind.name!r}")
        if KINDS.get(kind.name) == kind:
            continue
        base = KINDS.get(kind.name)
        fields = {f: getattr(kind, f) for f in ("label", "source", *_FIGURES)}
        if base is not None:
            fields = {f: v for f, v in fields.items() if getattr(base, f) != v}
        kinds[kind.name] = fields
    data: dict[str, Any] = {
        "inter_host_bandwidth": inventory.inter_host_bandwidth,
        "hosts": [{"kind": h.kind.name, "count": h.count, "name": h.name} for h in inventory.hosts],
    }
    if kinds:
        data["kinds"] = kinds
    return data


def save_inventory(inventory: Inventory, path: str | os.PathLike) -> None:
    """Writes an inventory as JSON (see :func:`inventory_to_dict`).

    Raises:
        ValueError: As :func:`inventory_to_dict`.
    """
    with open(path, "w", encoding="utf-8") as f:
        json.dump(inventory_to_dict(inventory), f, indent=2)
        f.write("\n")


def inventory_from_flag(value: str, inter_host_bandwidth: float | None = None) -> Inventory:
    """Reads a ``--cluster`` flag: a path to an existing file, else a cluster spec.

    Args:
        value: A file path (JSON/YAML) or a spec such as ``"h100:8,a100:8"``.
        inter_host_bandwidth: Bytes/s per host for a spec without ``@``; ignored for
            a file (files carry their own).

    Returns:
        The inventory.

    Raises:
        MissingFileError: When the value names a ``.json``/``.yaml``/``.yml`` file
            that does not exist (a `FileNotFoundError` naming the ``cluster`` field, with
            the inline form as the remedy).
        ImportError, ValueError: As :func:`load_inventory` and :func:`parse_cluster`.
    """
    if os.path.isfile(value):
        try:
            return load_inventory(value)
        except ValueError as err:  # name the field the file came from (the messages start with the path)
            text = str(err)
            text = text[len(value) + 2 :] if text.startswith(f"{value}: ") else text
            raise ConfigError(Field("cluster", value), f": {text}") from None
    if value.strip().lower().endswith((".json", ".yaml", ".yml")):
        raise MissingFileError(
            Field("cluster", value),
            ": no such inventory file; give an existing JSON/YAML file, or the cluster inline, e.g. ",
            Field("cluster", "h100:8"),
        )
    return parse_cluster(value, inter_host_bandwidth)
