"""A clock a test sets: seconds since the Unix epoch, from ``T0``."""

from __future__ import annotations

T0 = 1_000_000.0


class Clock:
    """Called as the scheduler's clock; a test moves ``t``."""

    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t
