"""What a draft tree would accept where a chain accepts block_accept.py's count: the head's top
candidates at every draft position, teacher-forced on rows the target wrote greedily.

    python benchmarks/tree_accept.py measure --model MODEL --head HEAD --data ROWS.jsonl(.gz) --out RANKS.npz \
        [--rows 0] [--answer-tokens N] [--cap 7] [--top 8] [--dtype float32 --dequantize --drafter-bits 16]
    python benchmarks/tree_accept.py trees RANKS.npz [--shape-from OTHER.npz] [--budgets 7,16,32,64] [--json OUT] [--chart PNG]
    python benchmarks/tree_accept.py decode --model MODEL --head HEAD --data ROWS --nodes 16 [--ranks RANKS.npz] \
        [--lookup-drafts] [--limit N] [--cap 7] [--dtype float32 --dequantize --drafter-bits 16] [--json OUT]

A DSpark head without a Markov term (markov_rank 0) drafts its block's positions independently
of one another: position j's distribution does not depend on the tokens drafted before it. So a
tree of candidates costs nothing more to draft than the chain (the same head pass, its top-k
instead of its argmax per position), and greedy verification of a tree accepts the longest path
of it that is the target's greedy text. `measure` stores, per anchor and draft position, the rank
of the target's greedy token among the head's logits (capped at --top) and the head's top
log-probabilities; `trees` then counts, without the model:

- chain: the top-1 path (what speculative_generate accepts today; equals block_accept.py);
- static tree of B nodes: the B rank-paths (e.g. (0, 0, 1) = top-1, top-1, second) seen most
  often as prefixes of the greedy text's rank-paths, in --shape-from's rows (other rows than those
  measured: a shape a decoder would ship) or, without it, in the measured rows themselves
  (an optimistic bound: the shape fitted to its test);
- dynamic tree of B nodes: per anchor the B paths the head itself thinks likeliest (the product
  of its per-position probabilities; EAGLE-2's rule), no shape fitted to any rows: what
  `speculative_generate(..., tree_nodes=B)` drafts (engine/tree.best_paths).

`decode` checks the count against the engine: it decodes each row's prompt with
`speculative_generate(..., tree_nodes=N)`, checks the output is the row's answer token for token
(rows the target wrote greedily on this machine in this dtype, e.g. block_accept.py
--against-decode's --rows-out), and, given `measure`'s file of the same rows, compares every
round's accepted drafts with the teacher-forced count at that round's anchor.

Each is reported over every anchor and on the decode's path (lab/block_accept.decode_path: the
rounds a decode would run, so the mean accept length a decode would report). A tree of B nodes
verifies B + 1 positions a round where the chain verifies cap + 1: what that costs is the
machine's cost curve (dspark-lab calibrate), not counted here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from unanswered_prompts import read_jsonl  # noqa: E402


def measure(a) -> None:
    import mlx.core as mx
    from rich.progress import track

    from block_accept import cast_head
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.loading import load_target
    from dspark_lab.lab.block_accept import on_path_anchors
    from dspark_lab.engine.topk import top_k_logprobs
    from dspark_lab.engine.tree import check_tree_head
    from dspark_lab.errors import InputError
    from dspark_lab.lab.distill import _block_forward

    rows = [r for r in read_jsonl(a.data) if "ids" in r and "prompt_len" in r]
    if a.rows and a.rows < len(rows):
        rows = random.Random(a.seed).sample(rows, a.rows)
    if a.answer_tokens:
        rows = [dict(r, ids=r["ids"][: r["prompt_len"] + a.answer_tokens]) for r in rows]
    mx.set_cache_limit(4 << 30)
    target, _ = load_target(a.model, dtype=a.dtype, dequantize=a.dequantize)
    drafter = cast_head(load_dspark(a.head, target, bits=a.drafter_bits), a.dtype)
    c = drafter.config
    try:
        check_tree_head(drafter)
    except InputError as e:
        sys.exit(str(e))
    if c.draft_vocab_size:
        sys.exit("a head with a reduced draft vocabulary: not supported here")
    cap = min(a.cap, c.max_drafts)
    ranks, logps, top_ids, row_of, offsets, sets = [], [], [], [], [], []
    for n, row in enumerate(track(rows, description="rows")):
        ids = list(row["ids"])[-a.max_len:]
        start = max(1, row["prompt_len"] - (len(row["ids"]) - len(ids)))
        x = mx.array([ids], dtype=mx.uint32)
        taps, labels = target.taps_and_predictions(x, c.target_layer_ids)
        anchors = on_path_anchors(ids, labels[0].tolist(), start, cap)
        sets.append(str(row.get("set", "")))  # one per row, anchors or not: `row` numbers index it
        if not anchors:
            continue
        ctx = drafter.fuse(taps)
        for i in range(0, len(anchors), 128):
            part = mx.array([anchors[i : i + 128]], dtype=mx.int32)
            h = _block_forward(drafter.head, c, drafter.embed, ctx, x, part)[0, :, c.logits_start : c.logits_start + cap]
            logits = drafter.vocab_logits(h).astype(mx.float32)  # (A, cap, V)
            want = labels[0][part[0][:, None] + mx.arange(cap)]  # (A, cap) the target's greedy tokens
            want_logit = mx.take_along_axis(logits, want[..., None].astype(mx.int32), axis=-1)
            rank = mx.minimum((logits > want_logit).sum(axis=-1), a.top)  # ties with the label count for it
            top, logp = top_k_logprobs(logits, a.top)  # what DSparkDrafter.draft_top gives a tree round
            mx.eval(rank, top, logp)
            ranks.append(np.array(rank, dtype=np.int8))
            top_ids.append(np.array(top, dtype=np.int32))
            logps.append(np.array(logp, dtype=np.float32))
            row_of += [n] * part.shape[1]
            offsets += [an - start for an in anchors[i : i + 128]]
    np.savez_compressed(a.out, rank=np.concatenate(ranks), logp=np.concatenate(logps), top=np.concatenate(top_ids),
                        row=np.array(row_of), offset=np.array(offsets), sets=np.array(sets), cap=cap, top_k=a.top)
    print(f"{a.out}: {len(row_of)} anchors in {len(sets)} rows, cap {cap}, top {a.top}")


def prefix_counts(rank: np.ndarray, top_k: int) -> Counter:
    """How often each rank-path is a prefix of an anchor's greedy rank-path (paths through a rank
    >= top_k stop there: the head's top-k never holds that token)."""
    counts: Counter = Counter()
    for r in rank:
        path = ()
        for x in r:
            if x >= top_k:
                break
            path += (int(x),)
            counts[path] += 1
    return counts


