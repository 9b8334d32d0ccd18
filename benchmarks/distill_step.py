"""Time one distill training step, split into the target's forward and the head's step, and its
peak memory, for several anchor counts: how many anchors a step can afford on this machine.

    python benchmarks/distill_step.py --model MODEL --data DIR/data.jsonl(.gz) --seqs 8 --anchors 512,2048 \
        --block 8 --layers 2 --markov-rank 64 [--max-len 1024] [--steps 3] [--weights as-loaded,dequantized] \
        [--compute float32,bfloat16] [--soft-labels 0,32] [--json OUT.json]

A step is distill's own: `_training_batch` draws the sequences and anchors, `step_inputs` runs the
target's tapped forward (taps and greedy labels), `head_loss_and_grad` (chained slots) and an AdamW
update train the head. Every part is evaluated on its own (mx.eval), after one warm-up step
per anchor count, so the split is exact and the total is a little above distill's (which lets the
two overlap). The same seeded sequences are drawn for every anchor count. Peak memory is MLX's
(`mx.get_peak_memory`, reset per anchor count): what the step needs of the GPU, or of RAM on a CPU.
Of the time, what matters is the ratio: anchors trained per second. Each anchor count is measured
twice from the same initial head on the same batches: projecting every block slot to the
vocabulary, and only the slots that carry a label (`labelled_rows`, what distill does); the two
losses agree, and the head step's times say what leaving the unlabelled slots out saves.
`--weights` runs all of it for the target as loaded and/or its dequantized copy (what distill's
`--target-weights` chooses between): the same labels up to near-ties, a different forward time.
`--compute` does the same for the head's own arithmetic (distill's `--compute-dtype`: float32, or
bfloat16 on copies of float32 weights), and `--soft-labels` for distill's soft labels (0: the
greedy token alone; k: the target's k most likely tokens, taken from the same forward).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

from dspark_lab.engine.drafters.dspark import DSparkHead  # noqa: E402
from dspark_lab.engine.loading import load_target  # noqa: E402
from dspark_lab.errors import InputError  # noqa: E402
from dspark_lab.lab.distill import DistillConfig, _training_batch, dense_lm_head, head_config, head_loss_and_grad, step_inputs  # noqa: E402
from dspark_lab.lab.prompts.public import open_text  # noqa: E402


def read_rows(path: Path, limit: int) -> list[dict]:
    rows = []
    with open_text(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if len(rows) >= limit:
                    break
    return rows


def measure(target, c, lm_head, data, cfg: DistillConfig, steps: int, gather: bool = True) -> dict:
    mx.random.seed(cfg.seed)  # the same initial head in every measurement: their losses compare
    head = DSparkHead(c, target.hidden_size)
    mx.eval(head.parameters())
    optimizer = optim.AdamW(learning_rate=1e-4, weight_decay=0.0)
    loss_and_grad = head_loss_and_grad(head, c, target, lm_head, cfg)
    rng = random.Random(cfg.seed)
    fwd, train, loss = [], [], None
    mx.reset_peak_memory()
    for i in range(steps + 1):  # the first is the warm-up (compiles kernels for the shapes)
        batch = None
        while batch is None:
            batch = _training_batch(data, rng, cfg)
        ids, lengths, anchors = batch
        t0 = time.perf_counter()
        taps_cat, labels, rows, soft = step_inputs(target, c, cfg, ids, anchors, lengths, gather)
        t1 = time.perf_counter()
        loss, grads = loss_and_grad(head, taps_cat, ids, anchors, lengths, labels, rows, soft)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state, loss)
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            train.append(t2 - t1)
    f, t = statistics.median(fwd), statistics.median(train)
    rows = int(rows[1].sum().item()) if gather else None
    return {"anchors": cfg.anchors, "seqs": cfg.seqs, "soft_labels": cfg.soft_labels, "gather": gather, "labelled_slots": rows, "slots": cfg.anchors * c.block_size,
            "target_forward_ms": round(1e3 * f, 1), "head_step_ms": round(1e3 * t, 1),
            "step_ms": round(1e3 * (f + t), 1), "anchors_per_s": round(cfg.anchors / (f + t), 1),
            "peak_bytes": mx.get_peak_memory(), "loss": round(loss.item(), 3)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", type=Path, required=True, help="a distill data.jsonl (or .jsonl.gz)")
    ap.add_argument("--rows", type=int, default=2000, help="rows read from the data file (drawn from at random)")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--anchors", default="512,2048", help="total anchors per step, comma-separated")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per anchor count (after one warm-up)")
    ap.add_argument("--compute", default="float32",
                    help="comma-separated: float32, bfloat16 (the head's forward and backward, distill's --compute-dtype)")
    ap.add_argument("--soft-labels", default="0", help="comma-separated: 0 (the greedy token) or k (the target's top k), distill's --soft-labels")
    ap.add_argument("--weights", default="as-loaded", help="comma-separated: as-loaded, dequantized (the target's weights in the step)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    data = read_rows(a.data, a.rows)
    results = []
    for weights in a.weights.split(","):
        if weights not in ("as-loaded", "dequantized"):
            ap.error(f"--weights: {weights!r} is neither as-loaded nor dequantized")
        target, _ = load_target(a.model, dequantize=weights == "dequantized")
        lm_head = dense_lm_head(target)
        for n, compute, k in ((int(x), dt, int(k)) for x in a.anchors.split(",") for dt in a.compute.split(",")
                              for k in a.soft_labels.split(",")):
            try:
                cfg = DistillConfig(model=a.model, out="", block=a.block, layers=a.layers, markov_rank=a.markov_rank, anchors=n,
                                    seqs=a.seqs, max_len=a.max_len, tokens=1, compute_dtype=compute, soft_labels=k)
            except InputError as e:
                ap.error(str(e).replace("--compute-dtype", "--compute"))
            c = head_config(target, cfg)
            for gather in (False, True):  # every slot projected to the vocabulary, or only the labelled ones (distill's way)
                r = measure(target, c, lm_head, data, cfg, a.steps, gather) | {"weights": weights, "compute": compute}
                results.append(r)
                what = f"{r['labelled_slots']} of {r['slots']} slots" if gather else f"all {r['slots']} slots"
                print(f"{weights:>11}, {compute:>8}, soft {k:3d}, anchors {n:5d} ({a.seqs} x {n // a.seqs}), {what:>22}: target forward {r['target_forward_ms']:8.1f} ms, "
                      f"head step {r['head_step_ms']:8.1f} ms, {r['anchors_per_s']:8.1f} anchors/s, peak {r['peak_bytes'] / 2**30:.2f} GB, "
                      f"last loss {r['loss']}", flush=True)
        del target, lm_head
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "device": str(mx.default_device()), "rows": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
