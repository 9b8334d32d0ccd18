"""Whether a custom kernel (engine/kernels.py) is exact and faster on this machine: a one-time
probe whose verdict is stored like calibration (keyed by the device stamp) and reused.

The n-gram lookup kernel stands in for DeviceLookup.propose_ops. The probe first compares the
two on random token sequences over a small alphabet (many repeats, so matches of every length
occur) at every position and several draft widths: one differing output and the kernel is out.
Then it times both, interleaved, each call read back by the host, over a buffer of BUFFER
tokens. Given a target and head (`loop=`), it then times what a user gets: the pipelined loop
with device lookup, through the kernel and through the operations, interleaved, on a built-in
code prompt, and requires the same tokens from both. The kernel is used only when it beats the
operations by MARGIN there, in the loop: on the H200 the match alone was 7.5x faster through the
kernel while the loop using it was slower per round (docs/performance.md, eighth round), so the
match's own time does not decide. Without `loop` the match's time decides (the kernel check
alone). Off CUDA the verdict is "not available", with the reason, at no cost.

The rows kernel (engine/rows_kernel.py) stands in for mx.quantized_matmul at decode and verify
widths. Its sums run in float32 in another order than MLX's, so "exact" means: within one
bfloat16 step of the float32 product on every quantized layer shape of the target, and each row
bit-equal to the same row computed alone (so a verify's rows are what a one-row step computes);
then, given a head, the pipelined loop routed through it must give the greedy tokens routed
through it, and decides by its time against the loop through MLX's products.

The one-row attention kernel (engine/attention_kernel.py) is checked against its float32 reference
at a model's head layout, then timed where it runs: draft-pipe with the draft model's one-row steps
through it (choose_attention_kernel), or plain decoding's compiled one-row step through it against
the plain step (choose_greedy_step; their tokens may part at a bfloat16 near-tie, both the model's
argmax).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import mlx.core as mx

from ..engine.pipeline import DeviceLookup
from ..engine.speculative import LOOKUP_NS

MARGIN = 0.03  # at least 3% faster than the operations it replaces: smaller gains are noise
BUFFER = 1024  # tokens in the timed buffer (a prompt plus a long answer)


@dataclass
class KernelVerdict:
    kernel: str
    use: bool  # exact and faster: run it
    reason: str
    available: bool = True  # the kernel could be built for this device (else nothing was checked)
    exact: bool = False  # every compared proposal equal to the MLX operations'
    checked: int = 0  # proposals compared with the reference
    reference_ms: float | None = None  # median per call, read back
    kernel_ms: float | None = None
    loop_reference_ms: float | None = None  # median decode time per token of the pipelined loop, MLX operations
    loop_kernel_ms: float | None = None  # the same through the kernel
    reused: bool = False  # read from the database rather than measured now

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("reused")
        return d

    def describe(self) -> str:
        timing = ""
        if self.reference_ms is not None and self.kernel_ms is not None:
            timing = f"; the match {self.kernel_ms:.3f} ms against {self.reference_ms:.3f} ms for the MLX operations"
        if self.loop_reference_ms is not None and self.loop_kernel_ms is not None:
            timing += f"; the loop {self.loop_kernel_ms:.3f} ms a token against {self.loop_reference_ms:.3f} ms"
        return f"{self.kernel} kernel {'on' if self.use else 'off'} ({'stored' if self.reused else 'measured'}: {self.reason}{timing})"


def _exactness(candidate, ns, sequences: int = 4, length: int = 80, seed: int = 0) -> tuple[int, str | None]:
    """(proposals compared, first difference or None) of candidate(tokens, at, k) against
    DeviceLookup.propose_ops."""
    rng = random.Random(seed)
    checked = 0
    for _ in range(sequences):
        seq = [rng.randrange(4) for _ in range(length)]
        ref = DeviceLookup(seq, ns)
        ref._ensure(length + 40)  # a buffer longer than the text: rows past `at` must be ignored
        for at in range(1, length):
            pos = mx.array(at, dtype=mx.int32)
            for k in (1, 4, 7):
                want = [a.tolist() for a in ref.propose_ops(pos, k)]
                got = [a.tolist() for a in candidate(ref.tokens, pos, k)]
                checked += 1
                if got != want:
                    return checked, f"differs from the MLX operations at position {at}, width {k}: {got} against {want}"
    return checked, None


class _Refused(Exception):
    """A candidate kept out before it is timed; `verdict` says why."""

    def __init__(self, verdict: KernelVerdict):
        super().__init__(verdict.reason)
        self.verdict = verdict


def _checked_candidate(name: str, candidate: Callable | None, build: Callable[[], Callable],
                       check: Callable[[Callable], tuple[int, str | None]]) -> tuple[Callable, int]:
    """(the candidate, the outputs its check compared): `candidate`, or the kernel `build` makes,
    after `check(candidate)` -> (compared, first failure or None) passed. Raises _Refused with the
    verdict when it cannot be built here (not available), fails to run, or is not exact."""
    if candidate is None:
        try:
            candidate = build()
        except RuntimeError as e:
            raise _Refused(KernelVerdict(name, False, f"not available: {e}", available=False)) from None
    try:
        checked, diff = check(candidate)
    except Exception as e:  # a kernel that fails to compile or run is simply not used
        raise _Refused(KernelVerdict(name, False, f"failed to run: {type(e).__name__}: {e}")) from None
    if diff:
        raise _Refused(KernelVerdict(name, False, f"not exact: {diff}", checked=checked))
    return candidate, checked


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _code_prompt_ids(tokenizer) -> list[int]:
    """The first built-in code prompt, encoded: what the loop timings decode."""
    from ..engine.text import encode_prompt
    from .prompts import load_prompt_set

    return encode_prompt(tokenizer, load_prompt_set("code", limit=1).prompts[0].as_input())


def _loop_ms(loop, kernel, ns, *, tokens: int, passes: int) -> tuple[float, float | None, str | None]:
    """(ops ms a token, kernel ms a token, difference or None): the pipelined loop with device
    lookup (greedy, cap 4 or the head's most) through the operations and through `kernel`,
    interleaved after a warm-up pass each; decode time only (the prefill is the same for both)."""
    from ..engine.pipeline import pipelined_loop
    from ..engine.sampling import SamplingParams
    from ..engine.text import TextStream

    target, drafter, tokenizer = loop
    ids = _code_prompt_ids(tokenizer)
    cap = min(4, drafter.config.max_drafts)

    def run(k):
        return pipelined_loop(target, ids, SamplingParams(), drafter, max_new_tokens=tokens, cap=cap,
                              stream=TextStream(tokenizer, None, None), mode="dspark-pipe", lookup_n=ns, lookup_kernel=k)

    times = {"ops": [], "kernel": []}
    outputs = {}
    for rep in range(passes + 1):  # pass 0 warms up (kernels are built on first use)
        for name, k in (("ops", None), ("kernel", kernel)):
            r = run(k)
            outputs.setdefault(name, r.token_ids)
            if rep and r.decode_tokens_per_sec > 0:
                times[name].append(1000 / r.decode_tokens_per_sec)
    a, b = outputs["kernel"], outputs["ops"]
    if a != b:  # the first differing token, or where the shorter one ends
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return 0.0, None, f"the loop's tokens differ from the MLX operations' (first at token {first})"
    return statistics.median(times["ops"]), statistics.median(times["kernel"]), None


def measure_lookup_kernel(candidate: Callable | None = None, *, ns: tuple[int, ...] = LOOKUP_NS, repeats: int = 50,
                          width: int = 4, loop: tuple | None = None, loop_tokens: int = 64,
                          loop_passes: int = 3) -> KernelVerdict:
    """Check and time the n-gram lookup kernel (or `candidate`, a function of the same contract:
    tests hand one in) against DeviceLookup.propose_ops; with `loop=(target, drafter, tokenizer)`
    (a DSpark head on a plain-KV target) also in the pipelined loop, which then decides."""
    from ..engine.kernels import ngram_lookup_kernel

    name = "ngram_lookup"
    try:
        candidate, checked = _checked_candidate(name, candidate, lambda: ngram_lookup_kernel(ns), lambda c: _exactness(c, ns))
    except _Refused as refused:
        return refused.verdict
    rng = random.Random(1)
    lookup = DeviceLookup([rng.randrange(64) for _ in range(BUFFER - 24)], ns)
    lookup._ensure(BUFFER)
    at = mx.array(BUFFER - 25, dtype=mx.int32)
    runs = {"ops": lambda: lookup.propose_ops(at, width), "kernel": lambda: candidate(lookup.tokens, at, width)}
    for fn in runs.values():  # warm-up: first use builds kernels
        _median_ms(fn, 3)
    times = {k: [] for k in runs}
    for _ in range(5):  # interleaved rounds of repeats, so drift hits both alike
        for k, fn in runs.items():
            times[k].append(_median_ms(fn, max(1, repeats // 5)))
    ref_ms, ker_ms = statistics.median(times["ops"]), statistics.median(times["kernel"])
    faster = ker_ms <= (1 - MARGIN) * ref_ms
    reason = f"exact on {checked} proposals, the match " + (f"{ref_ms / ker_ms:.2f}x faster" if faster else "not faster")
    verdict = KernelVerdict(name, faster, reason, exact=True, checked=checked, reference_ms=round(ref_ms, 4), kernel_ms=round(ker_ms, 4))
    if loop is None:
        return verdict
    try:
        loop_ref, loop_ker, diff = _loop_ms(loop, candidate, ns, tokens=loop_tokens, passes=loop_passes)
    except Exception as e:  # the kernel ran alone but not inside the loop: not used
        verdict.use, verdict.reason = False, f"{reason}; failed in the loop: {type(e).__name__}: {e}"
        return verdict
    if diff:
        verdict.use, verdict.exact, verdict.reason = False, False, f"{reason}; not exact in the loop: {diff}"
        return verdict
    verdict.loop_reference_ms, verdict.loop_kernel_ms = round(loop_ref, 4), round(loop_ker, 4)
    verdict.use = loop_ker <= (1 - MARGIN) * loop_ref
    verdict.reason = f"{reason}, the loop " + (f"{loop_ref / loop_ker:.2f}x faster" if verdict.use else "not faster")
    return verdict


def choose_lookup_kernel(*, db=None, reprobe: bool = False, candidate: Callable | None = None, loop: tuple | None = None,
                         model_id: str = "") -> KernelVerdict:
    """The stored verdict for the n-gram kernel on this machine (same device stamp) and, with
    `loop=(target, drafter, tokenizer)`, this pair (`model_id` names it in the key), else a fresh
    probe, stored when `db` is given (unavailable verdicts are not stored: they cost nothing)."""
    from ..engine.kernels import SOURCE_DIGEST

    options = {"ns": list(LOOKUP_NS), "buffer": BUFFER, "mlx": mx.__version__, "candidate": getattr(candidate, "__name__", "cuda"),
               "stage": "loop" if loop is not None else "match", "source": SOURCE_DIGEST}
    return _stored_or_measured("lookup_kernel", options, model_id if loop is not None else "", db, reprobe,
                               lambda: measure_lookup_kernel(candidate, loop=loop))


def _stored_or_measured(probe: str, options: dict, model_id: str, db, reprobe: bool,
                        measure: Callable[[], KernelVerdict]) -> KernelVerdict:
    """The verdict stored for this probe, machine (device stamp), model and options, else
    `measure()`'s, stored when `db` is given (unavailable verdicts are not: they cost nothing)."""
    from .device import collect_device_stamp, device_key
    from .probe_store import probe_key, store_verdict, stored_verdict

    stamp = collect_device_stamp(options)
    key = probe_key(probe, device_key(stamp), model_id, options)
    if db is not None and not reprobe:
        stored = stored_verdict(db, key)
        if stored is not None:
            try:
                verdict = KernelVerdict(**stored)
                verdict.reused = True
                return verdict
            except TypeError:  # a damaged record: measure again
                pass
    verdict = measure()
    if db is not None and verdict.available:
        store_verdict(db, key=key, probe=probe, stamp=stamp, model_id=model_id, options=options, verdict=verdict.to_dict())
    return verdict


# --- the rows kernel (engine/rows_kernel.py) ------------------------------------------------------

ROWS_CHECKED = (1, 2, 8, 17, 32)  # a decode step, small and full verifies, a tree's width, the most the kernel takes


def _rows_exactness(target, candidate) -> tuple[int, str | None]:
    """(products compared, the first failure or None): for every distinct quantized layer shape of
    the target and each of ROWS_CHECKED, the candidate within one bfloat16 step (at the largest
    output's magnitude) of the float32 product, and each of its rows bit-equal to that row computed
    alone (what keeps a verify's rows the one-row step's)."""
    import mlx.nn as nn

    from ..engine.rows_kernel import QUANTIZED_LAYERS, check_rows, supports

    shapes: dict[tuple, nn.Module] = {}
    for _, m in target.model.named_modules():
        if isinstance(m, QUANTIZED_LAYERS):
            shapes.setdefault((tuple(m.weight.shape), m.bits, m.group_size), m)
    key = mx.random.key(0)
    compared = 0
    for (shape, bits, group), m in shapes.items():
        k = shape[1] * 32 // bits
        for rows in ROWS_CHECKED:
            x = mx.random.normal((rows, k), key=key).astype(mx.bfloat16)
            if supports(x, m.weight, m.scales, m.get("biases"), group_size=group, bits=bits) is not None:
                continue
            err, largest, alone_equal = check_rows(candidate, m, x)
            step = largest * 2.0 ** -7
            if not err <= step:
                return compared, f"{rows} rows of a {shape[0]}x{k} layer: off the float32 product by {err:.3g} (one step {step:.3g})"
            if not alone_equal:
                return compared, f"{rows} rows of a {shape[0]}x{k} layer: a row differs from the same row computed alone"
            compared += 1
    if not compared:
        return 0, "no quantized layer the kernel takes (it reads 4- or 8-bit affine layers with bfloat16 scales)"
    return compared, None


def _timed_both_ways(route: Callable[[bool], None], run: Callable[[bool], object], passes: int) -> tuple[dict, dict]:
    """({"mlx": [ms a token, one a pass], "kernel": [...]}, {"mlx": the last pass's tokens, "kernel": ...}):
    each pass routes MLX's way (`route(False)`) then the kernel's (`route(True)`), and after each
    switch runs `run(routed)` once untimed (routing drops the compiled traces; traces and kernels are
    built on first use), then once timed. The caller puts its routing back."""
    times, outputs = {"mlx": [], "kernel": []}, {}
    for _ in range(passes):
        for name in times:
            routed = name == "kernel"
            route(routed)
            run(routed)
            r = run(routed)
            outputs[name] = r.token_ids
            times[name].append(1000 / max(r.decode_tokens_per_sec, 1e-9))
    return times, outputs


def _routed_loop_ms(target, drafter, tokenizer, candidate, *, tokens: int, passes: int) -> tuple[float, float, str | None]:
    """(MLX ms a token, routed ms a token, a failure or None): the pipelined loop (greedy, compiled
    draft, the head's depth up to 7) with the target's products through MLX's kernels and through
    the candidate, alternately, a warm-up run after each switch (routing drops the compiled traces).
    First, routed at every width (one-row steps too), the loop must give the greedy tokens computed
    through the same products. (As the engine routes, most products keep MLX's kernels, whose sums
    differ from the kernel's by rounding: outputs may then part at ties, as they already do
    between MLX's one-row and eight-row kernels.)"""
    from ..engine.generate import greedy_generate
    from ..engine.pipeline import pipelined_loop
    from ..engine.rows_kernel import every_width
    from ..engine.sampling import SamplingParams
    from ..engine.text import TextStream

    ids = _code_prompt_ids(tokenizer)
    cap = min(7, drafter.config.max_drafts)

    def run(_routed=None):
        return pipelined_loop(target, ids, SamplingParams(), drafter, max_new_tokens=tokens, cap=cap,
                              stream=TextStream(tokenizer, None, None), mode="dspark-pipe", compile_draft=True)

    def route(product, **kw):
        target.route_quantized_rows(product, **kw)
        drafter.drop_traces()  # its compiled draft calls the target's lm_head

    try:
        # Lossless through the kernel's own arithmetic: every width routed, one-row steps too.
        route(candidate, policy=every_width)
        got, want = run().token_ids, greedy_generate(target, tokenizer, ids, max_new_tokens=tokens).token_ids
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(want), len(got)))
            return 0.0, 0.0, f"routed, the loop's tokens differ from routed greedy decoding's (first at token {at})"
        # Timed as the engine routes (rows_kernel.worth_routing).
        times, _ = _timed_both_ways(lambda routed: route(candidate if routed else None), run, passes)
    finally:
        target.route_quantized_rows(None)
        drafter.drop_traces()
    return statistics.median(times["mlx"]), statistics.median(times["kernel"]), None


