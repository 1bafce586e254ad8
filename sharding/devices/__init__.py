"""Device inventory (a package: the module is split by concern in the next commit)."""

from sharding.devices.spec import *  # noqa: F401,F403
from sharding.devices.spec import __all__, device_memory, host_available_bytes  # noqa: F401
