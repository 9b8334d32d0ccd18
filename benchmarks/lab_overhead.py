"""Does the lab's sweep slow plain decoding down, and if so which part of it?

    python benchmarks/lab_overhead.py --model DIR [--head DIR --drafter-bits 4 --cap 7] [--limit 2]
        [--max-new-tokens 128] [--json OUT]

On the H200 the sweep's plain decoders (ours and mlx-lm's) ran 15-25% slower than the same decoders
in pipeline_speed.py's process, on the same prompts, while the speculative arm ran at the same rate
in both (docs/performance.md, twenty-first round). This times it in one process, on one loaded
model, in stages, so the machine and the weights are the same throughout:

  bare          every arm on every prompt, the way pipeline_speed.py times them (after one warm-up pass)
  bare again    the same: the noise between two identical stages
  sweep         run_sweep over the same prompts and arms (1 trial, progress bar on, a temporary
                database), its stored trial rates read back; the sweep is handed this same model
                (its loader patched), so only what the sweep does around each generation differs
  sweep quiet   the same with the progress bar off
  bare after    the bare stage once more

Arms: our greedy, mlx-lm's decoder, and with --head dspark-pipe (lookup drafts, compiled draft).
Prints each stage's median tok/s per arm and its ratio to the first bare stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

STAGES = ("bare", "bare again", "sweep", "sweep quiet", "bare after")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", help="a DSpark head: adds the dspark-pipe arm")
    ap.add_argument("--drafter-bits", type=int, default=4)
    ap.add_argument("--cap", type=int, default=7)
    ap.add_argument("--prompts", default="code,math,chat")
    ap.add_argument("--limit", type=int, default=2, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from sqlmodel import Session, select

    from dspark_lab import greedy_generate, load_target, speculative_generate
    from dspark_lab.db import open_db
    from dspark_lab.engine import mlx_lm_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.lab import sweep
    from dspark_lab.lab.prompts import load_prompt_sets
    from dspark_lab.schemas.records import Trial

    target, tok = load_target(args.model)
    head = load_dspark(args.head, target, bits=args.drafter_bits) if args.head else None
    prompts = [p.as_input() for s in load_prompt_sets(args.prompts, limit=args.limit) for p in s.prompts]
    n = args.max_new_tokens
    arms = {"baseline": lambda p: greedy_generate(target, tok, p, max_new_tokens=n),
            "mlx-lm": lambda p: mlx_lm_generate(target, tok, p, max_new_tokens=n)}
    if head is not None:
        arms["dspark-pipe"] = lambda p: speculative_generate(target, tok, head, p, max_new_tokens=n, max_draft_tokens=args.cap,
                                                             pipeline=True, lookup_drafts=True, compile_draft=True)

    def bare() -> dict[str, list[float]]:
        rates = {a: [] for a in arms}
        for p in prompts:
            for name, arm in arms.items():
                rates[name].append(arm(p).decode_tokens_per_sec)
        return rates

    def in_sweep(progress: bool) -> dict[str, list[float]]:
        modes = ["baseline", "mlx-lm"] + ["dspark-pipe"] * (head is not None)
        cfg = sweep.SweepConfig(models=[args.model], drafters=[args.head] if head is not None else [], modes=modes,
                                caps=[str(args.cap)], prompt_sets=args.prompts.split(","), trials=1, max_new_tokens=n,
                                prompt_limit=args.limit, drafter_bits=args.drafter_bits, pipe_lookup=True, compile_draft=True)
        loader = sweep.load_variant
        sweep.load_variant = lambda model_id, dtype=None: (target, tok)  # this stage's model is the bare stages' one
        try:
            with tempfile.TemporaryDirectory() as tmp:
                db = Path(tmp) / "lab.duckdb"
                run_id = sweep.run_sweep(cfg, db, progress=progress)
                engine = open_db(db)
                with Session(engine) as s:
                    trials = s.exec(select(Trial).where(Trial.run_id == run_id)).all()
                    rates = {a: [t.decode_tokens_per_sec for t in trials if t.mode == a] for a in arms}
                engine.dispose()
        finally:
            sweep.load_variant = loader
        return rates

    bare()  # warm-up: every arm on every prompt, as pipeline_speed.py's pass 0
    stages = {}
    for stage in STAGES:
        stages[stage] = in_sweep(progress=stage == "sweep") if stage.startswith("sweep") else bare()
    first = {a: statistics.median(stages["bare"][a]) for a in arms}
    table = []
    print(f"{'stage':12} " + " ".join(f"{a:>22}" for a in arms))
    for stage, rates in stages.items():
        cells = []
        for a in arms:
            med = statistics.median(rates[a])
            table.append({"stage": stage, "arm": a, "tok_s": round(med, 1), "vs_bare": round(med / first[a], 3), "rates": rates[a]})
            cells.append(f"{med:9.1f} tok/s {med / first[a]:6.3f}x")
        print(f"{stage:12} " + " ".join(f"{c:>22}" for c in cells))
    result = {"model": args.model, "head": args.head, "prompts": len(prompts), "max_new_tokens": n, "table": table}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
