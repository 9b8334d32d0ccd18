"""Chart the held-out acceptance of distilled heads, round by round, from their evaluation JSONs.

    python benchmarks/plot_distill_rounds.py docs/results/eval*.json --out docs/distill_rounds.png

Each file is one `benchmarks/lossless_check.py --out` (the head alone on the built-in sets): the
chart shows, per target model, every file's mean accept length on each set (the mean over its
prompts, as lossless_check prints it), files in round order (the number after "eval" in the
name), with dashed lines at issue #9's goals where it sets one for that model. A bar "math (no
twin)" leaves out the math prompts that a training template copies (synthetic_prompts.py's
MIRRORED_PROMPTS): the figure that says how well a head generalizes on math.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_prompts import math_without_twin  # noqa: E402

NO_TWIN = "math (no twin)"

# Issue #9's goals: SmolLM2 > 1.8 on code at cap 4; the Qwen heads >= 3.0 on code and math, >= 2.0 on chat at cap 7.
GOALS = {"smollm2": {"code": 1.8}, "qwen": {"code": 3.0, "math": 3.0, "chat": 2.0, NO_TWIN: 3.0}}


def model_name(path: str) -> str:
    """'/root/ship/qwen05/qwen2.5-coder-0.5b-q4-bfloat16' -> 'qwen2.5-coder-0.5b'."""
    name = Path(path.rstrip("/")).name
    return re.sub(r"-(q\d+|float\d+|bfloat16)(-.*)?$", "", name) or name


def round_of(file: Path) -> int:
    m = re.match(r"eval(\d+)", file.stem)
    return int(m.group(1)) if m else 0


def summarize(files: list[Path]) -> list[dict]:
    """One row per (file, set): the model, the file's label, its round and the set's mean accept length."""
    rows = []
    for f in sorted(files, key=lambda f: (round_of(f), f.stem)):
        data = json.loads(f.read_text())
        by_set: dict[str, list[float]] = {}
        for r in data["rows"]:
            if r.get("mean_accept") is not None:
                by_set.setdefault(r["set"], []).append(r["mean_accept"])
                if math_without_twin(r):
                    by_set.setdefault(NO_TWIN, []).append(r["mean_accept"])
        label = f.stem.removeprefix("eval")
        for s, values in sorted(by_set.items()):
            rows.append({"model": model_name(data["model"]), "run": label, "round": round_of(f), "set": s,
                         "mean_accept": round(sum(values) / len(values), 3), "prompts": len(values)})
    return rows


def goals_for(model: str) -> dict[str, float]:
    return next((g for key, g in GOALS.items() if model.startswith(key)), {})


def chart(rows: list[dict]):
    import altair as alt

    charts = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        order = sorted({r["run"] for r in mine}, key=lambda run: next((r["round"], run) for r in mine if r["run"] == run))
        bars = alt.Chart(alt.Data(values=mine)).mark_bar().encode(
            x=alt.X("run:N", sort=order, title="evaluation (round, run)",
                    axis=alt.Axis(labelAngle=-35, labelLimit=260, labelOverlap=False)),
            xOffset="set:N",
            y=alt.Y("mean_accept:Q", title="held-out mean accept length", scale=alt.Scale(domain=[0, 4])),
            color=alt.Color("set:N", title="prompt set"),
            tooltip=["run:N", "set:N", "mean_accept:Q", "prompts:Q"],
        )
        layers = [bars]
        goals = [{"set": s, "goal": g} for s, g in goals_for(model).items()]
        if goals:
            layers.append(alt.Chart(alt.Data(values=goals)).mark_rule(strokeDash=[5, 4]).encode(y="goal:Q", color="set:N"))
        charts.append(alt.layer(*layers).properties(title=f"{model}: the head alone, greedy (dashed: issue #9's goals)",
                                                    width=max(300, 90 * len(order)), height=220))
    return alt.vconcat(*charts)


def main(argv: list[str] | None = None) -> list[dict]:
    from dspark_lab.reports.charts import save_chart

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="lossless_check.py --out JSON files")
    ap.add_argument("--out", type=Path, required=True, help="the chart (.png, or .html / .json for the Vega-Lite spec)")
    a = ap.parse_args(argv)
    rows = summarize(a.files)
    if not rows:
        ap.error("none of the files holds an evaluated prompt (rows with mean_accept)")
    spec = chart(rows)
    save_chart(spec, a.out)
    print(f"{len(rows)} bars over {len({r['model'] for r in rows})} model(s) -> {a.out}")
    return rows


if __name__ == "__main__":
    main()
