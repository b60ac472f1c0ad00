"""The simulator's clock: simulated seconds, read by the scheduler as Unix time.

The daemon's :class:`hlb.daemon.decide.scheduler.Scheduler` takes a ``clock`` callable returning seconds since
the Unix epoch. In a simulation that callable is :meth:`SimClock.now`: the simulator moves the
clock from event to event and nothing ever sleeps.
"""

from __future__ import annotations

# 2023-11-14T22:13:20Z: a fixed, non-zero epoch, so that event times are never 0 ("unset").
DEFAULT_EPOCH_S = 1_700_000_000.0


class SimClock:
    """Simulated time: ``t_s`` seconds since the start of the simulation, ``now()`` as Unix seconds."""

    def __init__(self, epoch_s: float = DEFAULT_EPOCH_S) -> None:
        self.epoch_s = epoch_s
        self.t_s = 0.0

    def now(self) -> float:
        """Unix seconds of the current simulated instant (the scheduler's clock)."""
        return self.epoch_s + self.t_s

    def now_ms(self) -> int:
        return round(self.now() * 1000.0)

    def advance_to(self, t_s: float) -> None:
        """Move to ``t_s``; time never runs backwards."""
        if t_s < self.t_s:
            raise ValueError(f"the clock cannot go back from {self.t_s} s to {t_s} s")
        self.t_s = t_s

    @property
    def epoch_ms(self) -> int:
        return round(self.epoch_s * 1000.0)
