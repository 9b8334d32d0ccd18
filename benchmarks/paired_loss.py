"""Compare two distill runs that drew the same batches: the loss of each and their difference, step by step.

    python benchmarks/paired_loss.py A/train_log.jsonl B/train_log.jsonl --labels "MLP 1,536" "MLP 3,072" \
        [--window 500] [--out chart.png]

Two runs started from one seed on one data file with one mix draw the same rows in the same order,
so the difference of their losses at the same step is what the runs differ in (the head's shape,
its learning rate), free of how hard each batch happened to be: far less noisy than comparing
two loss curves. The twenty-seventh round in docs/performance.md compared a head with its MLP
widened this way. Prints, per WINDOW steps both runs reached, each run's mean loss and the mean
difference (B - A) with its standard error; --out draws both (.png, or .html / .json for the
Vega-Lite spec).

A train_log.jsonl (plain or .gz) is distill's: one {"step", "loss", "seconds"} per line; other
lines (evaluations) are skipped.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from unanswered_prompts import read_jsonl  # noqa: E402


def read_losses(path: Path) -> dict[int, float]:
    """step -> loss, from a distill train log (a resumed run's later line for a step wins)."""
    return {r["step"]: r["loss"] for r in read_jsonl(path) if "loss" in r and "step" in r}


def paired_windows(a: dict[int, float], b: dict[int, float], window: int) -> list[dict]:
    """Per window of steps both runs logged: each run's mean loss and the mean of b - a, with its standard error."""
    by_window: dict[int, list[int]] = {}
    for s in sorted(set(a) & set(b)):  # steps count from 1: window w holds steps w*window+1 .. (w+1)*window
        by_window.setdefault((s - 1) // window, []).append(s)
    out = []
    for here in by_window.values():
        if len(here) < 2:
            continue
        diffs = [b[s] - a[s] for s in here]
        mean = sum(diffs) / len(diffs)
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
        out.append({"first": here[0], "last": here[-1], "steps": len(here),
                    "a": sum(a[s] for s in here) / len(here), "b": sum(b[s] for s in here) / len(here),
                    "diff": mean, "stderr": sd / math.sqrt(len(diffs))})
    return out


def chart(windows: list[dict], labels: tuple[str, str]):
    import altair as alt

    losses = [{"step": w["last"], "run": label, "loss": w[key]} for w in windows for key, label in zip("ab", labels)]
    diffs = [{"step": w["last"], "diff": w["diff"], "low": w["diff"] - 2 * w["stderr"], "high": w["diff"] + 2 * w["stderr"]}
             for w in windows]
    top = alt.Chart(alt.Data(values=losses)).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step (end of window)"), y=alt.Y("loss:Q", title="mean loss", scale=alt.Scale(zero=False)),
        color=alt.Color("run:N", title="run")).properties(title="each run's mean loss per window", width=520, height=200)
    base = alt.Chart(alt.Data(values=diffs))
    bottom = alt.layer(
        base.mark_rule(color="#999").encode(y=alt.datum(0)),
        base.mark_area(opacity=0.25).encode(x="step:Q", y="low:Q", y2="high:Q"),
        base.mark_line(point=True).encode(x=alt.X("step:Q", title="step (end of window)"),
                                          y=alt.Y("diff:Q", title=f"{labels[1]} - {labels[0]}")),
    ).properties(title="the difference on the same batches (band: 2 standard errors)", width=520, height=160)
    return alt.vconcat(top, bottom)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs=2, type=Path, help="the two runs' train_log.jsonl (A, then B)")
    ap.add_argument("--labels", nargs=2, default=["A", "B"])
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--out", type=Path, help="a chart of both (.png, .html or .json)")
    a = ap.parse_args(argv)
    if a.window < 2:
        ap.error("--window must be at least 2 steps")
    runs = [read_losses(p) for p in a.logs]
    for path, run in zip(a.logs, runs):
        if not run:
            ap.error(f"{path} holds no training steps (lines with step and loss): pass a distill train_log.jsonl")
    windows = paired_windows(*runs, a.window)
    if not windows:
        ap.error("the two runs share no window of steps; are they runs over the same steps?")
    print(f"| steps | {a.labels[0]} | {a.labels[1]} | {a.labels[1]} - {a.labels[0]} (standard error) |")
    print("|---|---|---|---|")
    for w in windows:
        print(f"| {w['first']}-{w['last']} | {w['a']:.3f} | {w['b']:.3f} | {w['diff']:+.4f} ({w['stderr']:.4f}) |")
    if a.out:
        from dspark_lab.reports.charts import save_chart

        save_chart(chart(windows, tuple(a.labels)), a.out)
        print(f"chart -> {a.out}")
    return windows


if __name__ == "__main__":
    main()
