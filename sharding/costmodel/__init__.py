"""Cost model of one training step (a package: the module is split by concern in the next commit)."""

from sharding.costmodel.pipeline import *  # noqa: F401,F403
from sharding.costmodel.pipeline import __all__  # noqa: F401
