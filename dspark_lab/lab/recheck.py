"""Classify the stored mismatches of a results database again, with the current tie test.

A sweep classifies each trial whose output differs from the baseline's when it stores it
(lab/lossless.py). When that test changes (it once took one rounding step of the logit dtype
as the whole of the rounding; it now measures the gap's spread across forward widths), the
trials already stored keep their old verdict. This re-runs the test on the machine that holds
the models, and with `update` stores the new gap and verdict in place.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from sqlmodel import Session, select

from ..errors import InputError
from ..schemas import Run, Trial


def recheck_mismatches(engine, run_ids: list[str] | None = None, *, update: bool = False,
                       on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One dict per stored trial that differs from its baseline (in `run_ids`, default all runs):
    its arm, prompt and first difference (lab/lossless.first_divergence, with the verify width of
    the trial's cap, and a tree arm's tree width), and its old and new verdicts. Loads each model once, stored as its id says."""
    from ..engine.drafters.load import load_dspark
    from ..engine.text import encode_prompt
    from .lossless import first_divergence, verify_width
    from .prompts import load_prompt_sets
    from .sweep import TREE_MODES, load_variant, stored_baseline, sweep_tree_rows

    with Session(engine) as s:
        query = select(Trial).where(Trial.lossless == False)  # noqa: E712
        if run_ids:
            query = query.where(Trial.run_id.in_(run_ids))
        bad = s.exec(query.order_by(Trial.model_id, Trial.run_id, Trial.id)).all()
        runs = {r.id: json.loads(r.config) for r in s.exec(select(Run)).all()}
    results, loaded, sets, max_drafts = [], {}, {}, {}
    for t in bad:
        cfg = runs[t.run_id]
        if t.model_id not in loaded:
            loaded.clear()  # one model in memory at a time
            loaded[t.model_id] = load_variant(t.model_id, cfg.get("dtype"))
        target, tok = loaded[t.model_id]
        if t.run_id not in sets:
            try:
                sets[t.run_id] = {p.name: p for p in load_prompt_sets(cfg["prompt_sets"], limit=cfg.get("prompt_limit"))}
            except (InputError, OSError) as e:
                raise InputError(f"run {t.run_id}'s prompt sets {cfg['prompt_sets']} cannot be read here ({e}); "
                                 "recheck on a machine that has its prompt files.") from e
        prompt = next((p for p in sets[t.run_id][t.prompt_set].prompts if p.id == t.prompt_id), None)
        base = stored_baseline(engine, t.run_id, t.model_id, t.prompt_set, t.prompt_id)
        if prompt is None or base is None:
            raise InputError(f"trial {t.id} ({t.prompt_set}/{t.prompt_id} of run {t.run_id}) has no "
                             f"{'prompt in its set' if prompt is None else 'stored baseline'} to compare with.")
        tree_width = 0
        if t.mode in TREE_MODES:  # the arm's verify rows: its head's max_drafts says how deep a lookup branch went
            if (t.model_id, t.drafter_id) not in max_drafts:
                max_drafts[(t.model_id, t.drafter_id)] = load_dspark(t.drafter_id, target, bits=cfg.get("drafter_bits") or 4).config.max_drafts
            tree_width = sweep_tree_rows(t.mode, cfg.get("tree_nodes", 16), t.cap, max_drafts[(t.model_id, t.drafter_id)],
                                         bool(cfg.get("pipe_lookup")))
        d = first_divergence(target, encode_prompt(tok, prompt.as_input()), base, json.loads(t.output_ids),
                             width=verify_width(t.cap), tree_width=tree_width)
        row = {"trial": t.id, "run_id": t.run_id, "arm": t.arm_key, "prompt": f"{t.prompt_set}/{t.prompt_id}",
               "trial_index": t.trial_index, "was_tie": t.mismatch_tie, "divergence": d,
               "tie": bool(d and d.get("tie")), "gap": d.get("gap") if d else None}
        if update:
            with Session(engine) as s:
                stored = s.get(Trial, t.id)
                stored.mismatch_tie, stored.mismatch_gap = row["tie"], row["gap"]
                s.add(stored)
                s.commit()
        results.append(row)
        if on_result is not None:
            on_result(row)
    return results