def measure_rows_kernel(target, candidate: Callable | None = None, *, loop: tuple | None = None, loop_tokens: int = 96,
                        loop_passes: int = 2) -> KernelVerdict:
    """Check the rows kernel (or `candidate`, a function of its contract: tests hand in the float32
    stand-in) on the target's own layer shapes; with `loop=(drafter, tokenizer)` time the pipelined
    loop through it and through MLX's products, which decides. Leaves the target routed as it
    found it: through MLX's products."""
    from ..engine.rows_kernel import quantized_rows_matmul

    name = "quantized_rows"
    try:
        candidate, checked = _checked_candidate(name, candidate, quantized_rows_matmul, lambda c: _rows_exactness(target, c))
    except _Refused as refused:
        return refused.verdict
    reason = f"within a bfloat16 step of the float32 product and width-independent on {checked} layer products"
    timed = None if loop is None else (
        lambda: _routed_loop_ms(target, *loop, candidate, tokens=loop_tokens, passes=loop_passes))
    return _decided_by_loop(KernelVerdict(name, False, reason, exact=True, checked=checked), "the loop", "not lossless in the loop: ", timed)


def _decided_by_loop(verdict: KernelVerdict, loop_name: str, refusal: str,
                     timed: Callable[[], tuple[float, float, str | None]] | None) -> KernelVerdict:
    """A verdict whose check passed (its reason says what was checked), completed by timing the
    loop a user runs: `timed()` -> (ms a token through MLX's operations, through the kernel, a
    failure or None). The kernel is used only when its loop beats MLX's by MARGIN; a loop that
    fails or gives other tokens keeps it out. Without `timed` the loop is not timed and the
    kernel stays off."""
    reason = verdict.reason
    if timed is None:
        verdict.reason = reason + " (the loop not timed)"
        return verdict
    try:
        ref_ms, ker_ms, diff = timed()
    except Exception as e:
        verdict.reason = f"{reason}; failed in the loop: {type(e).__name__}: {e}"
        return verdict
    if diff:
        verdict.exact, verdict.reason = False, f"{reason}; {refusal}{diff}"
        return verdict
    verdict.loop_reference_ms, verdict.loop_kernel_ms = round(ref_ms, 4), round(ker_ms, 4)
    verdict.use = ker_ms <= (1 - MARGIN) * ref_ms
    verdict.reason = f"{reason}, {loop_name} " + (f"{ref_ms / ker_ms:.2f}x faster" if verdict.use else "not faster")
    return verdict