def static_tree(counts: Counter, budget: int) -> set:
    """The budget most frequent rank-paths whose parents are in too (frequency falls along a path,
    so the most frequent nodes already form a tree; the check keeps ties honest)."""
    tree: set = set()
    for path, _ in sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0])):
        if len(tree) == budget:
            break
        if len(path) == 1 or path[:-1] in tree:
            tree.add(path)
    return tree


def accepted_static(rank: np.ndarray, tree: set, top_k: int) -> np.ndarray:
    out = np.zeros(len(rank), dtype=np.int64)
    for i, r in enumerate(rank):
        path, n = (), 0
        for x in r:
            path += (int(x),)
            if x >= top_k or path not in tree:
                break
            n += 1
        out[i] = n
    return out


def path_mean(row: np.ndarray, offset: np.ndarray, accepted: np.ndarray) -> tuple[float, int]:
    from dspark_lab.lab.block_accept import decode_path

    total, rounds = 0, 0
    for n in np.unique(row):
        sel = row == n
        order = np.argsort(offset[sel])
        path = decode_path(offset[sel][order].tolist(), accepted[sel][order].tolist())
        total += sum(path)
        rounds += len(path)
    return 1 + total / max(rounds, 1), rounds


def trees(a) -> dict:
    d = np.load(a.ranks)
    rank, logp, row, offset, sets, top_k = d["rank"], d["logp"], d["row"], d["offset"], d["sets"], int(d["top_k"])
    shape_rank = np.load(a.shape_from)["rank"] if a.shape_from else rank
    counts = prefix_counts(shape_rank, top_k)
    budgets = [int(b) for b in a.budgets.split(",")]
    by_set = {s: np.isin(row, np.flatnonzero(sets == s)) for s in sorted(set(sets.tolist()))}
    results = {}

    def report(name: str, acc: np.ndarray) -> None:
        entry = {"every_anchor": 1 + acc.mean(), "path": path_mean(row, offset, acc)[0], "by_set": {}}
        for s, sel in by_set.items():
            entry["by_set"][s or "-"] = {"every_anchor": 1 + acc[sel].mean(), "path": path_mean(row[sel], offset[sel], acc[sel])[0]}
        results[name] = entry
        sets_txt = "  ".join(f"{s} {v['path']:.3f}" for s, v in entry["by_set"].items())
        print(f"{name:<22} every anchor {entry['every_anchor']:.3f}  decode path {entry['path']:.3f}   {sets_txt}", flush=True)

    chain = np.cumprod(rank == 0, axis=1).sum(axis=1)
    report("chain (top-1)", chain)
    for b in budgets:
        report(f"static tree {b}", accepted_static(rank, static_tree(counts, b), top_k))
    from dspark_lab.engine.tree import best_paths

    for b in budgets:  # the rule engine/tree.py drafts by
        acc = np.array([accepted_static(rank[i : i + 1], set(best_paths(logp[i], b)), top_k)[0] for i in range(len(rank))])
        report(f"dynamic tree {b}", acc)
    if a.json:
        a.json.write_text(json.dumps({"ranks": str(a.ranks), "shape_from": str(a.shape_from) if a.shape_from else None,
                                      "anchors": int(len(rank)), "results": results}, indent=2))
    if a.chart:
        from dspark_lab.reports.charts import save_chart

        save_chart(chart(results, a.title or f"{a.ranks.stem}: accept length against tree size (dashed: issue #9's goals)"), a.chart)
        print(f"chart -> {a.chart}")
    return results


