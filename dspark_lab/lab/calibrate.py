"""Measure a pair's cost curves on this machine, store them keyed by the device stamp, reuse
them while nothing that changes cost has changed, and turn them into a cap controller.

All timings are warmed up first (on CUDA the first use of a kernel shape compiles) and
repeated (>= 5 by default); each point keeps its median and spread.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..engine.generate import Draft, DraftSource, speculative_loop
from ..engine.sampling import SamplingParams
from ..engine.target import Target
from ..engine.text import TextStream
from .controller import DEFAULT_ACCEPTANCE, CapController
from .curves import CostCurves, Point

MODES = ("dspark", "lookup", "dflash", "draft", "dspark-pipe")
# Measured in its own loop (_measure_pipelined): a pipelined round's verify is a compiled forward
# at an array offset and its draft the loop's own call, whose costs differ from the plain loop's
# parts (on an H100 the 1.5B's pipelined round cost 1.5 compiled plain steps at cap 2 and 2.2 at
# cap 7, forty-third round, docs/performance.md): the cap worth running is a property of that loop.
PIPELINED_MODES = ("dspark-pipe",)


def _is_draft_model(drafter) -> bool:
    """A draft model is a plain `Target` (mode draft); a head has taps and a config."""
    return isinstance(drafter, Target)


class _NoText:
    """Calibration feeds token ids only; nothing is decoded."""

    eos_token_ids: list[int] = []

    def decode(self, ids):
        return ""


class _FixedWidth(DraftSource):
    """A synthetic draft source that always drafts exactly `cap` tokens: the real drafter's
    proposal (dspark), or the pending token repeated (lookup, whose drafting costs nothing)."""

    def __init__(self, drafter, cap: int):
        self.drafter, self.cap = drafter, cap
        self.taps = drafter.target_layer_ids if drafter is not None else ()

    def start(self, prompt_ids, prompt_taps):
        if self.drafter is not None:
            self.drafter.reset()
            self.drafter.append_context(prompt_taps)

    def propose(self, pending, cap, params):
        if self.drafter is None:
            return Draft([pending] * cap)
        return Draft(self.drafter.draft(pending, cap, params).tokens)

    def commit(self, tokens, taps):
        if self.drafter is not None and taps:
            self.drafter.append_context(taps)


@dataclass
class CalibrationPlan:
    max_cap: int
    repeats: int = 5
    short_ctx: int = 128
    long_ctx: int = 1024
    overhead_rounds: int = 12


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t


def _token_ids(target: Target, plan: CalibrationPlan) -> mx.array:
    """The tokens a calibration feeds: random (a fixed key, the same every time), enough for the
    long context and the widest verify after it."""
    return mx.random.randint(0, max(2, target.vocab_size - 2), (plan.long_ctx + plan.max_cap + 2,),
                             key=mx.random.key(0)).astype(mx.uint32)


def _prefilled(target: Target, ids: mx.array, n: int, taps):
    """A fresh cache holding ids[:n], and the prefill's output (its taps start a head's context)."""
    cache = target.make_cache()
    out = target.forward(ids[:n], cache, taps=taps, last_only=True)
    mx.eval(out.logits, *out.taps.values())
    return cache, out


def _depth_slope(verify: dict[int, Point], at_long_context: Callable[[list[int]], dict[int, Point]], plan: CalibrationPlan) -> float:
    """ms per context token: a few widths timed again at the long context (`at_long_context(widths)`,
    as the short context's were), the median of their slopes."""
    widths = sorted({1, (plan.max_cap + 2) // 2, plan.max_cap + 1})
    long_pts = at_long_context(widths)
    slopes = [(long_pts[w].median_ms - verify[w].median_ms) / (plan.long_ctx - plan.short_ctx) for w in widths]
    return float(sorted(slopes)[len(slopes) // 2])


def measure_curves(target: Target, drafter=None, *, plan: CalibrationPlan, progress: Callable[[str], None] | None = None) -> CostCurves:
    """Measure verify(w), drafter(c), the per-round overhead and the depth slope. `drafter`
    is a head, a draft model (a `Target`) or None (lookup)."""
    from ..engine.drafters.draft_model import DraftModelSource

    say = progress or (lambda _msg: None)
    draft_model = _is_draft_model(drafter)
    taps = drafter.target_layer_ids if drafter is not None and not draft_model else ()
    vocab = target.vocab_size
    ids = _token_ids(target, plan)
    params = SamplingParams()

    def verify_points(cache, n, widths):
        pts = {}
        for w in widths:
            block = ids[n : n + w]

            def run():
                out = target.forward(block, cache, taps=taps)
                return [out.logits, *out.taps.values()]

            _timed(run)  # warm-up: compile this width's kernels
            target.trim(cache, w)
            samples = []
            for _ in range(plan.repeats):
                samples.append(_timed(run))
                target.trim(cache, w)
            pts[w] = Point.of(samples)
            say(f"verify width {w}")
        return pts

    widths = list(range(1, plan.max_cap + 2))
    cache, out = _prefilled(target, ids, plan.short_ctx, taps)
    verify = verify_points(cache, plan.short_ctx, widths)

    drafter_pts: dict[int, Point] = {}
    if draft_model:
        # A round's drafting: the committed tokens the drafter has not seen in one forward, then
        # c - 1 one-token forwards. Each timed proposal is then rejected outright, which leaves
        # one unseen token for the next, as after a round that accepts nothing.
        source = DraftModelSource(drafter, vocab)
        source.start(ids[: plan.short_ctx].tolist(), {})
        pending = int(ids[plan.short_ctx].item())
        source.commit([pending], {})

        def propose_timed(c):
            t = _timed(lambda: source.propose(pending, c, params).tokens)
            source.commit([pending], {})
            return t

        for c in range(1, plan.max_cap + 1):
            propose_timed(c)
            drafter_pts[c] = Point.of([propose_timed(c) for _ in range(plan.repeats)])
            say(f"drafter cap {c}")
    elif drafter is not None:
        drafter.reset()
        drafter.append_context(out.taps)
        pending = int(ids[plan.short_ctx].item())
        for c in range(1, plan.max_cap + 1):
            run = lambda: drafter.draft(pending, c, params).tokens  # noqa: E731
            _timed(run)
            drafter_pts[c] = Point.of([_timed(run) for _ in range(plan.repeats)])
            say(f"drafter cap {c}")
    else:
        from ..engine.drafters.lookup import NgramIndex

        index = NgramIndex(ids[: plan.short_ctx].tolist())
        for c in range(1, plan.max_cap + 1):
            samples = []
            for _ in range(plan.repeats):
                t = time.perf_counter()
                index.propose(c)
                samples.append(time.perf_counter() - t)
            drafter_pts[c] = Point.of(samples)

    slope = _depth_slope(verify, lambda ws: verify_points(_prefilled(target, ids, plan.long_ctx, taps)[0], plan.long_ctx, ws), plan)

    # Overhead: real rounds at a reference cap, minus their model parts.
    ref = _reference_cap(plan)
    # A draft model always drafts exactly the cap it is asked for: it is its own fixed width.
    source = DraftModelSource(drafter, vocab) if draft_model else _FixedWidth(drafter, ref)
    times: list[float] = []
    prompt = ids[: plan.short_ctx].tolist()
    speculative_loop(target, prompt, params, source, max_new_tokens=4, cap=ref, stream=TextStream(_NoText()), mode="calibrate")
    speculative_loop(target, prompt, params, source, max_new_tokens=plan.overhead_rounds * (ref + 1), cap=ref,
                     stream=TextStream(_NoText()), mode="calibrate", on_round=lambda k, n, s: times.append(s))
    model_ms = drafter_pts[ref].median_ms + verify[ref + 1].median_ms
    rounds = Point.of(times)
    overhead = Point(rounds.median_ms - model_ms, rounds.spread_ms, rounds.samples)
    say("overhead")
    return CostCurves(verify=verify, drafter=drafter_pts, overhead=overhead, depth_slope_ms=slope,
                      short_ctx=plan.short_ctx, long_ctx=plan.long_ctx)


def _reference_cap(plan: CalibrationPlan) -> int:
    """The cap whose real rounds, less their parts, give a curve's per-round overhead."""
    return max(1, min(plan.max_cap, 3))


def _measure_pipelined(target: Target, drafter, *, plan: CalibrationPlan, compile_draft: bool, lookup_drafts: bool = False,
                       progress: Callable[[str], None] | None = None) -> CostCurves:
    """Mode dspark-pipe's curves, its parts as the pipelined loop (engine/pipeline.py) runs them:
    verify(w) the compiled forward of w rows at an array offset (Target.forward_at; width 1 is
    the compiled one-row step plain decoding replays), drafter(c) the head's context append and
    draft of c tokens (draft_step_at, one compiled trace with `compile_draft`), the depth slope
    from the same forwards at a long context, and the rounds themselves: real pipelined rounds at
    every cap, which round_ms takes (the loop overlaps a round's draft and host work with the
    device's computing, so the parts alone overstate a round), and plain decoding's tokens (cap
    0, which plain_ms takes). The overhead is the reference cap's round less its parts (negative
    where the overlap wins; informational). `lookup_drafts`:
    the rounds run the device-side n-gram match beside the head, as generate --lookup-drafts and
    sweep --pipe-lookup do (on random tokens it never matches, so its cost is what is timed)."""
    from ..engine.generate import greedy_generate
    from ..engine.pipeline import pipelined_loop
    from ..engine.speculative import LOOKUP_NS, check_pipeline

    check_pipeline(target, drafter)
    say = progress or (lambda _msg: None)
    taps = drafter.target_layer_ids
    ids = _token_ids(target, plan)
    params = SamplingParams()

    def forward_at(cache, n, w):
        # Each call writes the same rows at the same offset: nothing to trim between repeats.
        return target.forward_at(ids[n : n + w], cache, mx.array(n, dtype=mx.int32), capacity=n + w, taps=taps)

    def verify_points(cache, n, widths):
        pts = {}
        for w in widths:
            def run():
                out = forward_at(cache, n, w)
                return [out.logits, *out.taps.values()]

            _timed(run)  # warm-up: trace and compile this width
            pts[w] = Point.of([_timed(run) for _ in range(plan.repeats)])
            say(f"verify width {w}")
        return pts

    n = plan.short_ctx
    cache, out = _prefilled(target, ids, n, taps)
    verify = verify_points(cache, n, list(range(1, plan.max_cap + 2)))

    # A round drafts after the previous round's rows (its c + 1 tapped rows, appended where that
    # round began) from one position further on, as after a round that accepted nothing.
    drafter.reset()
    drafter.append_context(out.taps)
    drafter.ensure_capacity(n + plan.max_cap + 2 + drafter.config.block_size)
    at = mx.array(n, dtype=mx.int32)
    drafter_pts: dict[int, Point] = {}
    for c in range(1, plan.max_cap + 1):
        rows = forward_at(cache, n, c + 1).taps
        mx.eval(*rows.values())
        pending = ids[n + 1 : n + 2]
        run = lambda: drafter.draft_step_at(rows, at, pending, c, params, at + 1, compiled=compile_draft).tokens  # noqa: E731
        _timed(run)
        drafter_pts[c] = Point.of([_timed(run) for _ in range(plan.repeats)])
        say(f"drafter cap {c}")

    slope = _depth_slope(verify, lambda ws: verify_points(_prefilled(target, ids, plan.long_ctx, taps)[0], plan.long_ctx, ws), plan)

    # Random tokens: the head's drafts are rejected, so every round commits one token and runs
    # overhead_rounds * (c + 1) rounds; a round's time hardly depends on what it accepts.
    prompt = ids[:n].tolist()
    rounds: dict[int, Point] = {}
    for c in range(1, plan.max_cap + 1):
        times: list[float] = []
        for tokens, on_round in ((4, None), (plan.overhead_rounds * (c + 1), lambda k, m, sec: times.append(sec))):
            pipelined_loop(target, prompt, params, drafter, max_new_tokens=tokens, cap=c, stream=TextStream(_NoText()),
                           mode="calibrate", on_round=on_round, compile_draft=compile_draft,
                           lookup_n=LOOKUP_NS if lookup_drafts else ())
        rounds[c] = Point.of(times)
        say(f"rounds at cap {c}")
    # Cap 0, plain decoding, which the controller weighs every cap against, likewise as it runs:
    # greedy_generate's compiled one-row step, each scheduled before the host reads the last. The
    # fit's width 1 is a line through every width (on an H100 the 0.5B's 2.84 ms, where it decoded
    # at 3.50: docs/performance.md, forty-fourth round).
    greedy_generate(target, _NoText(), prompt, max_new_tokens=4, compiled_step=True)
    rounds[0] = Point.of([1.0 / greedy_generate(target, _NoText(), prompt, max_new_tokens=plan.overhead_rounds * 4,
                                                compiled_step=True).decode_tokens_per_sec for _ in range(plan.repeats)])
    say("plain decoding")
    ref = _reference_cap(plan)
    overhead = Point(rounds[ref].median_ms - drafter_pts[ref].median_ms - verify[ref + 1].median_ms, rounds[ref].spread_ms,
                     rounds[ref].samples)
    return CostCurves(verify=verify, drafter=drafter_pts, overhead=overhead, depth_slope_ms=slope,
                      short_ctx=n, long_ctx=plan.long_ctx, rounds=rounds)


def calibration_key(device_key: str, model_id: str, drafter_id: str | None, mode: str, options: dict) -> str:
    blob = json.dumps([device_key, model_id, drafter_id, mode, options], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _bits(module) -> int | None:
    """Quantization bits of a model's (first) quantized layer; None when unquantized."""
    return next((int(m.bits) for _, m in module.named_modules() if hasattr(m, "bits")), None)


def load_stored(engine, key: str) -> CostCurves | None:
    """The newest stored curves for `key`; a corrupt or foreign record is ignored with a warning."""
    from sqlmodel import Session, select

    from ..schemas.records import CalibrationRecord

    with Session(engine) as s:
        rows = s.exec(select(CalibrationRecord).where(CalibrationRecord.key == key).order_by(CalibrationRecord.created_at.desc())).all()
    for row in rows:
        try:
            curves = CostCurves.from_dict(json.loads(row.curves))
            if not curves.verify or 1 not in curves.verify:
                raise ValueError("no verify(1) point")
            return curves
        except Exception as e:  # noqa: BLE001 - any damage means: do not trust it
            warnings.warn(f"ignoring calibration record {row.id} ({type(e).__name__}: {e}); recalibrating", stacklevel=2)
    return None


def calibrate(
    target: Target,
    drafter=None,
    *,
    mode: str = "dspark",
    model_id: str | None = None,
    drafter_id: str | None = None,
    max_cap: int | None = None,
    db=None,
    recalibrate: bool = False,
    acceptance=None,
    plan: CalibrationPlan | None = None,
    progress: Callable[[str], None] | None = None,
    compile_draft: bool = False,
    lookup_drafts: bool = False,
) -> CapController:
    """A CapController on this machine's cost curves for the pair: stored curves when the key
    matches (unless `recalibrate`), freshly measured (and stored) otherwise. The controller
    carries them as `.curves`, and `.reused` says whether they came from the database.
    Mode dspark-pipe measures the pipelined loop's own parts and rounds (_measure_pipelined;
    `compile_draft` and `lookup_drafts` as the loop will run, and the target's routing, are part
    of the key)."""
    from ..errors import InputError
    from .device import collect_device_stamp, device_key, machine_class

    if mode == "draft-pipe":
        # A draft model drafts through the same forwards in either loop: the plain loop's curves
        # are where the controller starts, and it learns the pipelined rounds' times as they come.
        mode = "draft"
    if mode not in MODES:
        raise InputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")
    if mode != "lookup" and drafter is None:
        flag = "--draft-model DIR" if mode == "draft" else "--drafter DIR"
        raise InputError(f"calibrating mode {mode!r} needs a drafter ({flag}); lookup needs none.")
    if (mode == "draft") != _is_draft_model(drafter):
        raise InputError(f"mode {mode!r} does not fit the drafter given: mode draft takes a draft model (a Target), dspark/dflash a head.")
    if max_cap is None:
        max_cap = drafter.config.max_drafts if drafter is not None and mode != "draft" else 8
    plan = plan or CalibrationPlan(max_cap=max_cap)
    drafter_weights = None if drafter is None else (drafter.model if mode == "draft" else drafter.head)
    options = {"max_cap": max_cap, "kv_bits": target.kv_bits, "target_bits": _bits(target.model),
               "drafter_bits": _bits(drafter_weights) if drafter_weights is not None else None,
               "drafter_window": getattr(drafter, "window", None), "short_ctx": plan.short_ctx, "long_ctx": plan.long_ctx}
    if mode in PIPELINED_MODES:
        # What else sets a pipelined round's cost (the plain modes' keys stay as they were).
        # rounds_timed: curves whose round_ms is the loop's own rounds (before, the sum of parts).
        options.update(compile_draft=bool(compile_draft), lookup_drafts=bool(lookup_drafts), rows_routed=bool(target.rows_routed),
                       attention_routed=target.attention_route is not None, rounds_timed=True)
    stamp = collect_device_stamp(options)
    model_id = model_id or target.name
    drafter_id = drafter_id or (getattr(drafter, "name", None) if drafter is not None else None)
    key = calibration_key(device_key(stamp), model_id, drafter_id, mode, options)
    curves, reused = None, False
    if db is not None and not recalibrate:
        curves = load_stored(db, key)
        reused = curves is not None
    if curves is None:
        curves = (_measure_pipelined(target, drafter, plan=plan, compile_draft=compile_draft, lookup_drafts=lookup_drafts,
                                     progress=progress)
                  if mode in PIPELINED_MODES else measure_curves(target, drafter, plan=plan, progress=progress))
        if db is not None:
            from sqlmodel import Session

            from ..schemas.records import CalibrationRecord

            with Session(db) as s:
                s.add(CalibrationRecord(id=uuid.uuid4().hex, key=key, device_key=device_key(stamp), machine=machine_class(stamp),
                                        device_stamp=json.dumps(stamp, default=str), model_id=model_id, drafter_id=drafter_id,
                                        mode=mode, target_bits=options["target_bits"], drafter_bits=options["drafter_bits"],
                                        options=json.dumps(options), curves=json.dumps(curves.to_dict())))
                s.commit()
    prior = acceptance if acceptance is not None else DEFAULT_ACCEPTANCE[mode]
    return CapController(curves, max_cap=max_cap, prior=prior, reused=reused)


class FixedCap:
    """A 'controller' that always asks for one cap and records what each round did."""

    def __init__(self, cap: int):
        self._cap = cap
        self.rounds: list[tuple[int, int, float]] = []

    def cap(self) -> int:
        return self._cap

    def observe(self, drafted: int, committed: int, seconds: float) -> None:
        self.rounds.append((drafted, committed, seconds))


def validate(target: Target, tokenizer, drafter, curves: CostCurves, *, prompts: list, max_cap: int, mode: str = "dspark",
             max_new_tokens: int = 64, progress: Callable[[str], None] | None = None, compile_draft: bool = False,
             lookup_drafts: bool = False) -> dict:
    """Run the pair at every cap on `prompts`: predicted vs measured round time, and whether the
    cap the controller would choose (at the acceptance measured here) is within 5% of the best
    measured rate. Mode dspark-pipe runs the pipelined loop (`compile_draft` and `lookup_drafts`
    as calibrated), its plain decoding the compiled one-row step (the curve's cap 0)."""
    from ..engine.generate import greedy_generate, lookup_generate
    from ..engine.speculative import draft_model_generate, speculative_generate
    from .controller import static_cap

    say = progress or (lambda _m: None)
    pipelined = mode in PIPELINED_MODES
    results = [greedy_generate(target, tokenizer, p, max_new_tokens=max_new_tokens, compiled_step=pipelined) for p in prompts]
    plain_tokens = sum(r.num_tokens - 1 for r in results)
    plain_seconds = sum((r.num_tokens - 1) / r.decode_tokens_per_sec for r in results if r.decode_tokens_per_sec)
    rows = [{"cap": 0, "predicted_round_ms": curves.plain_ms(), "measured_round_ms": 1000 * plain_seconds / max(plain_tokens, 1),
             "rel_error": None, "tokens_per_sec": plain_tokens / plain_seconds if plain_seconds else 0.0}]
    rows[0]["rel_error"] = abs(rows[0]["predicted_round_ms"] - rows[0]["measured_round_ms"]) / rows[0]["measured_round_ms"]
    accepted_at: dict[int, list[float]] = {}
    for cap in range(1, max_cap + 1):
        fixed = FixedCap(cap)
        tokens = seconds = 0.0
        for p in prompts:
            if mode == "lookup":
                r = lookup_generate(target, tokenizer, p, max_new_tokens=max_new_tokens, max_draft_tokens=max_cap, cap_controller=fixed)
            elif mode == "draft":
                r = draft_model_generate(target, tokenizer, drafter, p, max_new_tokens=max_new_tokens, max_draft_tokens=max_cap, cap_controller=fixed)
            else:
                r = speculative_generate(target, tokenizer, drafter, p, max_new_tokens=max_new_tokens, cap_controller=fixed,
                                         lookup_drafts=lookup_drafts and pipelined,
                                         **({"pipeline": True, "compile_draft": compile_draft} if pipelined else {}))
            tokens += r.num_tokens - 1
            seconds += (r.num_tokens - 1) / r.decode_tokens_per_sec if r.decode_tokens_per_sec else 0.0
        full = [(k, n, s) for k, n, s in fixed.rounds if k == cap]
        measured = 1000 * sorted(s for _, _, s in full)[len(full) // 2] if full else float("nan")
        predicted = curves.round_ms(cap)
        # Conditional acceptance per position at this cap, for the controller's choice below.
        for i in range(cap):
            tried = [n - 1 for k, n, _ in fixed.rounds if k > i]
            if tried:
                accepted_at.setdefault(i, []).append(sum(1 for a in tried if a > i) / len(tried))
        rows.append({"cap": cap, "predicted_round_ms": predicted, "measured_round_ms": measured,
                     "rel_error": abs(predicted - measured) / measured if measured == measured else None,
                     "tokens_per_sec": tokens / seconds if seconds else 0.0})
        say(f"validate cap {cap}")
    profile = [sum(v) / len(v) for _, v in sorted(accepted_at.items())] or [0.0]
    chosen = static_cap(curves, profile, max_cap)
    best = max(rows, key=lambda r: r["tokens_per_sec"])
    chosen_rate = next((r["tokens_per_sec"] for r in rows if r["cap"] == chosen), 0.0)
    return {"rows": rows, "acceptance_profile": profile, "controller_cap": chosen, "best_measured_cap": best["cap"],
            "within_5_percent": chosen_rate >= 0.95 * best["tokens_per_sec"]}