def choose_rows_kernel(target, *, db=None, reprobe: bool = False, candidate: Callable | None = None, loop: tuple | None = None,
                       model_id: str = "") -> KernelVerdict:
    """The stored verdict for the rows kernel on this machine and this pair (`model_id` names it),
    else a fresh probe (measure_rows_kernel), stored when `db` is given."""
    from ..engine.rows_kernel import SOURCE_DIGEST, layout_in_force

    layout = layout_in_force()
    # "source": the kernels' sources (a verdict on other sources, an older kernel, is measured again).
    options = {"rows": list(ROWS_CHECKED), "mlx": mx.__version__, "candidate": getattr(candidate, "__name__", "cuda"),
               "stage": "loop" if loop is not None else "check", "routes": _routed_widths(layout), "source": SOURCE_DIGEST}
    if candidate is None and layout != "words":  # a verdict on the words layout (all before) keeps its key
        options["layout"] = layout
    return _stored_or_measured("rows_kernel", options, model_id, db, reprobe, lambda: measure_rows_kernel(target, candidate, loop=loop))


def _routed_widths(layout: str = "words") -> dict[str, list[int]]:
    """The widths the engine's policy routes for a small layer and a large one under `layout` (a
    tensor-core layout's include a tree's verify): in the verdict's key, so a loop timed under
    another policy (before the forty-fifth round a chain's verify kept MLX's products) is timed
    again rather than reused."""
    from ..engine.rows_kernel import LAYOUTS, MAX_ROWS, worth_routing

    tensor_cores = LAYOUTS[layout].tensor_cores if layout in LAYOUTS else False
    return {label: [r for r in range(1, MAX_ROWS + 1) if worth_routing(r, weights, tensor_cores)]
            for label, weights in (("small", 1_000_000), ("large", 200_000_000))}


