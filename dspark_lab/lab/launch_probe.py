"""Whether `Target.launch_every` pays for this model on this machine: a one-time probe whose
verdict is stored like calibration (keyed by the device stamp) and reused.

Handing the device finished layers early overlaps the host's graph building with the device's
computing. Measured, that helps or hurts depending on the pair: on the CPU speculative rounds ran
1.3-1.4x faster; on the H200 SmolLM2's rounds 6% faster and Qwen2.5-Coder-0.5B's 8% slower
(docs/performance.md). So `--launch-every auto` measures instead of guessing.

The probe times what a speculative round pays for: a verify-width forward over a warm cache,
read back by the host (that read is what stops plain decoding's overlap in a round). Each
candidate N is warmed up, then timed with the candidates interleaved; N is only eligible when
its logits equal N=0's bit for bit, and it wins only when its median beats N=0 by MARGIN.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import mlx.core as mx

from ..engine.target import Target
from ..errors import InputError

CANDIDATES = (0, 2, 4, 8)
MARGIN = 0.03  # a candidate must be at least 3% faster than N=0: smaller gains are noise here


def parse_launch_every(value: int | str) -> int | str:
    """--launch-every as given on the command line or in a grid: a layer count >= 0 (0: off), or
    "auto" (this probe). Anything else is refused, naming what is accepted."""
    if value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise InputError(f"--launch-every must be a number of layers >= 0 (0: off) or 'auto', got {value!r}.")


@dataclass
class LaunchVerdict:
    every: int  # the setting to use: 0 (off) unless a candidate was exact and faster
    median_ms: dict[int, float] = field(default_factory=dict)  # per candidate, one verify forward + host read
    exact: dict[int, bool] = field(default_factory=dict)  # logits equal to N=0's, bit for bit
    width: int = 5
    context: int = 256
    reused: bool = False  # read from the database rather than measured now

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("reused")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LaunchVerdict":
        return cls(every=int(d["every"]), median_ms={int(k): float(v) for k, v in d["median_ms"].items()},
                   exact={int(k): bool(v) for k, v in d["exact"].items()}, width=int(d["width"]), context=int(d["context"]))

    def describe(self) -> str:
        base = self.median_ms.get(0)
        parts = [f"N={n}: {ms:.2f} ms" + ("" if self.exact.get(n, True) else " (not exact)") for n, ms in sorted(self.median_ms.items())]
        gain = f", {base / self.median_ms[self.every]:.2f}x N=0" if self.every and base else ""
        return f"launch_every {self.every}{gain} ({'stored' if self.reused else 'measured'}; {', '.join(parts)})"


def measure_launch_every(target: Target, *, width: int = 5, context: int = 256, repeats: int = 7,
                         candidates: tuple[int, ...] = CANDIDATES, progress: Callable[[str], None] | None = None) -> LaunchVerdict:
    """Time one verify-width forward plus its host read at each candidate (see the module doc)."""
    # N=0 is the reference; N >= the layer count would hand nothing over early, so it is N=0 again.
    candidates = tuple(sorted({0} | {n for n in candidates if 0 < n < target.num_layers}))
    ids = mx.array([(13 * i + 7) % target.vocab_size for i in range(context)], dtype=mx.uint32)
    fed = mx.array([(5 * i + 11) % target.vocab_size for i in range(width)], dtype=mx.uint32)
    cache = target.make_cache()
    target.forward(ids, cache, last_only=True)
    mx.eval([c.state for c in cache])
    saved = target.launch_every
    logits, times = {}, {n: [] for n in candidates}
    try:
        def once(n: int) -> float:
            target.launch_every = n
            snap = target.checkpoint(cache)
            t0 = time.perf_counter()
            out = target.forward(fed, cache)
            mx.eval(out.logits)  # the host waits for the result, as a round does for its verdict
            dt = time.perf_counter() - t0
            logits.setdefault(n, out.logits)
            # Back to the same warm cache for the next forward, as a fully rejected round
            # leaves it (recurrent and sliding-window caches restore their saved state).
            target.rewind(cache, snap, fed, 0)
            return dt

        for n in candidates:  # warm-up: on CUDA the first use of a shape compiles kernels
            once(n)
            once(n)
        for r in range(repeats):
            for n in candidates:
                times[n].append(once(n))
            if progress:
                progress(f"launch probe {r + 1}/{repeats}")
    finally:
        target.launch_every = saved
    median = {n: statistics.median(t) * 1000 for n, t in times.items()}
    exact = {n: bool(mx.array_equal(logits[n], logits[0]).item()) for n in candidates}
    best = min((n for n in candidates if n and exact[n]), key=lambda n: median[n], default=0)
    every = best if best and median[best] <= (1 - MARGIN) * median[0] else 0
    return LaunchVerdict(every=every, median_ms=median, exact=exact, width=width, context=context)


def choose_launch_every(target: Target, *, db=None, model_id: str | None = None, width: int = 5, reprobe: bool = False,
                        progress: Callable[[str], None] | None = None) -> LaunchVerdict:
    """The stored verdict for this model on this machine (same device stamp), else a fresh
    probe, stored when `db` is given. Sets nothing: the caller applies `verdict.every`."""
    from .calibrate import _bits
    from .device import collect_device_stamp, device_key
    from .probe_store import probe_key, store_verdict, stored_verdict

    options = {"width": width, "target_bits": _bits(target.model), "kv_bits": target.kv_bits,
               "dtype": str(target._embed.weight.dtype)}
    stamp = collect_device_stamp(options)
    model_id = model_id or target.name
    key = probe_key("launch_every", device_key(stamp), model_id, options)
    if db is not None and not reprobe:
        stored = stored_verdict(db, key)
        if stored is not None:
            try:
                verdict = LaunchVerdict.from_dict(stored)
                verdict.reused = True
                return verdict
            except (KeyError, ValueError, TypeError):  # a damaged record: measure again
                pass
    verdict = measure_launch_every(target, width=width, progress=progress)
    if db is not None:
        store_verdict(db, key=key, probe="launch_every", stamp=stamp, model_id=model_id, options=options, verdict=verdict.to_dict())
    return verdict
