"""Plain decoding's one-row step three ways, side by side in one process: built op by op
(attention over the exact filled slice), compiled (greedy_generate(compiled_step=True): one traced
step replayed at a device-held position, attention over the whole buffer with a mask), and compiled
with that attention through engine/attention_kernel.py (Target.route_attention), beside mlx-lm's
own generation. (The forty-first round ran these arms through Target.compiled, which replays the
same trace at the cache's host offset.)

    python benchmarks/greedy_step.py --model DIR [--prompts 2] [--max-new-tokens 128] [--repeats 3] [--unfused] [--json OUT]

The arms load as the engine does, each layer's q/k/v and gate/up projections stacked into one
product each (engine/fused.py: about 5 fewer operations a layer); --unfused adds the plain and the
kernel's compiled step with each projection its own product, after checking on this device that
the two give the same logits bit for bit. (The forty-second round's runs stepped the arm named
"fused" on the H200, and "unfused" on the H100, through the compiled step with MLX's attention,
not plainly as named: a slip since fixed; docs/performance.md reads them as what they ran.)

Why: on an H100 the compiled one-row forward with the attention kernel took 2.79 ms where the
plain step took 2.95 (docs/performance.md, fortieth round, benchmarks/cuda_graphs.py), and plain
decoding's rate swings 13-15% from one pass to the next on these machines, since the host builds
every step's graph in Python (twenty-second round); a replayed step builds nothing. This decodes:
each arm its own copy of the model, the first --prompts built-in prompts of code, math and chat,
a warm-up pass of every arm, then --repeats passes with the arms in rotated order. Prints each
arm's median decode rate per prompt over the plain step's, the spread of its passes (max - min
over median), and whether its tokens equal the plain step's (a bfloat16 near-tie can order two
tokens differently in a step that attends another way; the lab classifies such differences).
Off CUDA the kernel's float32 reference stands in (a dry run: the rates mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from dspark_lab.engine import greedy_generate, load_target, mlx_lm_generate  # noqa: E402
from dspark_lab.engine import attention_kernel  # noqa: E402
from dspark_lab.engine.kernels import cuda_available  # noqa: E402
from dspark_lab.engine.text import encode_prompt  # noqa: E402
from dspark_lab.lab.prompts import load_prompt_sets  # noqa: E402


ARMS = ("plain", "compiled", "compiled+kernel")
# --unfused: the same steps with each projection its own product (load_target stacks q/k/v and
# gate/up by default, engine/fused.py)
UNFUSED_ARMS = ("unfused", "unfused compiled+kernel")


def load_arms(model: str, unfused: bool = False) -> dict:
    """name -> (target, tokenizer): one copy per way of stepping."""
    arms = {}
    for name in ARMS + (UNFUSED_ARMS if unfused else ()):
        target, tok = load_target(model, fuse_projections=not name.startswith("unfused"))
        if name.endswith("compiled+kernel"):
            target.route_attention(attention_kernel.rows_attention() if cuda_available() else attention_kernel.reference_rows_attention)
        arms[name] = (target, tok)
    return arms


def fused_logits_check(unfused, fused, ids: list[int]) -> dict:
    """Whether the stacked products give the unfused model's logits bit for bit on this device: a
    prefill, then a one-row and an 8-row forward on the same caches (a step and a verify)."""
    out = {}
    caches = unfused.make_cache(), fused.make_cache()
    for name, rows in (("prefill", ids), ("one_row", ids[-1:]), ("eight_rows", ids[-8:])):
        a, b = (t.forward(mx.array(rows), c).logits for t, c in zip((unfused, fused), caches))
        out[name] = {"bit_equal": bool(mx.array_equal(a, b).item()),
                     "max_abs_diff": float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=2, help="built-in prompts per set (code, math, chat)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--unfused", action="store_true", help="add the steps with each projection its own product (the model as "
                    "stored; the engine stacks q/k/v and gate/up, engine/fused.py), after checking the logits agree")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    arms = load_arms(args.model, unfused=args.unfused)
    tok = arms["plain"][1]
    prompts = [p for s in load_prompt_sets("code,math,chat", limit=args.prompts) for p in s.prompts]
    encoded = {p.id: (p.domain, encode_prompt(tok, p.as_input())) for p in prompts}
    check = {}
    if args.unfused:
        check = fused_logits_check(arms["unfused"][0], arms["plain"][0], next(iter(encoded.values()))[1])
        print("stacked projections' logits against unfused: " + ", ".join(f"{k} {'bit-equal' if v['bit_equal'] else 'max diff %.3g' % v['max_abs_diff']}"
                                                         for k, v in check.items()), flush=True)

    def run(name: str, ids) -> tuple[list[int], float]:
        if name == "mlx_lm":  # mlx-lm's stream_generate on the plain copy, timed as our arms are
            r = mlx_lm_generate(arms["plain"][0], tok, ids, max_new_tokens=args.max_new_tokens)
        else:
            r = greedy_generate(arms[name][0], tok, ids, max_new_tokens=args.max_new_tokens, compiled_step="compiled" in name)
        return r.token_ids, r.decode_tokens_per_sec

    names = [*arms, *([] if args.no_mlx_lm else ["mlx_lm"])]
    for _, ids in encoded.values():  # warm-up: traces, kernels, the buffers' first sizes
        for name in names:
            run(name, ids)
    rows = []
    for pid, (domain, ids) in encoded.items():
        rates, outputs = {n: [] for n in names}, {}
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotated: drift hits every arm alike
            for name in order:
                outputs[name], rate = run(name, ids)
                rates[name].append(rate)
        med = {n: statistics.median(v) for n, v in rates.items()}
        row = {"prompt": pid, "set": domain, "tokens": len(outputs["plain"])}
        for n in names:
            row[n] = {"tok_s": round(med[n], 1), "over_plain": round(med[n] / med["plain"], 3),
                      "spread": round((max(rates[n]) - min(rates[n])) / med[n], 3),
                      "same_tokens_as_plain": outputs[n] == outputs["plain"]}
        rows.append(row)
        print(f"{pid:9s} " + "  ".join(f"{n} {row[n]['tok_s']:6.1f} ({row[n]['over_plain']:.2f}x, spread {row[n]['spread']:.2f})"
                                       f"{'' if row[n]['same_tokens_as_plain'] else '*'}" for n in names), flush=True)
    summary = {}
    for n in names:
        summary[n] = {"median_over_plain": round(statistics.median(r[n]["over_plain"] for r in rows), 3),
                      "median_spread": round(statistics.median(r[n]["spread"] for r in rows), 3),
                      "same_tokens": sum(r[n]["same_tokens_as_plain"] for r in rows)}
        print(f"{n}: median {summary[n]['median_over_plain']:.3f}x the plain step, spread {summary[n]['median_spread']:.2f}, "
              f"{summary[n]['same_tokens']}/{len(rows)} prompts token for token the plain step's (* above: not)", flush=True)
    report = {"model": args.model, "device": str(mx.default_device()), "mlx": mx.__version__, "prompts_per_set": args.prompts,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "fused_logits": check, "rows": rows, "summary": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