# --- the one-row attention kernel (engine/attention_kernel.py) ------------------------------------

ATTENTION_OFFSETS = (0, 37, 300)  # positions before the row: the first, a short context, a long one


def _attention_exactness(model, candidate) -> tuple[int, str | None]:
    """(attentions compared, the first failure or None): at the model's head layout, one row at
    each of ATTENTION_OFFSETS over a buffer with garbage past the row (what the mask must hide),
    the candidate within one bfloat16 step (at the largest output's magnitude) of the float32
    reference."""
    import mlx.nn as nn

    from ..engine.attention_kernel import reference_rows_attention, supports

    cfg = model.config
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d, scale = model.head_dim, model.head_dim ** -0.5
    # The model's activations' dtype: its embedding's (a quantized one's scales'), what its queries,
    # keys and values are computed in.
    embed = model._embed
    dtype = (embed.scales if isinstance(embed, nn.QuantizedEmbedding) else embed.weight).dtype
    key = mx.random.key(0)
    compared = 0
    for offset in ATTENTION_OFFSETS:
        buffer = offset + 64
        q = mx.random.normal((1, heads, 1, d), key=key).astype(dtype)
        k = mx.random.normal((1, kv, buffer, d), key=mx.random.key(1)).astype(dtype)
        v = mx.random.normal((1, kv, buffer, d), key=mx.random.key(2)).astype(dtype)
        k[:, :, offset + 1:] = 100.0  # past the row: seen, it would take every weight
        why = supports(q, k, v)
        if why is not None:
            return compared, f"the model's attention is not one the kernel takes ({why})"
        at = mx.array(offset, dtype=mx.int32)
        got = candidate(q, k, v, at, scale).astype(mx.float32)
        ref = reference_rows_attention(q, k, v, at, scale).astype(mx.float32)
        err, largest = mx.abs(got - ref).max().item(), mx.abs(ref).max().item()
        step = max(largest, 1e-3) * 2.0 ** -7
        if not err <= step:
            return compared, f"one row after {offset} positions: off the float32 reference by {err:.3g} (one step {step:.3g})"
        compared += 1
    return compared, None