GOALS = {"code": 3.0, "math": 3.0, "chat": 2.0}  # issue #9, the Qwen heads at cap 7


def chart(results: dict, title: str):
    """Accept length on the decode's path against drafts per round, a line per prompt set and tree
    kind (the chain at 1 draft per position: its cap's worth of nodes, drawn at x = 7 or the cap)."""
    import altair as alt

    rows = []
    for name, entry in results.items():
        kind, _, size = name.rpartition(" ")
        nodes, kind = (int(size), kind) if size.isdigit() else (7, "chain")
        for s, v in entry["by_set"].items():
            rows.append({"set": s.rsplit("/", 1)[-1].removesuffix(".jsonl.gz"), "tree": kind, "nodes": nodes, "accept": round(v["path"], 3)})
    lines = alt.Chart(alt.Data(values=rows)).mark_line(point=True).encode(
        x=alt.X("nodes:Q", scale=alt.Scale(type="log", base=2), title="drafts verified a round (log scale)"),
        y=alt.Y("accept:Q", title="mean accept length, decode's path", scale=alt.Scale(zero=False)),
        color=alt.Color("set:N", title="prompt set"), strokeDash=alt.StrokeDash("tree:N", title="drafts"),
        tooltip=["set:N", "tree:N", "nodes:Q", "accept:Q"])
    goals = [{"set": s, "goal": g} for s, g in GOALS.items() if any(r["set"] == s for r in rows)]
    rules = alt.Chart(alt.Data(values=goals)).mark_rule(strokeDash=[2, 3], color="gray").encode(y="goal:Q")
    return alt.layer(lines, rules).properties(title=title, width=460, height=280)


