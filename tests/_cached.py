"""Results the tests of a module share, computed once per process whatever way a test names the arguments.

``functools.cache`` keys on the call as written: ``f(4)``, ``f()`` (4 the default), ``f(4, False)`` and
``f(num_layers=4)`` are four entries, so a test that spells its arguments differently from another recomputes
the same reference run or retraces and relowers the same program (the persistent compilation cache dedups only
the backend's compile, after the lowering). `cached` keys on the arguments bound to the signature with the
defaults filled in, so those calls share one entry.
"""

from __future__ import annotations

import functools
import inspect


def cached(fn):
    """``fn`` memoised per process on its bound arguments (defaults applied); the arguments must be hashable.

    A cached result is shared by every caller: a test must only read it (never donate its arrays to a step, or
    mutate the objects in it). ``__wrapped__`` is ``fn`` itself, for a call that must not use the cache.
    """
    signature = inspect.signature(fn)
    memo = functools.cache(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return memo(*bound.args, **bound.kwargs)

    call.cache_clear = memo.cache_clear
    return call
