"""Cost curves of a target/drafter pair on one machine, and the piecewise-linear fit of verify.

verify(w) is flat while a forward is launch- or bandwidth-bound and rises once it becomes
compute-bound; the fit finds that knee: t(w) = a + b*min(w, k) + c*max(0, w - k).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Point:
    median_ms: float
    spread_ms: float  # max - min over the repeats
    samples: int

    @classmethod
    def of(cls, seconds: list[float]) -> "Point":
        ms = sorted(s * 1000.0 for s in seconds)
        return cls(float(np.median(ms)), ms[-1] - ms[0], len(ms))


@dataclass
class VerifyFit:
    a: float
    b: float  # ms per extra row up to the knee
    c: float  # ms per extra row beyond the knee
    knee: int
    max_rel_error: float  # worst |fit - measured| / measured over the measured widths

    def __call__(self, w: float) -> float:
        return self.a + self.b * min(w, self.knee) + self.c * max(0.0, w - self.knee)


def fit_verify(points: dict[int, Point]) -> VerifyFit:
    """Least-squares piecewise-linear fit, the knee chosen among the measured widths."""
    w = np.array(sorted(points), dtype=float)
    t = np.array([points[int(x)].median_ms for x in w])
    best = None
    for knee in w:
        X = np.stack([np.ones_like(w), np.minimum(w, knee), np.maximum(0.0, w - knee)], axis=1)
        coef, *_ = np.linalg.lstsq(X, t, rcond=None)
        sse = float(((X @ coef - t) ** 2).sum())
        if best is None or sse < best[0] - 1e-12:
            best = (sse, knee, coef)
    _, knee, (a, b, c) = best
    fit = VerifyFit(float(a), float(b), float(c), int(knee), 0.0)
    fit.max_rel_error = float(max(abs(fit(x) - y) / y for x, y in zip(w, t) if y > 0))
    return fit


@dataclass
class CostCurves:
    verify: dict[int, Point]  # target forward (with the tap) at width w, short context
    drafter: dict[int, Point]  # one draft round at cap c
    overhead: Point  # full synthetic round minus its drafter and verify parts (>= 0 used)
    depth_slope_ms: float  # extra ms per context token (median over the widths measured)
    short_ctx: int
    long_ctx: int
    # Whole rounds at cap c, timed as the loop runs them (mode dspark-pipe), and at 0 plain
    # decoding's tokens: where a cap has one, round_ms (plain_ms for 0) is it, not the sum of
    # parts. A pipelined round overlaps its draft with the previous verify and its host work with
    # the device's, so the parts, each timed alone with a host sync, overstate it: on an H100 by
    # 10-67% (docs/performance.md, forty-fourth round).
    rounds: dict[int, Point] = field(default_factory=dict)
    fit: VerifyFit = field(init=False)

    def __post_init__(self) -> None:
        self.fit = fit_verify(self.verify)

    def depth_ms(self, depth: int) -> float:
        """What a context of `depth` tokens adds to a forward or round over the short context's."""
        return self.depth_slope_ms * max(0, depth - self.short_ctx)

    def verify_ms(self, width: int, depth: int = 0) -> float:
        return max(self.fit(width), 1e-6) + self.depth_ms(depth)

    def drafter_ms(self, cap: int) -> float:
        if cap in self.drafter:
            return self.drafter[cap].median_ms
        known = sorted(self.drafter)
        if not known:
            return 0.0
        lo = max([c for c in known if c <= cap], default=known[0])
        hi = min([c for c in known if c >= cap], default=known[-1])
        if lo == hi:  # beyond the measured caps: extrapolate from the last step
            step = (self.drafter[known[-1]].median_ms - self.drafter[known[0]].median_ms) / max(1, known[-1] - known[0])
            return self.drafter[known[-1]].median_ms + step * (cap - known[-1])
        f = (cap - lo) / (hi - lo)
        return self.drafter[lo].median_ms * (1 - f) + self.drafter[hi].median_ms * f

    def round_ms(self, cap: int, depth: int = 0) -> float:
        if cap in self.rounds:
            return self.rounds[cap].median_ms + self.depth_ms(depth)
        return self.drafter_ms(cap) + self.verify_ms(cap + 1, depth) + max(0.0, self.overhead.median_ms)

    def plain_ms(self, depth: int = 0) -> float:
        if 0 in self.rounds:
            return self.rounds[0].median_ms + self.depth_ms(depth)
        return self.verify_ms(1, depth)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("fit")
        d["fit"] = asdict(self.fit)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurves":
        pts = lambda m: {int(k): Point(**v) for k, v in m.items()}  # noqa: E731
        return cls(verify=pts(d["verify"]), drafter=pts(d["drafter"]), overhead=Point(**d["overhead"]),
                   depth_slope_ms=float(d["depth_slope_ms"]), short_ctx=int(d["short_ctx"]), long_ctx=int(d["long_ctx"]),
                   rounds=pts(d.get("rounds", {})))
