"""How many MLX operations each part of a decoding round puts in the graph (the kernel count),
and how long the host takes to build that graph.

    python benchmarks/op_count.py --model DIR [--head DIR] [--caps 1,4,7] [--context 64] [--repeats 20] [--json OUT]

Where a decode step is launch-bound (small models on a GPU: docs/performance.md), its time
follows the number of kernels it launches more than the bytes it reads. This counts the
primitives in the lazy graph of each part, before evaluation: the same numbers on any device
(the GPU backend may fuse some elementwise ones; on the CPU, MLX's fast norm, rope and
attention are built from plain operations, so counts there are higher). Parts: a plain greedy
step (width-1 forward and argmax), and for a DSpark round at each cap: the head's draft, the
verify forward at width cap+1 with the accept rule, and the accept bookkeeping (target cache
trim, the head's context append), and apart from the round, the device-side n-gram lookup the
pipelined loop adds with --lookup-drafts, and the pipelined draft step (context append and
draft) uncompiled and compiled (compile_draft).

Build time: the host's time to construct each part's graph, without evaluating it (median of
--repeats). Plain decoding builds step t+1 while the device runs step t, so its build time hides
behind the device; a speculative round cannot start building before it has read the previous
verdict, so its build time adds to the device time.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

NODE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def count_ops(*outputs) -> Counter:
    """Primitives in the unevaluated graph behind `outputs`, by name."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return Counter(NODE.findall(buf.getvalue()))


def _cache_state(cache) -> list:
    return [a for c in cache for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state]) if isinstance(a, mx.array)]


