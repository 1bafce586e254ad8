"""The layout planner (a package: the module is split by concern in the next commit)."""

from sharding.planner.search import *  # noqa: F401,F403
from sharding.planner.search import (  # noqa: F401
    __all__, _compositions, _Evaluator, _meshes, _stage_split, _uneven_fits, no_plan_reason, why_lost)