def _draft_pipe_ms(target, draft_model, tokenizer, candidate, *, tokens: int, passes: int) -> tuple[float, float, str | None]:
    """(MLX ms a token, routed ms a token, a failure or None): draft-pipe on a built-in code
    prompt with the draft model's one-row attention through MLX's and through the candidate,
    alternately, a warm-up run after each switch (routing drops the compiled traces). The two
    must give the same tokens (both are the target's greedy tokens; only the drafts may differ)."""
    from ..engine.speculative import draft_model_generate

    ids = _code_prompt_ids(tokenizer)
    try:
        times, outputs = _timed_both_ways(
            lambda routed: draft_model.route_attention(candidate if routed else None),
            lambda _routed: draft_model_generate(target, tokenizer, draft_model, ids, max_new_tokens=tokens, pipeline=True), passes)
    finally:
        draft_model.route_attention(None)
    if outputs["kernel"] != outputs["mlx"]:
        got, want = outputs["kernel"], outputs["mlx"]
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(want), len(got)))
        return 0.0, 0.0, f"routed, draft-pipe's tokens differ from its tokens through MLX's attention (first at token {at})"
    return statistics.median(times["mlx"]), statistics.median(times["kernel"]), None


def measure_attention_kernel(draft_model, candidate: Callable | None = None, *, loop: tuple | None = None,
                             loop_tokens: int = 96, loop_passes: int = 2) -> KernelVerdict:
    """Check the one-row attention kernel (or `candidate`, a function of its contract: tests hand
    in the float32 reference) at the draft model's head layout; with `loop=(target, tokenizer)`
    time draft-pipe through it and through MLX's attention, which decides. The draft model's
    attention changes only what it drafts, never the tokens decoded (the target verifies them), so
    exactness here is the kernel's own correctness. Leaves the draft model unrouted."""
    timed = None if loop is None else (
        lambda kernel: _draft_pipe_ms(loop[0], draft_model, loop[1], kernel, tokens=loop_tokens, passes=loop_passes))
    return _attention_verdict(draft_model, candidate, "draft-pipe", timed)


