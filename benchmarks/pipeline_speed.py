"""Pipelined and compiled decoding against the plain loop, side by side in one process.

    python benchmarks/pipeline_speed.py --model DIR --head DIR [--caps 2,4] [--prompts code,math,chat]
        [--limit 2] [--max-new-tokens 128] [--repeats 2] [--no-compile] [--arms greedy,pipe+cd] [--json OUT]

Arms, interleaved prompt by prompt after a warm-up pass (kernel builds, compile traces):
  mlx_lm          mlx-lm's stream_generate on the same model object
  greedy          our plain decoding; greedy+c: with Target.compiled (engine/compiled.py)
  dspark@K        the plain verify loop, head alone (no lookup), cap K
  dspark+lk@K     the same with n-gram lookup drafts (the default of speculative_generate)
  pipe@K          the pipelined loop (engine/pipeline.py): round r+1 built while r computes,
                  the verify forward compiled
  pipe+lk@K       the same with n-gram lookup drafts matched on the device
  pipe+cd@K, pipe+lk+cd@K   the same two with the draft step compiled (compile_draft=True)
  pipe+lkk@K      (CUDA only) pipe+lk with the n-gram match as one custom kernel; the kernel
                  probe's verdict (exact? faster?) is printed first and saved in the JSON
Prints median decode tok/s, the ratio to our greedy and to mlx_lm, the mean accept length and
whether every prompt's tokens equal our greedy's (temperature 0: they must, up to numerical ties
between different kernels; the pipelined arms must equal the plain loop's arm with the same drafts).
Every output that differs from our greedy's is classified at its first difference
(lab/lossless.first_divergence: a fresh prefill of the common prefix, the two tokens' logits):
a tie when they are within one rounding step of the model's logit dtype, "length only" when one
output is the other's prefix; the JSON keeps each difference, and the table counts them and what
is left ("NOT a tie" would be a bug). Each arm's rate is also given as a share of the bandwidth
limit (lab/bandwidth.py: the measured copy bandwidth over the weight bytes plus the KV bytes at the
prompts' mean context; speculative arms may pass 100%, plain decoding cannot).
--precisions 8,16 times the same model stored at other precisions beside the one as loaded
(issue #10's precision grid): 16 is the dequantized copy (a quantized target's layers as float
matrices in its scales' dtype: bfloat16 for this project's Qwen imports), 8 an 8-bit copy
(load_target(quantize=8): close to a 4-bit file's values, within a quarter of a 4-bit step, in
twice the bytes). Each copy gets arms of its own, named with its prefix (dq:, q8:): mlx_lm, greedy and the
speculative arms asked for (--arms; pipe+cd when none is named) at every cap, with the head bound
to the copy. A copy's arms are compared and divided by that copy's greedy and mlx_lm (the speedup
at that precision) and its own bandwidth limit. The dequantized copy's greedy is compared with the
as-loaded greedy, where every difference is at most a tie; the 8-bit copy holds other values, so
its greedy may part from the as-loaded one anywhere and is only counted (other_weights), not
classified. --dequantized is --precisions 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The speculative arms (each at every cap): speculative_generate's options for each.
ARMS = {"dspark": dict(lookup_drafts=False), "dspark+lk": dict(lookup_drafts=True), "pipe": dict(pipeline=True),
        "pipe+lk": dict(pipeline=True, lookup_drafts=True), "pipe+cd": dict(pipeline=True, compile_draft=True),
        "pipe+lk+cd": dict(pipeline=True, lookup_drafts=True, compile_draft=True),
        "pipe+lkk": dict(pipeline=True, lookup_drafts=True, lookup_kernel=True)}  # CUDA only, where the probe finds it exact


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--drafter-bits", type=int, default=16)
    ap.add_argument("--caps", default="2,4")
    ap.add_argument("--prompts", default="code,math,chat")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled greedy arm")
    ap.add_argument("--precisions", default="", help="also time copies of the target at these precisions: 16 (dequantized: bfloat16 for bfloat16 scales), 8 (8-bit); e.g. 8,16")
    ap.add_argument("--dequantized", action="store_true", help="the same as --precisions 16")
    ap.add_argument("--copy-mib", type=int, default=1024, help="array size for the copy-bandwidth measurement")
    ap.add_argument("--arms", default="", help="only these speculative arms, by name without the cap (e.g. dspark,pipe,pipe+cd); "
                    "mlx_lm and greedy always run. Each arm costs a timed pass per prompt and repeat, so a short device session names a few")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    from dspark_lab import greedy_generate, load_target, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.fused import as_stored
    from dspark_lab.engine.text import encode_prompt
    from dspark_lab.lab.bandwidth import copy_bandwidth, decode_bytes, limit_tokens_per_second
    from dspark_lab.lab.device import mlx_env
    from dspark_lab.lab.lossless import first_divergence
    from dspark_lab.lab.prompts import load_prompt_sets

    target, tok = load_target(args.model)
    head = load_dspark(args.head, target, bits=args.drafter_bits)
    prompts = [encode_prompt(tok, p.as_input()) for s in load_prompt_sets(args.prompts, limit=args.limit) for p in s.prompts]
    caps = [int(c) for c in args.caps.split(",")]
    n = args.max_new_tokens
    eos = set(tok.eos_token_ids)

    def mlx_lm(ids, on=target):
        first, out = None, []
        with as_stored(on.model):  # as mlx-lm loads it: each projection its own layer
            for resp in stream_generate(on.model, tok, ids, max_tokens=n):
                first = first or time.perf_counter()
                out.append(resp.token)
        end = time.perf_counter()
        out = [t for t in out if t not in eos]
        return out, (len(out) - 1) / (end - first), None

    def ours(fn, compiled=False):
        def run(ids):
            target.compiled = compiled
            r = fn(ids)
            target.compiled = False
            return r.token_ids, r.decode_tokens_per_sec, r.accept_lengths
        return run

    arms = {"mlx_lm": mlx_lm, "greedy": ours(lambda ids: greedy_generate(target, tok, ids, max_new_tokens=n))}
    if not args.no_compile:
        arms["greedy+c"] = ours(lambda ids: greedy_generate(target, tok, ids, max_new_tokens=n), compiled=True)
    wanted = {a.strip() for a in args.arms.split(",") if a.strip()}
    if wanted - set(ARMS):
        raise SystemExit(f"--arms: unknown arm(s) {', '.join(sorted(wanted - set(ARMS)))}; choose from {', '.join(sorted(ARMS))}")
    keep = lambda arm: not wanted or arm in wanted  # noqa: E731
    kernel_verdict = None
    from dspark_lab.engine.kernels import cuda_available

    if cuda_available() and keep("pipe+lkk"):
        from dspark_lab.lab.kernel_probe import measure_lookup_kernel

        kernel_verdict = measure_lookup_kernel(loop=(target, head, tok))  # the match alone, then in the loop
        print(f"n-gram kernel probe: {kernel_verdict.describe()}")
    for k in caps:
        spec = lambda ids, k=k, **kw: speculative_generate(target, tok, head, ids, max_new_tokens=n, max_draft_tokens=k, **kw)  # noqa: E731
        for arm, kw in ARMS.items():
            if arm == "pipe+lkk" and not (kernel_verdict is not None and kernel_verdict.exact):  # CUDA: the n-gram match as one kernel
                continue
            if keep(arm):
                arms[f"{arm}@{k}"] = ours(lambda ids, spec=spec, kw=kw: spec(ids, **kw))
    precisions = [int(b) for b in args.precisions.split(",") if b.strip()] + [16] * args.dequantized
    if set(precisions) - {8, 16}:
        raise SystemExit(f"--precisions: {args.precisions!r}; choose from 8 and 16 (e.g. 8,16)")
    copies = {}  # prefix -> the target stored at that precision (its head bound to it)
    for bits in dict.fromkeys(precisions):
        prefix = "dq:" if bits == 16 else f"q{bits}:"
        copy, _ = load_target(args.model, dequantize=True) if bits == 16 else load_target(args.model, quantize=bits)
        copies[prefix] = copy
        copy_head = load_dspark(args.head, copy, bits=args.drafter_bits)
        arms[prefix + "mlx_lm"] = lambda ids, copy=copy: mlx_lm(ids, copy)
        arms[prefix + "greedy"] = ours(lambda ids, copy=copy: greedy_generate(copy, tok, ids, max_new_tokens=n))
        for k in caps:
            for arm, kw in ARMS.items():
                if arm != "pipe+lkk" and (arm in wanted if wanted else arm == "pipe+cd"):
                    arms[f"{prefix}{arm}@{k}"] = ours(lambda ids, copy=copy, head=copy_head, k=k, kw=kw: speculative_generate(
                        copy, tok, head, ids, max_new_tokens=n, max_draft_tokens=k, **kw))

    rates = {a: [] for a in arms}
    accepts = {a: [] for a in arms}
    tokens: dict[tuple[str, int], list[int]] = {}
    for rep in range(args.repeats + 1):  # pass 0 warms up
        for i, ids in enumerate(prompts):
            for name, arm in list(arms.items()):
                try:
                    out, rate, acc = arm(ids)
                except Exception as e:  # one arm failing on this machine must not lose the others
                    print(f"arm {name} failed and is dropped: {type(e).__name__}: {e}")
                    target.compiled = False
                    del arms[name]
                    continue
                tokens.setdefault((name, i), out)
                if rep:
                    rates[name].append(rate)
                    accepts[name] += acc or []
    med = {a: statistics.median(rates[a]) for a in arms}
    weight_bytes, kv_per_position = decode_bytes(target)
    bandwidth = copy_bandwidth(args.copy_mib)
    context = statistics.mean(len(ids) for ids in prompts) + n / 2
    limit = limit_tokens_per_second(bandwidth, weight_bytes, kv_per_position, context)
    limits = {"": limit} | {prefix: limit_tokens_per_second(bandwidth, *decode_bytes(copy), context) for prefix, copy in copies.items()}
    divergences: dict[tuple[int, tuple[int, ...], str], dict] = {}  # many arms emit the same tokens: one prefill each

    def prefix_of(name: str) -> str:
        return next((p for p in copies if name.startswith(p)), "")

    def reference(name: str) -> str:
        """The arm a row is compared with and divided by: its own precision's greedy (for a copy's
        greedy, the as-loaded greedy)."""
        prefix = prefix_of(name)
        return "greedy" if name == prefix + "greedy" else prefix + "greedy"

    def other_weights(name: str) -> bool:
        """A quantized copy's own baselines, against the as-loaded greedy: other values, not a tie question."""
        return prefix_of(name).startswith("q") and reference(name) == "greedy"

    def differences(name: str) -> list[dict]:
        out = []
        ref_name = reference(name)
        if other_weights(name):
            return out
        on = copies.get(prefix_of(ref_name), target)  # classified on the model the reference ran
        for i, ids in enumerate(prompts):
            got, ref = tokens[(name, i)], tokens[(ref_name, i)]
            if got != ref:
                key = (i, tuple(got), ref_name)
                if key not in divergences:
                    divergences[key] = first_divergence(on, ids, ref, got)
                out.append({"prompt": i, **divergences[key]})
        return out

    rows = []
    print(f"bandwidth limit {limit:.0f} tok/s ({bandwidth / 1e9:.0f} GB/s copy; {weight_bytes / 2**20:.0f} MiB of weights "
          f"+ {kv_per_position} B of KV a position at a mean context of {context:.0f})")
    print(f"{'arm':16} {'tok/s':>8} {'/greedy':>8} {'/mlx_lm':>8} {'limit':>6} {'accept':>7}  identical to greedy [ties among the rest] (and to the plain loop)")
    for name in arms:
        prefix, ref_name = prefix_of(name), reference(name)
        same = sum(tokens[(name, i)] == tokens[(ref_name, i)] for i in range(len(prompts)))
        diffs = differences(name)
        ties = sum(bool(d.get("tie")) for d in diffs)
        # Equal up to where one ends (mlx_lm's arm drops end-of-sequence tokens, ours stop at them).
        lengths = sum(bool(d.get("length_differs")) for d in diffs)
        # the plain loop with the same drafts
        plain = name.replace("+cd", "").replace("+lkk@", "+lk@").replace("pipe@", "dspark@").replace("pipe+lk@", "dspark+lk@")
        same_plain = sum(tokens[(name, i)] == tokens[(plain, i)] for i in range(len(prompts))) if plain != name and plain in arms else None
        acc = accepts[name]
        # a copy's greedy over the as-loaded greedy; every other arm over its own precision's
        row = {"arm": name, "tok_s": round(med[name], 1), "vs_greedy": round(med[name] / med[ref_name], 3),
               "vs_mlx_lm": round(med[name] / med[prefix + "mlx_lm"], 3), "fraction_of_limit": round(med[name] / limits[prefix], 6), "mean_accept_len": round(sum(acc) / len(acc), 3) if acc else None,
               "identical_to_greedy": f"{same}/{len(prompts)}", "identical_to_plain_loop": None if same_plain is None else f"{same_plain}/{len(prompts)}",
               "differences_from_greedy": diffs, "ties": ties, "length_only": lengths, "not_ties": len(diffs) - ties - lengths}
        rows.append(row)
        notes = [f"{ties} tie{'s' if ties != 1 else ''}"] * bool(ties) + [f"{lengths} length only"] * bool(lengths)
        notes += [f"{row['not_ties']} NOT a tie"] * bool(row["not_ties"])
        notes += ["other weights"] * other_weights(name)
        row["other_weights"] = other_weights(name)
        tie_note = f" [{', '.join(notes)}]" if notes else ""
        print(f"{name:16} {med[name]:8.1f} {row['vs_greedy']:8.3f} {row['vs_mlx_lm']:8.3f} {row['fraction_of_limit']:6.1%} {row['mean_accept_len'] or '':>7}  "
              f"{row['identical_to_greedy']}{tie_note}" + (f" ({row['identical_to_plain_loop']})" if same_plain is not None else ""))
    result = {"model": args.model, "head": args.head, "caps": caps, "repeats": args.repeats, "max_new_tokens": n,
              "prompts": len(prompts), "device": str(mx.default_device()), "mlx_env": mlx_env(), "rows": rows,
              "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2), "weight_bytes": weight_bytes, "kv_bytes_per_position": kv_per_position,
              "mean_context": round(context, 1), "limit_tok_s": round(limit, 1),
              "lookup_kernel_probe": kernel_verdict.to_dict() if kernel_verdict is not None else None,
              "copies": {prefix: {"weight_bytes": decode_bytes(copy)[0], "limit_tok_s": round(limits[prefix], 1)} for prefix, copy in copies.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
