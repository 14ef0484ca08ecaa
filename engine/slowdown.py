"""How much slower (or faster) than when its step costs were measured the machine runs now.

Every forward the engine times is compared with what it took on the machine as it was at load
(StepCost for decode, verify and drafter forwards; PrefillCost for prefill chunks). The ratio
of their recent sums, each forward's weight decaying by `DECAY` per forward, is the slowdown:
what the engine needs to price a counterfactual (plain decode steps it did not take) at the
speed the machine runs at now, when another job shares it or leaves it. A ratio of sums, so
the long forwards weigh what they cost, and one forward delayed by the OS scheduler moves it
by its share only.
"""

from __future__ import annotations

DECAY = 0.99
"""Per forward: about the last 100 forwards count."""


class Slowdown:
    def __init__(self) -> None:
        self._taken = 0.0   # decayed sum of forward seconds
        self._quiet = 0.0   # decayed sum of what they cost at load

    def add(self, seconds: float, quiet_s: float) -> None:
        """One forward that took `seconds` and took `quiet_s` at load."""
        self._taken = DECAY * self._taken + seconds
        self._quiet = DECAY * self._quiet + quiet_s

    @property
    def factor(self) -> float | None:
        """Recent forwards' time over their time at load (None before any)."""
        return self._taken / self._quiet if self._quiet > 0 else None