def _attention_verdict(model, candidate: Callable | None, loop_name: str,
                       timed: Callable[[Callable], tuple[float, float, str | None]] | None) -> KernelVerdict:
    """The one-row attention kernel (or `candidate`) checked at `model`'s head layout, then, given
    `timed(kernel)` -> (ms a token through MLX's attention, through the kernel, a failure or None),
    decided by the loop `loop_name` it times."""
    from ..engine.attention_kernel import rows_attention

    name = "rows_attention"
    try:
        candidate, checked = _checked_candidate(name, candidate, rows_attention, lambda c: _attention_exactness(model, c))
    except _Refused as refused:
        return refused.verdict
    reason = f"within a bfloat16 step of the float32 reference on {checked} one-row attentions"
    return _decided_by_loop(KernelVerdict(name, False, reason, exact=True, checked=checked), loop_name, "",
                            None if timed is None else (lambda: timed(candidate)))


def choose_attention_kernel(draft_model, *, db=None, reprobe: bool = False, candidate: Callable | None = None,
                            loop: tuple | None = None, model_id: str = "") -> KernelVerdict:
    """The stored verdict for the one-row attention kernel on this machine and this pair
    (`model_id` names it), else a fresh probe (measure_attention_kernel), stored when `db` is given."""
    from ..engine.attention_kernel import SOURCE_DIGEST

    options = {"offsets": list(ATTENTION_OFFSETS), "mlx": mx.__version__, "candidate": getattr(candidate, "__name__", "cuda"),
               "stage": "loop" if loop is not None else "check", "source": SOURCE_DIGEST}
    return _stored_or_measured("attention_kernel", options, model_id, db, reprobe,
                               lambda: measure_attention_kernel(draft_model, candidate, loop=loop))


# --- plain decoding's one-row step, compiled, its attention through the kernel ---------------------

def _launch_sources() -> str:
    """The attention and cache kernels' sources, digested: the compiled step and the launch kernels
    run both, so a verdict on either was measured on both."""
    from ..engine import attention_kernel, cache_kernels

    return f"{attention_kernel.SOURCE_DIGEST}-{cache_kernels.SOURCE_DIGEST}"


def _greedy_step_ms(target, tokenizer, candidate, *, tokens: int, passes: int) -> tuple[float, float, None]:
    """(ms a token stepping plainly, ms a token with compiled steps whose attention goes through the
    candidate, None): greedy decoding of a built-in code prompt both ways, alternately, a warm-up
    run after each switch (routing drops the compiled traces). Their tokens may part where two
    logits tie within a bfloat16 step (the kernel sums attention in float32, MLX's one-row kernel
    does not), both the model's argmax, so that is no failure; the kernel's own check came first.
    The compiled steps write the cache through engine/cache_kernels.py's kernel where this machine
    builds it (bit-equal to MLX's updates, one launch a layer for four). Leaves the target unrouted."""
    from ..engine.cache_kernels import cache_writer_here
    from ..engine.generate import greedy_generate

    ids = _code_prompt_ids(tokenizer)
    writer = cache_writer_here()
    if writer is not None and not _writes_equal(target, writer):
        writer = None  # MLX's updates then, as without the kernel

    def route(routed: bool) -> None:
        target.route_attention(candidate if routed else None)
        target.write_cache_with(writer if routed else None)

    try:
        times, _ = _timed_both_ways(
            route, lambda routed: greedy_generate(target, tokenizer, ids, max_new_tokens=tokens, compiled_step=routed), passes)
    finally:
        route(False)
    return statistics.median(times["mlx"]), statistics.median(times["kernel"]), None


