"""Where a DSpark round's time goes, at caps 1..7, on a random-weight target and head.

    python benchmarks/round_breakdown.py --shape qwen3-8b --head-layers 5 --caps 1-7 --repeats 20 --out r.json

Two measurements, in one process after warm-up:
1. parts: each part of a round evaluated on its own (mx.eval between parts), so its time is
   its own: draft (head forward + Markov steps), verify (target forward with the tap + the
   accept rule), accept/trim/append (cache trim, fusing and appending the accepted rows to
   the head's context), host (the Python of the round outside those).
2. pipelined: the real `speculative_loop` as users run it (one host read per round), time per
   round = decode time / rounds. Its "non-model overhead" is the pipelined round minus
   draft + verify measured in (1).
Random weights accept almost nothing, which is what a cost breakdown wants: every round
drafts `cap` tokens and verifies cap+1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from dspark_lab.engine.drafters.dspark import DSparkDrafter, DSparkHead
from dspark_lab.engine.drafters.dspark_config import DSparkConfig
from dspark_lab.engine.drafters.load import quantize_head
from dspark_lab.engine.generate import speculative_loop
from dspark_lab.engine.sampling import SamplingParams, verify
from dspark_lab.engine.speculative import HeadSource
from dspark_lab.engine.target import Target
from dspark_lab.engine.text import TextStream

SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1024),
}


class NullTokenizer:
    """Token ids only: the benchmark never needs text."""

    eos_token_ids: list[int] = []

    def decode(self, ids):
        return ""


def build_target(shape: str, dtype) -> Target:
    from mlx_lm.models import qwen3

    cfg = dict(SHAPES[shape], model_type="qwen3", rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
               max_position_embeddings=32768)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return Target(model, cfg, name=f"random-{shape}")


def build_head(shape: str, layers: int, block: int, bits: int, dtype) -> DSparkDrafter:
    s = SHAPES[shape]
    n = s["num_hidden_layers"]
    taps = sorted({1, n // 4, n // 2, 3 * n // 4, n - 2})
    c = DSparkConfig(hidden_size=s["hidden_size"], vocab_size=s["vocab_size"], num_hidden_layers=layers,
                     intermediate_size=s["intermediate_size"], num_attention_heads=s["num_attention_heads"],
                     num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], block_size=block,
                     mask_token_id=s["vocab_size"] - 1, target_layer_ids=taps, markov_rank=256, enable_confidence_head=True)
    head = DSparkHead(c, s["hidden_size"])
    head.set_dtype(dtype)
    quantize_head(head, bits)
    mx.eval(head.parameters())
    return DSparkDrafter(head, head.embed_tokens, head.lm_head)


def parts_round(target, drafter, cache, pending, cap, params):
    """One round with an eval after each part; returns part times in seconds."""
    t0 = time.perf_counter()
    out = drafter.draft(pending, cap, params)
    mx.eval(out.tokens)
    t1 = time.perf_counter()
    ids = mx.concatenate([mx.array([pending], dtype=mx.uint32), out.tokens])
    fo = target.forward(ids, cache, taps=drafter.target_layer_ids)
    verdict = verify(fo.logits, out.tokens, params, None)
    mx.eval(verdict, *fo.taps.values())
    t2 = time.perf_counter()
    n, nxt = verdict.tolist()
    th = time.perf_counter()
    target.trim(cache, cap - n)
    drafter.append_context({t: rows[: n + 1] for t, rows in fo.taps.items()})
    mx.eval([c.state for c in drafter.caches] + [c.state for c in cache])
    t3 = time.perf_counter()
    return {"draft": t1 - t0, "verify": t2 - t1, "host": th - t2, "accept_trim_append": t3 - th}, nxt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", choices=SHAPES)
    ap.add_argument("--head-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--drafter-bits", type=int, default=4)
    ap.add_argument("--caps", default="1-7")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    lo, hi = map(int, args.caps.split("-"))
    caps = list(range(lo, hi + 1))
    dtype = mx.bfloat16 if mx.default_device().type == mx.gpu else mx.float32
    mx.random.seed(0)
    target = build_target(args.shape, dtype)
    drafter = build_head(args.shape, args.head_layers, args.block, args.drafter_bits, dtype)
    params = SamplingParams()
    prompt = mx.random.randint(0, SHAPES[args.shape]["vocab_size"] - 2, (args.context,)).tolist()

    def fresh():
        cache = target.make_cache()
        pre = target.forward(mx.array(prompt, dtype=mx.uint32), cache, taps=drafter.target_layer_ids, last_only=True)
        drafter.reset()
        drafter.append_context(pre.taps)
        pending = mx.argmax(pre.logits[-1]).item()
        return cache, pending

    # Plain decoding step for reference (width-1 forward, no tap).
    cache, pending = fresh()
    for _ in range(5):
        mx.eval(target.forward(mx.array([pending], dtype=mx.uint32), cache).logits)
    t = time.perf_counter()
    for _ in range(args.repeats):
        mx.eval(target.forward(mx.array([pending], dtype=mx.uint32), cache).logits)
    plain_step = (time.perf_counter() - t) / args.repeats

    rows = []
    for cap in caps:
        cache, pending = fresh()
        for _ in range(3):  # warm-up: compile this cap's shapes
            _, pending = parts_round(target, drafter, cache, pending, cap, params)
        samples = []
        for _ in range(args.repeats):
            p, pending = parts_round(target, drafter, cache, pending, cap, params)
            samples.append(p)
        med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        # The real loop, pipelined, same cap.
        source = HeadSource(drafter, lookup=False)
        speculative_loop(target, prompt, params, source, max_new_tokens=8, cap=cap, stream=TextStream(NullTokenizer()), mode="dspark")
        res = speculative_loop(target, prompt, params, source, max_new_tokens=args.repeats * 2, cap=cap,
                               stream=TextStream(NullTokenizer()), mode="dspark")
        round_s = (res.num_tokens - 1) / res.decode_tokens_per_sec / res.num_rounds
        model = med["draft"] + med["verify"]
        rows.append({"cap": cap, **{k + "_ms": round(v * 1000, 3) for k, v in med.items()},
                     "parts_sum_ms": round(sum(med.values()) * 1000, 3), "pipelined_round_ms": round(round_s * 1000, 3),
                     "non_model_overhead_ms": round((round_s - model) * 1000, 3),
                     "non_model_share": round((round_s - model) / round_s, 3), "host_reads_per_round": (res.host_reads - 1) / res.num_rounds})
    result = {"shape": args.shape, "head_layers": args.head_layers, "block": args.block, "drafter_bits": args.drafter_bits,
              "context": args.context, "repeats": args.repeats, "dtype": str(dtype), "device": str(mx.default_device()),
              "plain_step_ms": round(plain_step * 1000, 3), "rows": rows}
    print(f"plain decode step (width 1): {plain_step * 1000:.2f} ms")
    print(f"{'cap':>3} {'draft':>7} {'verify':>7} {'acc/trim/app':>12} {'host':>6} {'sum':>7} {'round':>7} {'non-model':>9}")
    for r in rows:
        print(f"{r['cap']:3d} {r['draft_ms']:7.2f} {r['verify_ms']:7.2f} {r['accept_trim_append_ms']:12.2f} {r['host_ms']:6.3f} "
              f"{r['parts_sum_ms']:7.2f} {r['pipelined_round_ms']:7.2f} {100 * r['non_model_share']:8.1f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
