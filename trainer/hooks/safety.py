"""Observability must never hurt training: a failure inside the hooks is counted and logged once, never raised."""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("gpuwatch.trainer.hooks")

F = TypeVar("F", bound=Callable)


class Failures:
    """What went wrong inside the hooks, counted by where; each place is logged once, with its traceback."""

    def __init__(self, on_first: Callable[[str, BaseException], None] | None = None) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        #: told of the first failure in each place, besides the log (`gpuwatch run`'s end-of-run summary)
        self.on_first = on_first

    def record(self, where: str, error: BaseException) -> None:
        self.counts[where] += 1
        if self.counts[where] == 1:
            log.warning("gpuwatch hooks: %s failed (training goes on; further failures here are only counted)",
                        where, exc_info=error)
            if self.on_first is not None:
                try:
                    self.on_first(where, error)
                except Exception:  # a failure to tell of a failure: the log above has it
                    log.debug("gpuwatch hooks: could not pass on the failure in %s", where, exc_info=True)


def guarded(method: F) -> F:
    """Make a hook method safe for the training loop: an exception is recorded in `self.failures`
    and the method returns None. Only for the hooks' own code, never around the user's."""
    where = method.__qualname__

    @functools.wraps(method)
    def safe(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            self.failures.record(where, error)
            return None

    return safe  # type: ignore[return-value]
