"""Teacher-forced accept length of one or more DSpark heads on rows the target wrote greedily.

    python benchmarks/block_accept.py --model MODEL --head A [--head B ...] --data ROWS.jsonl(.gz) \
        [--rows 400] [--answer-tokens N] [--first N ...] [--cap 7] [--drafter-bits 4] [--seed 0] [--cache-gb 4] \
        [--dtype float32 [--dequantize]] [--json OUT.json] [--anchors-out ANCHORS.jsonl.gz]
    python benchmarks/block_accept.py --model MODEL --head A --against-decode code,math [--limit 1] \
        [--max-new-tokens 64] [--dtype float32 [--dequantize]] [--rows-out ROWS.jsonl.gz]
    python benchmarks/block_accept.py --compare RUN_A/held.json RUN_B/held.json

At every answer position of each row (a distill data file's generated rows, or any JSONL of
{"ids", "prompt_len"} rows, "set" and "prompt_id" optional), the number of the head's drafts
greedy verification would accept there (dspark_lab/lab/block_accept.py: per anchor it is exactly
what `speculative_generate` accepts in a round starting there). Per head: the mean over all
anchors, per set and per draft position, with a 95% bootstrap interval over rows; with two or
more heads, each head's difference from the first, paired row by row on the same anchors (the
interval of a paired difference is narrow where the heads' per-row means move together).
Beside it, each head's mean on the decode's path along the rows ("path"): the rounds a greedy
decode would run there, so the number `speculative_generate` would report; lower than the mean
over every anchor, which weighs easy stretches more (a decode crosses them in few rounds).
`--answer-tokens N` measures each row's first N answer tokens only, to match an evaluation that
decodes N (the built-in sets' evaluation decodes 128: an answer's opening differs from its body);
`--first N` gives that cut beside the whole answers, from the same forwards (exactly equal).
On a Linux CPU, `--dtype float32 --dequantize --drafter-bits 16` with benchmarks/cpu_blas.sh's
library loaded runs the 1.5B at about 11 s a held-out row (MLX's 4-bit and bfloat16 CPU kernels
take minutes): the head's stored 4-bit values and the target's, as float32.
Rows must not be in the heads' training data: a distill run's rows are not held out, a later
round's generated rows are (e.g. `docs/results/held30_qwen15.jsonl.gz`, never trained on).
`--against-decode SETS` checks the measure on this machine instead: it decodes the first
`--limit` built-in prompts of each set with the first head and compares each round's accepted
drafts with the teacher-forced count at that round's anchor (equal, or parted at a near-tie).
`--compare A.json B.json` pairs the last head of one run's JSON with the last head of another's
(two device runs' `held.json`, each its kept head last) row by row, when both measured the same
rows at the same anchors: B's difference from A with its interval, no model loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from unanswered_prompts import read_jsonl  # noqa: E402


def bootstrap(values: np.ndarray, weights: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of sum(values) / sum(weights), resampling rows."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(n, len(values)))
    stats = values[idx].sum(axis=1) / np.maximum(weights[idx].sum(axis=1), 1)
    return float(np.quantile(stats, 0.025)), float(np.quantile(stats, 0.975))


def paired_difference(base: list, other: list, seed: int = 0) -> tuple[float, float, float]:
    """B - A in mean accept over the same anchors, and its 95% interval: `base` and `other` are
    [prompt_id, anchors, accepted] per row (a summary's "per_row"), in the same row order."""
    if [r[:2] for r in base] != [r[:2] for r in other]:
        raise SystemExit("the two heads were measured on different rows or anchors (other rows, or one drafts fewer "
                         "tokens than the cap): measure both on the same rows at a cap both reach")
    anchors = np.array([r[1] for r in base], dtype=float)
    delta = np.array([o[2] - b[2] for o, b in zip(other, base)], dtype=float)
    lo, hi = bootstrap(delta, anchors, seed=seed)
    return float(delta.sum() / max(anchors.sum(), 1)), lo, hi


def cast_head(drafter, dtype: str | None):
    """The head's float weights (a quantized head's scales too) in `dtype`, as --dtype casts the
    target's: on a CPU a bfloat16 head, not the target, would set the pace (MLX's CPU kernels
    call BLAS for float32 only). With --drafter-bits 16 a 4-bit head's stored values become
    plain float32 weights, exactly."""
    from dspark_lab.engine.loading import cast_floats

    if dtype is not None:
        cast_floats(drafter.head, dtype)
    return drafter


def summarize(per_row: list, cap: int) -> dict:
    from dspark_lab.lab.block_accept import mean_accept, path_mean_accept

    anchors = np.array([r.anchors for r in per_row], dtype=float)
    accepted = np.array([r.accepted for r in per_row], dtype=float)
    lo, hi = bootstrap(accepted, anchors)
    plo, phi = bootstrap(np.array([sum(r.path) for r in per_row], dtype=float), np.array([len(r.path) for r in per_row], dtype=float))
    sets = sorted({r.set for r in per_row})
    n = anchors.sum()
    return {"mean_accept": mean_accept(per_row), "ci": [1 + lo, 1 + hi], "anchors": int(n), "rows": len(per_row), "cap": cap,
            "per_position": [sum(r.through[j] for r in per_row) / n if n else None for j in range(cap)],
            "by_set": {s: mean_accept([r for r in per_row if r.set == s]) for s in sets},
            # on the decode's path along each row: what decoding the rows would report
            "path": {"mean_accept": path_mean_accept(per_row), "ci": [1 + plo, 1 + phi], "rounds": sum(len(r.path) for r in per_row),
                     "by_set": {s: path_mean_accept([r for r in per_row if r.set == s]) for s in sets}},
            # every row's anchors and accepted drafts, so any two heads measured on the same rows
            # (in this run or another) can be compared pair by pair later
            "per_row": [[r.prompt_id, r.anchors, r.accepted] for r in per_row]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--head", action="append", help="a DSpark head folder (repeat to compare)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"),
                    help="two earlier runs' JSON: the last head of B against the last head of A, paired")
    ap.add_argument("--data", type=Path, help="rows the target wrote greedily, not trained on")
    ap.add_argument("--against-decode", help="built-in prompt sets (code,math,chat) to decode and compare round by round")
    ap.add_argument("--limit", type=int, default=1, help="with --against-decode: prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="with --against-decode")
    ap.add_argument("--rows-out", type=Path, metavar="FILE.jsonl.gz",
                    help="with --against-decode: the decoded answers as rows (ids, prompt_len, set, prompt_id) for --data")
    ap.add_argument("--dtype", help="load the target in this dtype (float32: no bfloat16 ties; on a CPU the fast one)")
    ap.add_argument("--dequantize", action="store_true",
                    help="the target's quantized layers as plain ones holding the same weights: on a CPU, with --dtype float32 "
                         "and benchmarks/cpu_blas.sh's OpenBLAS, a 1.5B row's forward runs 25x faster than at 4 bits")
    ap.add_argument("--rows", type=int, default=400, help="rows drawn at random from the file (0: all)")
    ap.add_argument("--answer-tokens", type=int, default=0, help="measure each row's first N answer tokens only (0: all)")
    ap.add_argument("--first", type=int, action="append", default=[], metavar="N",
                    help="also each head's measure on every row's first N answer tokens (repeatable): from the same "
                         "forwards, exactly what --answer-tokens N gives, so a row's opening and its whole answer side by side")
    ap.add_argument("--cap", type=int, default=7)
    ap.add_argument("--drafter-bits", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-gb", type=float, default=4.0,
                    help="MLX's buffer cache limit: rows of every length leave freed buffers of every size, and "
                         "uncapped two runs on one GPU ran it out of memory (thirtieth round)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--anchors-out", type=Path, metavar="FILE.jsonl.gz",
                    help="every row's anchors per head (distance from the first answer token, accepted drafts) and its "
                         "decode path: for any later cut of the measure (by answer position, by token) without the model")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare, seed=a.seed)
    if not (a.model and a.head):
        ap.error("give --model and --head (or --compare A.json B.json)")
    if a.against_decode:
        return against_decode(a)
    if a.data is None:
        ap.error("give --data ROWS (rows to measure on) or --against-decode SETS (a check against decoding)")
    if not a.data.is_file():
        ap.error(f"--data {a.data}: no such file")
    rows = [r for r in read_jsonl(a.data) if "ids" in r and "prompt_len" in r]
    if not rows:
        ap.error(f"--data {a.data}: no rows with ids and prompt_len")
    if a.rows and a.rows < len(rows):
        rows = random.Random(a.seed).sample(rows, a.rows)
    if a.answer_tokens < 0:
        ap.error(f"--answer-tokens must be >= 0 (0: whole answers), got {a.answer_tokens}")
    if a.cache_gb <= 0:
        ap.error(f"--cache-gb must be > 0 (GB of freed buffers MLX may keep), got {a.cache_gb}")
    if any(n <= 0 for n in a.first):
        ap.error(f"--first takes a number of answer tokens > 0, got {min(a.first)}")
    if a.answer_tokens:
        rows = [dict(r, ids=r["ids"][: r["prompt_len"] + a.answer_tokens]) for r in rows]

    import mlx.core as mx
    from rich.progress import track

    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.loading import load_target
    from dspark_lab.lab.block_accept import row_accepts

    mx.set_cache_limit(int(a.cache_gb * (1 << 30)))
    target, _ = load_target(a.model, dtype=a.dtype, dequantize=a.dequantize)
    drafters = [cast_head(load_dspark(head, target, bits=a.drafter_bits), a.dtype) for head in a.head]
    # Rows outside, heads inside: the target's forward over a row serves every head.
    per_row_per_head = [row_accepts(target, drafters, r, a.cap, a.max_len) for r in track(rows, description="rows")]
    results = {}
    for i, (head, drafter) in enumerate(zip(a.head, drafters)):
        per_row = [measured[i] for measured in per_row_per_head]
        s = summarize(per_row, min(a.cap, drafter.config.max_drafts))
        results[head] = s
        sets = ", ".join(f"{k} {v:.3f}" for k, v in s["by_set"].items())
        print(f"{head}: mean accept {s['mean_accept']:.3f} [{s['ci'][0]:.3f}, {s['ci'][1]:.3f}] over {s['anchors']} anchors "
              f"in {s['rows']} rows ({sets}); accepted through draft position 1..: "
              + " ".join(f"{x:.2f}" for x in s["per_position"]), flush=True)
        print_path(head, s["path"])
        for n in a.first:
            cut = summarize([r.first(n) for r in per_row], s["cap"])
            del cut["per_row"]
            s.setdefault("first", {})[str(n)] = cut
            print_path(f"{head} (first {n} answer tokens)", cut["path"], f"; every anchor {cut['mean_accept']:.3f}")
    if a.anchors_out:
        import gzip

        with gzip.open(a.anchors_out, "wt") as f:
            for row, measured in zip(rows, per_row_per_head):
                for head, r in zip(a.head, measured):
                    f.write(json.dumps({"head": head, "prompt_id": r.prompt_id, "set": r.set, "prompt_len": row["prompt_len"],
                                        "offsets": r.offsets, "accepted": r.per_anchor, "path": r.path}) + "\n")
    diffs = {}
    for head in a.head[1:]:
        d, lo, hi = paired_difference(results[a.head[0]]["per_row"], results[head]["per_row"], seed=a.seed + 1)
        diffs[head] = {"minus": a.head[0], "difference": d, "ci": [lo, hi]}
        print(f"{head} - {a.head[0]}: {d:+.3f} [{lo:+.3f}, {hi:+.3f}] (paired over the same anchors)")
    out = {"model": a.model, "dtype": a.dtype, "dequantized": a.dequantize, "data": str(a.data), "rows": len(rows),
           "answer_tokens": a.answer_tokens or None, "cap": a.cap,
           "drafter_bits": a.drafter_bits, "heads": results, "differences": diffs}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


def print_path(label: str, path: dict, extra: str = "") -> None:
    print(f"{label}: on the decode's path {path['mean_accept']:.3f} [{path['ci'][0]:.3f}, {path['ci'][1]:.3f}] over "
          f"{path['rounds']} rounds (" + ", ".join(f"{k} {v:.3f}" for k, v in path["by_set"].items()) + f"){extra}", flush=True)


def compare(path_a: Path, path_b: Path, seed: int = 0) -> dict:
    runs = []
    for path in (path_a, path_b):
        if not path.is_file():
            raise SystemExit(f"--compare: {path}: no such file")
        heads = json.loads(path.read_text())["heads"]
        name = list(heads)[-1]
        runs.append((name, heads[name]))
    (name_a, a), (name_b, b) = runs
    d, lo, hi = paired_difference(a["per_row"], b["per_row"], seed=seed + 1)
    print(f"{name_b} ({path_b}) - {name_a} ({path_a}): {d:+.3f} [{lo:+.3f}, {hi:+.3f}] "
          f"(paired over {a['anchors']} anchors; {b['mean_accept']:.3f} against {a['mean_accept']:.3f})")
    return {"a": {"file": str(path_a), "head": name_a}, "b": {"file": str(path_b), "head": name_b},
            "difference": d, "ci": [lo, hi]}


def against_decode(a) -> dict:
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.loading import load_target
    from dspark_lab.lab.block_accept import decode_rounds
    from dspark_lab.lab.prompts import load_prompt_set

    target, tok = load_target(a.model, dtype=a.dtype, dequantize=a.dequantize)
    drafter = cast_head(load_dspark(a.head[0], target, bits=a.drafter_bits), a.dtype)
    checks, decoded = [], []
    for name in a.against_decode.split(","):
        for p in load_prompt_set(name).prompts[: a.limit]:
            rounds, counted, row = decode_rounds(target, tok, drafter, p.as_input(), a.cap, a.max_new_tokens)
            decoded.append(dict(row, set=name, prompt_id=p.id))
            checks.append({"prompt": p.id, "rounds": rounds, "teacher_forced": counted, "equal": rounds == counted})
            print(f"{p.id}: {len(rounds)} rounds, {'equal' if rounds == counted else 'parted'}: decode {rounds}, "
                  f"teacher-forced {counted}", flush=True)
    out = {"model": a.model, "head": a.head[0], "cap": a.cap, "dtype": a.dtype, "dequantized": a.dequantize, "checks": checks}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    if a.rows_out:  # the decoded answers as rows: measure them teacher-forced like any held-out rows (--data)
        import gzip

        with gzip.open(a.rows_out, "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in decoded)
    return out


if __name__ == "__main__":
    main()
