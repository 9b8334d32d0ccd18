"""Our DSpark against the peer engine mlx-dspark, on the same target and the same head, in one
process and one warm state.

    python benchmarks/peer_vs_ours.py --model DIR --drafter HEAD_DIR [--prompts code,math,chat]
        [--max-new-tokens 256] [--caps 2,4,7] [--repeats 3] [--draft-model DIR] [--json OUT]

Arms, per prompt (every arm gets the same prompt token ids):
  mlx_lm        mlx-lm's stream_generate, plain greedy
  greedy        our greedy_generate (the reference output)
  ours@k        our speculative_generate with the DSpark head, lookup drafts off, cap k
  peer@k        mlx_dspark.speculative_generate on the same head, lookup drafts off, cap k
  mlxlm_draft@k mlx-lm's draft-model speculative decoding (only with --draft-model)
  ours_draft@k  our draft-model mode on the same small model (only with --draft-model)
  ours_draft_pipe@k  the same through our pipelined loop (draft-pipe; plain-KV models only)
  ours_draft_pipe_attn@k  draft-pipe with the draft model's one-row steps' attention through
                engine/attention_kernel.py (only with --attention-kernel; off CUDA its float32
                reference stands in): MLX's one-row attention over a masked buffer is its unfused
                fallback, 4.2x slower than the kernel on an H100 (docs/performance.md, 39th round)

Every arm runs once untimed first (kernel compiles; NVRTC on CUDA), then `--repeats` timed
passes with the arms interleaved so drift hits them alike; the median is reported.
Rate = decode tok/s = tokens after the first / seconds after the first token, for every arm
(the peer's own figure counts the first token too; we recompute it from its fields).

Output identity: each arm's tokens against our greedy's (EOS removed everywhere); `mismatches`
counts positions that differ plus any length difference.

Bandwidth limit: bytes per token = the target's weight bytes + its KV bytes at the mean context
(prompt + half the generated tokens); a device copy of a large array gives the bandwidth
(read + write bytes / time); limit tok/s = bandwidth / bytes per token. Each arm's fraction is
its tok/s over that limit (for speculative arms an "effective" fraction: above 1 means more
tokens than one weight pass per token could give).

The peer is optional: when it cannot be imported or fails to run, its arms record the reason
and the rest of the benchmark goes on.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

# Benchmark the checkout this file lives in, not whatever dspark_lab is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from dspark_lab.lab.bandwidth import copy_bandwidth, decode_bytes, limit_tokens_per_second  # noqa: E402

PROMPTS = {
    "code": "Write a Python function that checks whether a string is a palindrome, with a docstring and three doctest examples.",
    "chat": "What are three good habits for getting better sleep? Explain each one in two sentences.",
    "math": "A train travels 180 km in 2.5 hours. What is its average speed in km/h and in m/s? Show your steps.",
    "copy": "Rewrite this code with type hints and keep everything else unchanged:\n\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\ndef sub(a, b):\n    return a - b\n",
}


class Run:
    """One timed generation: tokens (EOS removed), decode tok/s, wall seconds, accept length."""

    def __init__(self, tokens, tok_s, wall_s, accept=None, max_tokens=None):
        # An engine may commit past max_new_tokens in its last round (mlx-dspark 0.20.3 does, by
        # one token): identity is judged on the first max_tokens, the rate on all it produced.
        self.overshoot = max(0, len(tokens) - max_tokens) if max_tokens else 0
        self.tokens = tokens[:max_tokens] if max_tokens else tokens
        self.tok_s, self.wall_s, self.accept = tok_s, wall_s, accept


def _strip_eos(tokens, eos):
    return [int(t) for t in tokens if int(t) not in eos]


def _decode_rate(n_tokens, seconds_after_first):
    return (n_tokens - 1) / seconds_after_first if n_tokens > 1 and seconds_after_first > 0 else 0.0


# ---- arms -------------------------------------------------------------------------------------


def mlx_lm_arm(model, tokenizer, ids, max_tokens, eos, draft_model=None, k=None):
    from mlx_lm.generate import stream_generate

    from dspark_lab.engine.fused import as_stored

    kw = {"draft_model": draft_model, "num_draft_tokens": k} if draft_model is not None else {}
    start = time.perf_counter()
    first = None
    tokens = []
    with as_stored(model):  # mlx-lm's model as mlx-lm loads it: each projection its own layer
        for resp in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, **kw):
            if first is None:
                first = time.perf_counter()
            tokens.append(resp.token)
    end = time.perf_counter()
    tokens = _strip_eos(tokens, eos)
    return Run(tokens, _decode_rate(len(tokens), end - first) if first else 0.0, end - start)


def our_greedy_arm(target, tokenizer, ids, max_tokens, eos):
    from dspark_lab import greedy_generate

    t = time.perf_counter()
    r = greedy_generate(target, tokenizer, ids, max_new_tokens=max_tokens)
    return Run(_strip_eos(r.token_ids, eos), r.decode_tokens_per_sec, time.perf_counter() - t)


def our_draft_model_arm(target, tokenizer, draft, ids, max_tokens, cap, eos, pipeline=False):
    from dspark_lab import draft_model_generate

    t = time.perf_counter()
    r = draft_model_generate(target, tokenizer, draft, ids, max_new_tokens=max_tokens, max_draft_tokens=cap, pipeline=pipeline)
    return Run(_strip_eos(r.token_ids, eos), r.decode_tokens_per_sec, time.perf_counter() - t, r.mean_accept_len)


def our_spec_arm(target, tokenizer, head, ids, max_tokens, cap, eos):
    from dspark_lab import speculative_generate

    t = time.perf_counter()
    r = speculative_generate(target, tokenizer, head, ids, max_new_tokens=max_tokens, max_draft_tokens=cap,
                             lookup_drafts=False)
    return Run(_strip_eos(r.token_ids, eos), r.decode_tokens_per_sec, time.perf_counter() - t, r.mean_accept_len)


class Peer:
    """mlx-dspark through its Python API. By default its Target wraps our already-loaded mlx-lm
    model (the same weights in memory); `own_target` loads the target with its own loader
    instead. Its own loader reads the head (4-bit, group 64 by default: as ours does)."""

    def __init__(self, model, tokenizer, head_dir, bits, model_dir=None, own_target=False):
        import mlx_dspark
        from mlx_dspark.load import load_drafter, load_target
        from mlx_dspark.target import Target as PeerTarget

        self.version = getattr(mlx_dspark, "__version__", "?")
        self.generate = mlx_dspark.speculative_generate
        if own_target:
            self.target, tokenizer = load_target(str(model_dir), require_tap=True)
            self.setup = "target: mlx_dspark.load.load_target(require_tap=True), its own copy"
        else:
            self.target = PeerTarget(model, tokenizer)
            self.target.verify_tap()  # the peer's own check that its tap reproduces the model's forward
            self.setup = "target: mlx_dspark.target.Target over our loaded mlx-lm model (shared weights), verify_tap passed"
        self.setup += f"; head: mlx_dspark.load.load_drafter({'bits=%d' % bits if bits < 16 else 'quantize=False'})"
        self.drafter, self.config = load_drafter(str(head_dir), quantize=bits < 16, bits=min(bits, 8))
        self.tokenizer = tokenizer
        self.max_draft = int(getattr(self.drafter, "max_draft", self.config.block_size))

    def arm(self, ids, max_tokens, cap, eos):
        t = time.perf_counter()
        r = self.generate(self.target, self.tokenizer, self.drafter, prompt_ids=list(ids), max_new_tokens=max_tokens,
                          max_draft_tokens=cap, lookup_drafts=False, confidence_threshold=0.0, temperature=0.0)
        wall = time.perf_counter() - t
        decode_s = r.seconds - r.prefill_seconds if r.prefill_seconds else r.seconds
        # Its mean_accept_len counts the prefill's token over the rounds; ours is the mean of the
        # per-round commits, which its accept_lengths also hold.
        accept = statistics.mean(r.accept_lengths) if r.accept_lengths else None
        return Run(_strip_eos(r.token_ids, eos), _decode_rate(r.num_tokens, decode_s), wall, accept, max_tokens)


def load_peer(model, tokenizer, head_dir, bits, model_dir=None, own_target=False):
    """(Peer or None, reason string or None)."""
    try:
        import mlx_dspark  # noqa: F401
    except ImportError as e:
        return None, f"not installed: {e}"
    except Exception as e:  # noqa: BLE001 - an import that crashes is a finding, not a failure
        return None, f"import failed: {type(e).__name__}: {e}"
    try:
        return Peer(model, tokenizer, head_dir, bits, model_dir, own_target), None
    except Exception as e:  # noqa: BLE001
        return None, f"load failed: {type(e).__name__}: {e}"


# ---- main --------------------------------------------------------------------------------------


def mismatches(ref, out):
    return sum(1 for a, b in zip(ref, out) if a != b) + abs(len(ref) - len(out))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target model directory (or repo already on disk)")
    ap.add_argument("--drafter", help="DSpark head directory (DeepSpec-native layout)")
    ap.add_argument("--prompts", default="code,math,chat", help=f"comma list from {','.join(PROMPTS)}")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--caps", default="2,4,7", help="draft caps (max_draft_tokens) for ours and the peer")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per arm and prompt (median reported)")
    ap.add_argument("--peer-caps", help="caps for the peer's arms (default: --caps); the peer is slow, so fewer saves time")
    ap.add_argument("--drafter-bits", type=int, default=4, help="head weight bits, both engines (16 = unquantized)")
    ap.add_argument("--draft-model", help="small model for mlx-lm's own draft-model speculative decoding")
    ap.add_argument("--attention-kernel", action="store_true",
                    help="with --draft-model: add ours_draft_pipe_attn@k (the draft model's one-row attention through the kernel)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="array size for the bandwidth measurement")
    ap.add_argument("--no-peer", action="store_true", help="skip the peer arms (recorded as skipped)")
    ap.add_argument("--peer-own-target", action="store_true",
                    help="let the peer load the target with its own loader (a second copy) instead of sharing ours")
    ap.add_argument("--json", help="write the full result here")
    ap.add_argument("--smoke", action="store_true",
                    help="self-check on a tiny random target and head built in a temp dir (any device): one prompt, "
                         "8 tokens, cap 2, unquantized head, small bandwidth array; --model/--drafter not needed")
    args = ap.parse_args(argv)
    if not args.smoke and not (args.model and args.drafter):
        ap.error("--model and --drafter are required (or --smoke)")
    return args


def build_smoke_pair(root) -> tuple[str, str]:
    """A tiny random qwen3 target and a DeepSpec-native DSpark head for it, under `root`."""
    from pathlib import Path

    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    target = build_tiny_model(Path(root) / "target", "qwen3", seed=0)
    head = build_tiny_dspark(Path(root) / "head", target)
    return str(target), str(head)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            args.model, args.drafter = build_smoke_pair(tmp)
            args.prompts, args.max_new_tokens, args.caps, args.repeats = "code", 8, "2", 1
            # The tiny head's Markov rank (16) is below the 64-wide quantization group, which
            # the peer's loader cannot quantize: run both engines unquantized.
            args.drafter_bits, args.copy_mib = 16, 16
            return run(args)
    return run(args)


def run(args) -> dict:
    from mlx_lm import load as mlx_lm_load

    from dspark_lab import load_pair
    from dspark_lab.engine.text import encode_prompt

    caps = [int(c) for c in args.caps.split(",") if c.strip()]
    peer_caps = [int(c) for c in (args.peer_caps or args.caps).split(",") if c.strip()]
    names = [p.strip() for p in args.prompts.split(",") if p.strip()]
    unknown = [p for p in names if p not in PROMPTS]
    if unknown:
        raise SystemExit(f"unknown prompts {unknown}; choose from {','.join(PROMPTS)}")

    t_load = time.perf_counter()
    target, tok, head, _pair = load_pair(args.model, args.drafter, drafter_bits=args.drafter_bits)
    eos = {int(t) for t in getattr(tok, "eos_token_ids", None) or []}
    max_caps = int(head.config.max_drafts)
    draft_model = mlx_lm_load(args.draft_model)[0] if args.draft_model else None
    if args.draft_model:  # ours in draft-model mode, on the same small model (its own copy, loaded our way)
        from dspark_lab import load_target

        our_draft = load_target(args.draft_model)[0]
        if args.attention_kernel:
            from dspark_lab.engine import attention_kernel
            from dspark_lab.engine.kernels import cuda_available

            our_draft_attn = load_target(args.draft_model)[0]  # its own copy: the plain draft-pipe arm stays MLX's
            our_draft_attn.route_attention(attention_kernel.rows_attention() if cuda_available()
                                           else attention_kernel.reference_rows_attention)
    peer, peer_error = (None, "skipped (--no-peer)") if args.no_peer else load_peer(
        target.model, tok, args.drafter, args.drafter_bits, args.model, args.peer_own_target)
    load_s = time.perf_counter() - t_load

    arms = {
        "mlx_lm": lambda ids: mlx_lm_arm(target.model, tok, ids, args.max_new_tokens, eos),
        "greedy": lambda ids: our_greedy_arm(target, tok, ids, args.max_new_tokens, eos),
    }
    skipped = {}
    for k in caps:
        if k > max_caps:
            skipped[f"ours@{k}"] = f"cap {k} > this head's max drafts {max_caps}"
        else:
            arms[f"ours@{k}"] = lambda ids, k=k: our_spec_arm(target, tok, head, ids, args.max_new_tokens, k, eos)
        if peer is None:
            skipped[f"peer@{k}"] = peer_error
        elif k not in peer_caps:
            skipped[f"peer@{k}"] = "not in --peer-caps"
        elif k > peer.max_draft:
            skipped[f"peer@{k}"] = f"cap {k} > the peer's max draft {peer.max_draft} for this head"
        else:
            arms[f"peer@{k}"] = lambda ids, k=k: peer.arm(ids, args.max_new_tokens, k, eos)
        if draft_model is not None:
            arms[f"mlxlm_draft@{k}"] = lambda ids, k=k: mlx_lm_arm(target.model, tok, ids, args.max_new_tokens, eos,
                                                                  draft_model, k)
            arms[f"ours_draft@{k}"] = lambda ids, k=k: our_draft_model_arm(target, tok, our_draft, ids, args.max_new_tokens, k, eos)
            arms[f"ours_draft_pipe@{k}"] = lambda ids, k=k: our_draft_model_arm(target, tok, our_draft, ids, args.max_new_tokens, k, eos,
                                                                                pipeline=True)
            if args.attention_kernel:
                arms[f"ours_draft_pipe_attn@{k}"] = lambda ids, k=k: our_draft_model_arm(
                    target, tok, our_draft_attn, ids, args.max_new_tokens, k, eos, pipeline=True)

    encoded = {p: encode_prompt(tok, PROMPTS[p]) for p in names}
    errors = dict(skipped)

    def call(name, ids):
        """Run one arm; an arm that raises is recorded and dropped (the peer may fail on CUDA)."""
        try:
            return arms[name](ids)
        except Exception as e:  # noqa: BLE001
            errors[name] = f"run failed: {type(e).__name__}: {e}"
            errors[name + ":traceback"] = traceback.format_exc(limit=6)
            if name in ("greedy",):
                raise
            return None

    # Warm-up: every arm on every prompt once, untimed.
    t0 = time.perf_counter()
    for ids in encoded.values():
        for name in list(arms):
            if call(name, ids) is None:
                arms.pop(name, None)
    warmup_s = time.perf_counter() - t0

    rows = []
    for pname, ids in encoded.items():
        runs = {a: [] for a in arms}
        for _ in range(args.repeats):
            for a in list(arms):
                r = call(a, ids)
                if r is None:
                    arms.pop(a)
                    runs.pop(a, None)
                else:
                    runs[a].append(r)
        ref = runs["greedy"][-1].tokens
        row = {"prompt": pname, "prompt_tokens": len(ids), "tokens": len(ref), "arms": {}}
        for a, rs in runs.items():
            if not rs:
                continue
            last = rs[-1]
            row["arms"][a] = {
                "tok_s": round(statistics.median(r.tok_s for r in rs), 2),
                "spread": round(max(r.tok_s for r in rs) - min(r.tok_s for r in rs), 2),
                "wall_s": round(statistics.median(r.wall_s for r in rs), 4),
                "mean_accept": round(last.accept, 3) if last.accept is not None else None,
                "tokens": len(last.tokens),
                "identical_to_greedy": last.tokens == ref,
                "mismatches": mismatches(ref, last.tokens),
                "consistent_across_repeats": all(r.tokens == last.tokens for r in rs),
                "overshoot_tokens": last.overshoot,
            }
        rows.append(row)

    # Bandwidth limit.
    weight_bytes, kv_per_pos = decode_bytes(target)
    bandwidth = copy_bandwidth(args.copy_mib)
    for row in rows:
        ctx = row["prompt_tokens"] + row["tokens"] / 2
        limit = limit_tokens_per_second(bandwidth, weight_bytes, kv_per_pos, ctx)
        row["bytes_per_token"] = int(weight_bytes + kv_per_pos * ctx)
        row["limit_tok_s"] = round(limit, 2)
        g = row["arms"]["greedy"]["tok_s"]
        best_peer = max((v["tok_s"] for a, v in row["arms"].items() if a.startswith("peer@")), default=None)
        for a, v in row["arms"].items():
            v["fraction_of_limit"] = round(v["tok_s"] / limit, 4) if limit else None
            v["vs_greedy"] = round(v["tok_s"] / g, 3) if g else None
            v["vs_best_peer"] = round(v["tok_s"] / best_peer, 3) if best_peer else None
        for k in caps:
            o, p = row["arms"].get(f"ours@{k}"), row["arms"].get(f"peer@{k}")
            if o and p and p["tok_s"]:
                row[f"ours_vs_peer@{k}"] = round(o["tok_s"] / p["tok_s"], 3)

    total_mismatched = sum(1 for r in rows for v in r["arms"].values() if not v["identical_to_greedy"])
    result = {
        "model": args.model, "drafter": args.drafter, "draft_model": args.draft_model,
        "max_new_tokens": args.max_new_tokens, "caps": caps, "repeats": args.repeats, "drafter_bits": args.drafter_bits,
        "device": str(mx.default_device()), "device_info": _device_info(), "platform": platform.platform(),
        "mlx": mx.__version__, "mlx_lm": _version("mlx_lm"), "peer_version": peer.version if peer else None,
        "peer_error": peer_error,
        "peer_setup": peer.setup if peer else None, "arm_errors": errors, "load_seconds": round(load_s, 1),
        "warmup_seconds": round(warmup_s, 1), "weight_bytes": int(weight_bytes), "kv_bytes_per_position": int(kv_per_pos),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2), "copy_mib": args.copy_mib,
        "arms_not_identical": total_mismatched, "rows": rows,
    }
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_table(result):
    print(f"device {result['device']}  mlx {result['mlx']}  mlx-lm {result['mlx_lm']}  peer {result['peer_version'] or '-'}"
          f"  copy bandwidth {result['copy_bandwidth_gb_s']} GB/s")
    if result["peer_error"]:
        print(f"peer: {result['peer_error']}")
    for name, why in result["arm_errors"].items():
        if not name.endswith(":traceback") and not name.startswith("peer@"):
            print(f"{name}: {why}")
        elif name.startswith("peer@") and why != result["peer_error"]:
            print(f"{name}: {why}")
    for row in result["rows"]:
        print(f"\n[{row['prompt']}] prompt {row['prompt_tokens']} tok, {row['tokens']} generated, "
              f"limit {row['limit_tok_s']} tok/s")
        print(f"  {'arm':16} {'tok/s':>9} {'x greedy':>9} {'x peer':>7} {'accept':>7} {'of limit':>8} same (mism)")
        for a, v in row["arms"].items():
            acc = f"{v['mean_accept']:.2f}" if v["mean_accept"] is not None else "-"
            vp = f"{v['vs_best_peer']:.3f}" if v["vs_best_peer"] is not None else "-"
            print(f"  {a:16} {v['tok_s']:9.1f} {v['vs_greedy']:9.3f} {vp:>7} {acc:>7} {v['fraction_of_limit']:8.3f} "
                  f"{v['identical_to_greedy']} ({v['mismatches']})"
                  + (f" +{v['overshoot_tokens']} past max" if v["overshoot_tokens"] else ""))
        for k in result["caps"]:
            if f"ours_vs_peer@{k}" in row:
                print(f"  ours/peer at cap {k}: {row[f'ours_vs_peer@{k}']:.3f}")
    print(f"\narms not token-identical to our greedy: {result['arms_not_identical']}")


def _version(mod):
    try:
        from importlib.metadata import version

        return version(mod.replace("_", "-"))
    except Exception:  # noqa: BLE001
        return None


def _device_info() -> dict:
    try:
        return {k: str(v) for k, v in mx.device_info().items()}
    except Exception:  # noqa: BLE001 - older mlx, or a backend without it
        return {}


if __name__ == "__main__":
    main()