def measure_greedy_step(target, candidate: Callable | None = None, *, tokenizer=None, loop_tokens: int = 96,
                        loop_passes: int = 2) -> KernelVerdict:
    """Check the one-row attention kernel (or `candidate`) at the target's head layout; with a
    `tokenizer`, time plain decoding stepping plainly against compiled steps through it
    (greedy_generate(compiled_step=True) with the target's attention routed), which decides.
    Leaves the target unrouted."""
    timed = None if tokenizer is None else (
        lambda kernel: _greedy_step_ms(target, tokenizer, kernel, tokens=loop_tokens, passes=loop_passes))
    return _attention_verdict(target, candidate, "compiled plain decoding", timed)


def choose_greedy_step(target, *, tokenizer=None, db=None, reprobe: bool = False, candidate: Callable | None = None,
                       model_id: str = "") -> KernelVerdict:
    """The stored verdict for plain decoding's compiled one-row step through the attention kernel on
    this machine and model (`model_id`), else a fresh probe (measure_greedy_step), stored when `db`
    is given."""
    # "writes": the compiled step writes its cache through the kernel since the forty-ninth round; a
    # verdict timed before (attention alone) is timed again.
    options = {"offsets": list(ATTENTION_OFFSETS), "mlx": mx.__version__, "candidate": getattr(candidate, "__name__", "cuda"),
               "stage": "loop" if tokenizer is not None else "check", "writes": "kernel", "source": _launch_sources()}
    return _stored_or_measured("greedy_step", options, model_id, db, reprobe,
                               lambda: measure_greedy_step(target, candidate, tokenizer=tokenizer))


# --- the pipelined loops' launch kernels (engine/attention_kernel.py, engine/cache_kernels.py) ------

LAUNCH_ROWS = (1, 8, 16)  # a compiled one-row step, a chain's verify at cap 7, a tree's of 15 nodes


def launch_kernels() -> tuple:
    """CUDA's (attention, writer, mover) for Target.use_launch_kernels. Raises RuntimeError off CUDA."""
    from ..engine.attention_kernel import rows_attention
    from ..engine.cache_kernels import cache_move_kernel, cache_write_kernel

    return rows_attention(), cache_write_kernel(), cache_move_kernel()


