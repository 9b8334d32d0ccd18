"""Choosing the draft cap from cost curves and acceptance.

A round at cap c costs drafter(c) + verify(c+1) + slope * depth + overhead and commits, on
average, E(c) = 1 + sum_{i<=c} P(the first i drafts are all accepted) tokens. Plain decoding
(c = 0) costs verify(1) + slope * depth and commits one. The best cap maximizes
rate(c) = E(c) / cost(c).

`static_cap` picks it once from an assumed acceptance. `CapController` picks it live, every few
rounds, from the acceptance and round times it observes, with hysteresis so it does not flap;
it can park at plain decoding and probes again now and then, since acceptance changes with
the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .curves import CostCurves

# Assumed per-position (conditional) acceptance before a pair has been measured. Measured
# values replace these (the registry stores them per pair).
DEFAULT_ACCEPTANCE = {"dspark": 0.7, "dspark-pipe": 0.7, "dflash": 0.7, "draft": 0.7, "draft-pipe": 0.7, "lookup": 0.5}


def survival(profile: float | Sequence[float], cap: int) -> list[float]:
    """P(first i drafts accepted) for i = 1..cap from a conditional per-position profile
    (a scalar means the same for every position; a short profile repeats its last value)."""
    if isinstance(profile, (int, float)):
        profile = [float(profile)]
    out, p = [], 1.0
    for i in range(cap):
        p *= profile[min(i, len(profile) - 1)] if profile else 0.0
        out.append(p)
    return out


def expected_tokens(cap: int, profile: float | Sequence[float]) -> float:
    return 1.0 + sum(survival(profile, cap))


def rate(curves: CostCurves, cap: int, profile, depth: int = 0) -> float:
    """Committed tokens per millisecond at `cap` (cap 0 = plain decoding)."""
    if cap == 0:
        return 1.0 / curves.plain_ms(depth)
    return expected_tokens(cap, profile) / curves.round_ms(cap, depth)


def static_cap(curves: CostCurves, profile, max_cap: int, depth: int = 0) -> int:
    """The cap with the best predicted rate (0 when plain decoding wins)."""
    return max(range(max_cap + 1), key=lambda c: rate(curves, c, profile, depth))


@dataclass
class CapController:
    """Live cap choice. `speculative_generate(..., cap_controller=ctrl)` asks `cap()` before
    each round and reports each round with `observe(drafted, committed, seconds)`."""

    curves: CostCurves
    max_cap: int
    prior: float | Sequence[float] = 0.7
    every: int = 4  # re-evaluate every this many rounds
    hysteresis: float = 0.05  # switch only for a predicted gain above this fraction
    probe_after: int = 32  # rounds parked at plain decoding before probing again
    probe_cap: int = 2
    probe_rounds: int = 3
    decay: float = 0.97  # weight of old observations per round: about the last 33 rounds count
    prior_weight: float = 2.0  # pseudo-observations the prior counts for (it never decays: keep it small)
    depth: int = 0
    reused: bool = False  # whether the curves came from the results database
    history: list[int] = field(default_factory=list)  # the cap used by each round

    def __post_init__(self) -> None:
        self._tried = [0.0] * self.max_cap
        self._accepted = [0.0] * self.max_cap
        self._round_ms: dict[int, float] = {}  # EWMA of observed round time per cap
        self._current = static_cap(self.curves, self.prior, self.max_cap, self.depth)
        self._since_eval = 0
        self._parked = 0
        self._probing = 0

    # --- what the controller believes -------------------------------------------------------
    def profile(self) -> list[float]:
        """Conditional acceptance per position: observations blended with the prior."""
        prior = survival(self.prior, self.max_cap)
        cond_prior = [prior[0]] + [prior[i] / prior[i - 1] if prior[i - 1] > 0 else 0.0 for i in range(1, self.max_cap)]
        return [(self._accepted[i] + self.prior_weight * cond_prior[i]) / (self._tried[i] + self.prior_weight)
                for i in range(self.max_cap)]

    def predicted_rate(self, cap: int) -> float:
        observed = self._round_ms.get(cap)
        if cap == 0:
            return 1.0 / (observed or self.curves.plain_ms(self.depth))
        cost = observed if observed is not None else self.curves.round_ms(cap, self.depth)
        return expected_tokens(cap, self.profile()) / cost

    # --- the protocol ----------------------------------------------------------------------
    def cap(self) -> int:
        if self._probing:
            return self.probe_cap
        return self._current

    def observe(self, drafted: int, committed: int, seconds: float) -> None:
        self.history.append(self.cap())  # the cap this round was asked for
        self.depth += committed
        # A round's cost depends on how many tokens it really drafted (lookup or the length
        # limit may draft fewer than the cap).
        ms = seconds * 1000.0
        prev = self._round_ms.get(drafted)
        self._round_ms[drafted] = ms if prev is None else 0.8 * prev + 0.2 * ms
        for i in range(self.max_cap):
            self._tried[i] *= self.decay
            self._accepted[i] *= self.decay
        accepted = committed - 1
        for i in range(min(drafted, self.max_cap)):
            self._tried[i] += 1
            if i < accepted:
                self._accepted[i] += 1
        if self._probing:
            self._probing -= 1
            if self._probing == 0:
                self._evaluate(force=True)
            return
        if self._current == 0:
            self._parked += 1
            if self._parked >= self.probe_after:
                self._parked = 0
                self._probing = self.probe_rounds
            return
        self._since_eval += 1
        if self._since_eval >= self.every:
            self._evaluate()

    def _evaluate(self, force: bool = False) -> None:
        self._since_eval = 0
        best = max(range(self.max_cap + 1), key=self.predicted_rate)
        if force or self.predicted_rate(best) > self.predicted_rate(self._current) * (1 + self.hysteresis):
            self._current = best