def decode(a) -> dict:
    from dspark_lab import speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.loading import load_target
    from dspark_lab.engine.tree import best_paths
    from dspark_lab.lab.block_accept import decode_path

    from block_accept import cast_head

    rows = [r for r in read_jsonl(a.data) if "ids" in r and "prompt_len" in r][: a.limit or None]
    target, tok = load_target(a.model, dtype=a.dtype, dequantize=a.dequantize)
    drafter = cast_head(load_dspark(a.head, target, bits=a.drafter_bits), a.dtype)
    tf = np.load(a.ranks) if a.ranks else None
    out, by_set = [], {}
    for n, row in enumerate(rows):
        prompt, want = row["ids"][: row["prompt_len"]], row["ids"][row["prompt_len"] :]
        r = speculative_generate(target, tok, drafter, prompt, max_new_tokens=len(want), max_draft_tokens=a.cap,
                                 tree_nodes=a.nodes, lookup_drafts=a.lookup_drafts)
        rounds = [x - 1 for x in r.accept_lengths]
        entry = {"prompt_id": row.get("prompt_id"), "set": row.get("set", ""), "same_tokens": r.token_ids == want[: len(r.token_ids)],
                 "tokens": r.num_tokens, "rounds": rounds, "mean_accept": r.mean_accept_len}
        if tf is not None and a.nodes and not a.lookup_drafts:  # (the teacher-forced count is the head's tree alone)
            sel = tf["row"] == n
            order = np.argsort(tf["offset"][sel])
            offs, logp, rank = tf["offset"][sel][order], tf["logp"][sel][order], tf["rank"][sel][order]
            acc = [accepted_static(rank[i : i + 1], set(best_paths(logp[i], a.nodes)), int(tf["top_k"]))[0] for i in range(len(offs))]
            entry["teacher_forced"] = decode_path(offs.tolist(), [int(x) for x in acc])
            # the teacher-forced path ends where an anchor's drafts would run past the row (the decode's
            # last rounds draft shallower there): compare the rounds it has
            entry["equal"] = entry["teacher_forced"] == rounds[: len(entry["teacher_forced"])]
        out.append(entry)
        s = by_set.setdefault(entry["set"], [0, 0])
        s[0] += sum(r.accept_lengths)
        s[1] += len(r.accept_lengths)
        print(f"{entry['prompt_id']}: {len(rounds)} rounds, mean accept {r.mean_accept_len:.3f}, "
              f"{'the greedy tokens' if entry['same_tokens'] else 'NOT the greedy tokens'}"
              + ("" if "equal" not in entry else f", teacher-forced {'equal' if entry['equal'] else 'parted'}"), flush=True)
    means = {k: v[0] / v[1] for k, v in by_set.items()}
    print("mean accept by set (over rounds): " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()))
    result = {"model": a.model, "head": a.head, "nodes": a.nodes, "lookup_drafts": a.lookup_drafts, "cap": a.cap, "dtype": a.dtype, "rows": out, "by_set": means}
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="the head's ranks of the greedy tokens, per anchor and position")
    m.add_argument("--model", required=True)
    m.add_argument("--head", required=True)
    m.add_argument("--data", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--rows", type=int, default=0)
    m.add_argument("--answer-tokens", type=int, default=0)
    m.add_argument("--cap", type=int, default=7)
    m.add_argument("--top", type=int, default=8)
    m.add_argument("--max-len", type=int, default=1024)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype")
    m.add_argument("--dequantize", action="store_true")
    m.add_argument("--drafter-bits", type=int, default=4)
    t = sub.add_parser("trees", help="chain, static and dynamic trees' accept lengths from measure's file")
    t.add_argument("ranks", type=Path)
    t.add_argument("--shape-from", type=Path)
    t.add_argument("--budgets", default="7,16,32,64")
    t.add_argument("--json", type=Path)
    t.add_argument("--chart", type=Path, help="accept length against tree size per set (.png, or .html / .json)")
    t.add_argument("--title", default="")
    d = sub.add_parser("decode", help="decode rows' prompts with tree drafts; check tokens and rounds")
    d.add_argument("--model", required=True)
    d.add_argument("--head", required=True)
    d.add_argument("--data", type=Path, required=True)
    d.add_argument("--nodes", type=int, default=16, help="the tree's size (0: the chain, for a side-by-side count)")
    d.add_argument("--lookup-drafts", action="store_true", help="graft a long n-gram match's continuation onto each tree (the chain: verify it instead)")
    d.add_argument("--ranks", type=Path, help="measure's file of the same rows: compare each round with it")
    d.add_argument("--limit", type=int, default=0)
    d.add_argument("--cap", type=int, default=7)
    d.add_argument("--dtype")
    d.add_argument("--dequantize", action="store_true")
    d.add_argument("--drafter-bits", type=int, default=4)
    d.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    {"measure": measure, "trees": trees, "decode": decode}[a.cmd](a)


if __name__ == "__main__":
    main()
