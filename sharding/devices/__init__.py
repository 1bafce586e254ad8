"""Device inventory: what each accelerator can do and how the hosts are linked.

The base of the heterogeneous-cluster planner. It answers, for every global device,
"what kind of chip is this" (peak bf16 FLOP/s, memory, memory bandwidth, link to its
host peers) and, for the cluster, "which devices share a host" (fast links inside a
host, slow network between hosts).

Modules:

* `sharding.devices.kinds`: the datasheet table (`KINDS`, with sources), names and aliases, JAX's
  ``device_kind`` strings, `peak_flops`, the default inter-host bandwidth.
* `sharding.devices.inventory`: `Host` and `Inventory`, the cluster as hosts in global device order.
* `sharding.devices.spec`: cluster spec strings (``h100:8,a100:8@400Gbps``) and JSON/YAML files.
* `sharding.devices.detect`: the running job's inventory (`detect_inventory`), simulated kinds on
  CPU devices (`simulate_inventory`), the memory a device may use (`device_memory`).

Units everywhere: FLOP/s, bytes, bytes/s (decimal prefixes; see `sharding.devices.kinds` for the
bandwidth conventions). The package imports nothing of the project and calls no JAX at import time.
"""

from sharding.devices.detect import (
    detect_inventory,
    device_memory,
    host_available_bytes,
    simulate_inventory,
)
from sharding.devices.inventory import Host, Inventory
from sharding.devices.kinds import (
    ALIASES,
    ATTENTION_BENCHMARKS,
    DEFAULT_INTER_HOST_BANDWIDTH,
    GEMM_BENCHMARKS,
    KINDS,
    SM_COUNTS,
    SUSTAINED_FRACTION,
    DeviceKind,
    get_kind,
    kind_from_device_kind_string,
    known_kind_names,
    peak_flops,
)
from sharding.devices.spec import (
    inventory_from_flag,
    inventory_to_dict,
    load_inventory,
    parse_bandwidth,
    parse_cluster,
    save_inventory,
)

__all__ = [
    "DEFAULT_INTER_HOST_BANDWIDTH",
    "ATTENTION_BENCHMARKS",
    "GEMM_BENCHMARKS",
    "SM_COUNTS",
    "SUSTAINED_FRACTION",
    "KINDS",
    "ALIASES",
    "DeviceKind",
    "Host",
    "Inventory",
    "get_kind",
    "known_kind_names",
    "kind_from_device_kind_string",
    "peak_flops",
    "parse_bandwidth",
    "parse_cluster",
    "load_inventory",
    "inventory_to_dict",
    "save_inventory",
    "inventory_from_flag",
    "detect_inventory",
    "simulate_inventory",
    "device_memory",
    "host_available_bytes",
]
