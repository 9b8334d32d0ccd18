"""Chart one head's accept length three ways, per prompt set: decoding the built-in prompts, and
teacher-forced on held-out rows, on the decode's path and over every anchor.

    python benchmarks/plot_held_accept.py BLOCK_ACCEPT.json [--head NAME] [--builtin EVAL.json] --out CHART.png

BLOCK_ACCEPT.json is a `benchmarks/block_accept.py --json` file (the first head in it unless
--head names another, by its path or the end of it); EVAL.json a `lossless_check.py --out` file
of the same head on the built-in sets (the round's evaluation). A held-out set's name is read as
the built-in set it ends in ("held30_code" -> code), so each set's bars stand side by side, with
issue #9's goals dashed. The three differ in what they average: the built-in evaluation decodes
8 hand-written prompts a set for 128 tokens; the path mean is what decoding the held-out rows
would report; the all-anchor mean weighs easy stretches more (docs/performance.md, thirtieth round).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plot_distill_rounds import NO_TWIN, summarize as builtin_means  # noqa: E402

SETS = ("code", "math", "chat")
GOALS = {"code": 3.0, "math": 3.0, "chat": 2.0}  # issue #9, the Qwen heads at cap 7
MEASURES = ("built-in prompts, decoded", "held-out rows, the decode's path", "held-out rows, every anchor")


def base_set(name: str) -> str:
    """'held30_code' -> 'code'; a name that ends in no built-in set stays as it is."""
    tail = name.rsplit("_", 1)[-1]
    return tail if tail in SETS else name


def pick_head(heads: dict, name: str | None) -> str:
    if name is None:
        return next(iter(heads))
    found = [h for h in heads if h == name or h.rstrip("/").endswith(name.rstrip("/"))]
    if len(found) != 1:
        raise SystemExit(f"--head {name}: {'no' if not found else 'more than one'} head of {', '.join(heads)} matches")
    return found[0]


def summarize(block_accept: dict, head: str | None = None, builtin: Path | None = None) -> list[dict]:
    """One row per (set, measure): the head's mean accept length; the built-in sets' means are
    plot_distill_rounds.py's, as every round's chart shows them."""
    name = pick_head(block_accept["heads"], head)
    h = block_accept["heads"][name]
    rows = [{"set": base_set(s), "measure": MEASURES[1], "mean_accept": round(v, 3)} for s, v in h["path"]["by_set"].items()]
    rows += [{"set": base_set(s), "measure": MEASURES[2], "mean_accept": round(v, 3)} for s, v in h["by_set"].items()]
    if builtin is not None:
        rows += [{"set": r["set"], "measure": MEASURES[0], "mean_accept": r["mean_accept"]}
                 for r in builtin_means([builtin]) if r["set"] != NO_TWIN]
    return rows


def chart(rows: list[dict], title: str):
    import altair as alt

    order = [s for s in SETS if any(r["set"] == s for r in rows)] + sorted({r["set"] for r in rows} - set(SETS))
    measures = [m for m in MEASURES if any(r["measure"] == m for r in rows)]
    bars = alt.Chart(alt.Data(values=rows)).mark_bar().encode(
        x=alt.X("set:N", sort=order, title="prompt set", axis=alt.Axis(labelAngle=0)),
        xOffset=alt.XOffset("measure:N", sort=measures),
        y=alt.Y("mean_accept:Q", title="mean accept length (cap 7)", scale=alt.Scale(domain=[0, 4])),
        color=alt.Color("measure:N", sort=measures, title="measured"),
        tooltip=["set:N", "measure:N", "mean_accept:Q"],
    )
    labels = bars.mark_text(dy=-6, fontSize=10).encode(text=alt.Text("mean_accept:Q", format=".3f"), color=alt.value("black"))
    goals = [{"set": s, "goal": g} for s, g in GOALS.items() if s in order]
    rules = alt.Chart(alt.Data(values=goals)).mark_tick(strokeDash=[5, 4], thickness=2, size=110, color="gray").encode(
        x=alt.X("set:N", sort=order), y="goal:Q")
    return alt.layer(bars, labels, rules).properties(title=title, width=420, height=260)


def main(argv: list[str] | None = None) -> list[dict]:
    from dspark_lab.reports.charts import save_chart

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("block_accept", type=Path, help="a benchmarks/block_accept.py --json file")
    ap.add_argument("--head", help="which of its heads (its path, or the end of it); the first by default")
    ap.add_argument("--builtin", type=Path, help="the same head's lossless_check.py --out on the built-in sets")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", type=Path, required=True, help="the chart (.png, or .html / .json for the Vega-Lite spec)")
    a = ap.parse_args(argv)
    for path in (a.block_accept, a.builtin):
        if path is not None and not path.is_file():
            ap.error(f"{path}: no such file")
    data = json.loads(a.block_accept.read_text())
    if "heads" not in data or "path" not in next(iter(data["heads"].values()), {}):
        ap.error(f"{a.block_accept} is not a block_accept.py --json file with the decode's path "
                 "(measure again with this version of block_accept.py)")
    rows = summarize(data, a.head, a.builtin)
    name = pick_head(data["heads"], a.head)
    save_chart(chart(rows, a.title or f"{Path(name.rstrip('/')).name}: accept length three ways (dashed: issue #9's goals)"), a.out)
    print(f"{len(rows)} bars -> {a.out}")
    return rows


if __name__ == "__main__":
    main()