def _launch_exactness(target, kernels) -> tuple[int, str | None]:
    """(outputs compared, the first failure or None): at the target's head layout, the attention
    at each of LAUNCH_ROWS after 300 positions, as a chain and (from 8 rows) as a binary tree,
    within one bfloat16 step of the float32 reference; the writer and the mover bit-equal to MLX's
    operations on every layer's cache buffers."""
    from ..engine.attention_kernel import reference_rows_attention, supports
    from ..engine.cache_kernels import moved_by_operations
    from ..engine.tree import ancestor_matrix

    attention, writer, mover = kernels
    cfg = target.config
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = target.head_dim
    cache = target.make_cache()
    target.forward(mx.array([1, 2, 3], dtype=mx.uint32), cache)
    dtype = cache[0].keys.dtype
    compared, offset = 0, mx.array(300, dtype=mx.int32)
    k, v = (mx.random.normal((1, kv, 384, d), key=mx.random.key(s)).astype(dtype) for s in (1, 2))
    for rows in LAUNCH_ROWS:
        q = mx.random.normal((1, rows, heads, d), key=mx.random.key(rows)).astype(dtype).transpose(0, 2, 1, 3)  # strided, as a model's
        why = supports(q, k, v)
        if why is not None:
            return compared, f"the model's attention is not one the kernel takes ({why})"
        tree = ancestor_matrix([-1] + [(i - 1) // 2 for i in range(1, rows)])  # a binary tree
        for shape, ancestors in (("chain", None), ("tree", mx.array(tree)))[: 1 if rows == 1 else 2]:
            kw = {} if ancestors is None else {"ancestors": ancestors}
            got = attention(q, k, v, offset, d**-0.5, **kw).astype(mx.float32)
            ref = reference_rows_attention(q, k, v, offset, d**-0.5, **kw).astype(mx.float32)
            err, largest = mx.abs(got - ref).max().item(), mx.abs(ref).max().item()
            if not err <= max(largest, 1e-3) * 2.0 ** -7:
                return compared, f"the attention of a {shape} of {rows} rows: off the float32 reference by {err:.3g}"
            compared += 1
    buffers = _random_buffers(cache)
    if not _writes_equal(target, writer, buffers):
        return compared, "the cache writer's buffers differ from MLX's slice updates"
    at, path = mx.array(2, dtype=mx.int32), mx.array([0, 3, 1, 2], dtype=mx.int32)
    if not all(mx.array_equal(a, b).item() for a, b in zip(mover(buffers, at, path), moved_by_operations(buffers, at, path))):
        return compared, "the tree path's move differs from MLX's gathers and slice updates"
    return compared + 2, None


def _random_buffers(cache) -> list[mx.array]:
    """Keys and values buffers of every layer's cache layout, filled at random (a fresh cache's are
    mostly zeros, which would hide a misplaced row), no two alike."""
    dtype = cache[0].keys.dtype
    buffers = [mx.random.normal(c.keys.shape, key=mx.random.key(10 + i)).astype(dtype) for i, c in enumerate(cache) for _ in (0, 1)]
    return [b * (1 + i) for i, b in enumerate(buffers)]


def _writes_equal(target, writer, buffers: list[mx.array] | None = None) -> bool:
    """Whether `writer` writes 8 strided rows into a layer's buffers bit-equal to MLX's slice updates."""
    from ..engine.cache_kernels import written_by_operations

    if buffers is None:
        cache = target.make_cache()
        target.forward(mx.array([1, 2, 3], dtype=mx.uint32), cache)
        buffers = _random_buffers(cache)
    (_, kv, _, d), dtype = buffers[0].shape, buffers[0].dtype
    new = [mx.random.normal((1, 8, kv, d), key=mx.random.key(s)).astype(dtype).transpose(0, 2, 1, 3) for s in (3, 4)]
    at = mx.array(2, dtype=mx.int32)
    return all(mx.array_equal(a, b).item() for a, b in zip(writer(buffers[0], buffers[1], *new, at),
                                                           written_by_operations(buffers[0], buffers[1], *new, at)))


def _launch_loop_ms(target, drafter, tokenizer, kernels, *, tokens: int, passes: int) -> tuple[float, float, None]:
    """(ms a token through MLX's operations, through the kernels, None): the pipelined chain loop
    (greedy, compiled draft, the head's depth up to 7) on a built-in code prompt both ways,
    alternately, a warm-up run after each switch (switching drops the compiled traces). Their
    tokens may part where two logits tie within a bfloat16 step (the kernel's attention sums in
    float32, cuDNN's does not), both the model's argmax, so that is no failure; the kernels'
    own check came first. Leaves the target as it found it."""
    from ..engine.pipeline import pipelined_loop
    from ..engine.sampling import SamplingParams
    from ..engine.text import TextStream

    ids = _code_prompt_ids(tokenizer)
    cap = min(7, drafter.config.max_drafts)

    def switch(on: bool):
        target.use_launch_kernels(kernels if on else None)
        drafter.drop_traces()

    def run(_on=None):
        return pipelined_loop(target, ids, SamplingParams(), drafter, max_new_tokens=tokens, cap=cap,
                              stream=TextStream(tokenizer, None, None), mode="dspark-pipe", compile_draft=True)

    try:
        with target.on_mlx_operations():  # each switch sets its own; the target's own come back after
            times, _ = _timed_both_ways(switch, run, passes)
    finally:
        drafter.drop_traces()
    return statistics.median(times["mlx"]), statistics.median(times["kernel"]), None


def measure_launch_kernels(target, kernels: tuple | None = None, *, loop: tuple | None = None, loop_tokens: int = 96,
                           loop_passes: int = 2) -> KernelVerdict:
    """Check the launch kernels (or `kernels`, functions of their contracts: tests hand in the MLX
    stand-ins) at the target's layout; with `loop=(drafter, tokenizer)` time the pipelined chain
    through them and through MLX's operations, which decides."""
    name = "launch_kernels"
    try:
        kernels, checked = _checked_candidate(name, kernels, launch_kernels, lambda k: _launch_exactness(target, k))
    except _Refused as refused:
        return refused.verdict
    reason = (f"the attention within a bfloat16 step of the float32 reference on {checked - 2} chains and trees, "
              "the cache's write and the tree's move bit-equal to MLX's")
    timed = None if loop is None else (lambda: _launch_loop_ms(target, *loop, kernels, tokens=loop_tokens, passes=loop_passes))
    return _decided_by_loop(KernelVerdict(name, False, reason, exact=True, checked=checked), "the pipelined loop", "", timed)


def choose_launch_kernels(target, *, db=None, reprobe: bool = False, kernels: tuple | None = None, loop: tuple | None = None,
                          model_id: str = "") -> KernelVerdict:
    """The stored verdict for the launch kernels on this machine and this pair (`model_id` names
    it), else a fresh probe (measure_launch_kernels), stored when `db` is given."""
    options = {"rows": list(LAUNCH_ROWS), "mlx": mx.__version__, "candidate": "stand-in" if kernels is not None else "cuda",
               "stage": "loop" if loop is not None else "check", "source": _launch_sources()}
    return _stored_or_measured("launch_kernels", options, model_id, db, reprobe,
                               lambda: measure_launch_kernels(target, kernels, loop=loop))