def _timed(fn):
    """(fn's result, seconds the call took): graph construction only, nothing is evaluated."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def pipelined_draft_step(drafter, fresh, cap: int, params, hidden: int) -> dict[str, Counter]:
    """Operations of the pipelined loop's drafting (the previous round's rows appended to the
    head's context, then the block drafted, both at array positions), uncompiled ("") and as
    one compiled trace ("_compiled", compile_draft=True: fused chains count once)."""
    out = {}
    for tag, compiled in (("", False), ("_compiled", True)):
        fresh()
        at = mx.array(drafter.ctx_len, dtype=mx.int32)
        drafter.ensure_capacity(drafter.ctx_len + 2 * (cap + 1) + drafter.config.block_size)
        rows = {t: mx.zeros((cap + 1, hidden)) for t in drafter.target_layer_ids}
        pending = mx.array([1], dtype=mx.uint32)
        draft = drafter.draft_step_at(rows, at - cap - 1, pending, cap, params, at, compiled=compiled)
        out[tag] = count_ops(draft.tokens, *_cache_state(drafter.caches))
        mx.eval(draft.tokens, *_cache_state(drafter.caches))
    return out


def measure(target, drafter, prompt: list[int], caps: list[int], repeats: int = 20) -> dict:
    from dspark_lab.engine.pipeline import DeviceLookup
    from dspark_lab.engine.sampling import SamplingParams, verify
    from dspark_lab.engine.speculative import LOOKUP_NS

    params = SamplingParams()
    taps = drafter.target_layer_ids if drafter is not None else ()

    def fresh():
        cache = target.make_cache()
        pre = target.forward(mx.array(prompt, dtype=mx.uint32), cache, taps=taps, last_only=True)
        if drafter is not None:
            drafter.reset()
            drafter.append_context(pre.taps)
            mx.eval([c.state for c in drafter.caches])
        pending = int(mx.argmax(pre.logits[-1]).item())
        mx.eval(_cache_state(cache))
        return cache, pending

    med = lambda xs: round(1000 * statistics.median(xs), 3)  # noqa: E731
    cache, pending = fresh()
    greedy, build = None, []
    for _ in range(repeats + 1):
        (tok, state), dt = _timed(lambda: (mx.argmax(target.forward(mx.array([pending], dtype=mx.uint32), cache).logits[-1]), _cache_state(cache)))
        greedy = greedy or count_ops(tok, *state)
        build.append(dt)
        mx.eval(tok, *state)
    result = {"greedy_step": dict(greedy), "greedy_step_total": sum(greedy.values()), "greedy_build_ms": med(build[1:]), "rounds": []}
    if drafter is None:
        return result
    for cap in caps:
        cache, pending = fresh()
        parts, times = {}, {"draft": [], "verify": [], "accept_trim_append": []}
        for r in range(repeats + 1):
            out, dt = _timed(lambda: drafter.draft(pending, cap, params))
            times["draft"].append(dt)
            parts.setdefault("draft", count_ops(out.tokens))
            mx.eval(out.tokens)

            def build_verify():
                ids = mx.concatenate([mx.array([pending], dtype=mx.uint32), out.tokens])
                fo = target.forward(ids, cache, taps=taps)
                return fo, verify(fo.logits, out.tokens, params, None)

            (fo, verdict), dt = _timed(build_verify)
            times["verify"].append(dt)
            parts.setdefault("verify", count_ops(verdict, *fo.taps.values(), *_cache_state(cache)))
            mx.eval(verdict, *fo.taps.values(), *_cache_state(cache))
            n, pending = verdict.tolist()

            def build_accept():
                target.trim(cache, cap - n)
                drafter.append_context({t: rows[: n + 1] for t, rows in fo.taps.items()})
                return _cache_state(drafter.caches) + _cache_state(cache)

            state, dt = _timed(build_accept)
            times["accept_trim_append"].append(dt)
            parts.setdefault("accept_trim_append", count_ops(*state))
            mx.eval(*state)
        # The pipelined loop's device-side lookup (dspark-pipe --lookup-drafts), counted apart: the
        # plain loop's lookup runs on the host and adds no kernels.
        lookup = DeviceLookup(prompt, LOOKUP_NS)
        drafts = mx.array([(3 * i + 1) % (target.vocab_size - 2) for i in range(cap)], dtype=mx.uint32)
        lk_ops = count_ops(*lookup.overlay(mx.array([pending], dtype=mx.uint32), mx.array(len(prompt), dtype=mx.int32), drafts, None,
                                           len(prompt) + cap + 1)[:1], lookup.tokens)
        step_ops = pipelined_draft_step(drafter, fresh, cap, params, target.hidden_size)
        totals = {k: sum(v.values()) for k, v in parts.items()}
        builds = {k: med(v[1:]) for k, v in times.items()}
        result["rounds"].append({"cap": cap, **{k + "_total": v for k, v in totals.items()}, "round_total": sum(totals.values()),
                                 "round_over_greedy": round(sum(totals.values()) / result["greedy_step_total"], 2),
                                 **{k + "_build_ms": v for k, v in builds.items()},
                                 "round_build_ms": round(sum(builds.values()), 3),
                                 **{k: dict(v) for k, v in parts.items()},
                                 "device_lookup_total": sum(lk_ops.values()), "device_lookup": dict(lk_ops),
                                 **{f"pipe_draft_step{tag}_total": sum(c.values()) for tag, c in step_ops.items()},
                                 **{f"pipe_draft_step{tag}": dict(c) for tag, c in step_ops.items()}})
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", help="DSpark head directory (omit for the greedy step alone)")
    ap.add_argument("--drafter-bits", type=int, default=16)
    ap.add_argument("--caps", default="1,4,7")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from dspark_lab import load_target
    from dspark_lab.engine.drafters.load import load_dspark

    target, _ = load_target(args.model)
    drafter = load_dspark(args.head, target, bits=args.drafter_bits) if args.head else None
    prompt = [(7 * i + 3) % (target.vocab_size - 2) for i in range(args.context)]
    caps = [int(c) for c in args.caps.split(",")]
    r = measure(target, drafter, prompt, caps, args.repeats)
    r.update(model=args.model, head=args.head, context=args.context, drafter_bits=args.drafter_bits)
    print(f"greedy step: {r['greedy_step_total']} ops, built in {r['greedy_build_ms']} ms")
    for row in r["rounds"]:
        print(f"cap {row['cap']}: ops draft {row['draft_total']}, verify {row['verify_total']}, accept/trim/append "
              f"{row['accept_trim_append_total']} (device lookup {row['device_lookup_total']} more; pipelined draft step "
              f"{row['pipe_draft_step_total']}, compiled {row['pipe_draft_step_compiled_total']}); round {row['round_total']} = {row['round_over_greedy']}x a greedy step; "
              f"built in {row['draft_build_ms']} + {row['verify_build_ms']} + {row['accept_trim_append_build_ms']} = {row['round_build_ms']} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main()
