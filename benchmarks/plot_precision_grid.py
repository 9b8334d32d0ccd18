"""Chart a precision grid: one model's decode speed at each precision, from pipeline_speed.py's JSON.

    python benchmarks/plot_precision_grid.py docs/results/precision_h200_qwen05_round19.json --out docs/precision_grid.png

The JSON is one `pipeline_speed.py --precisions 8,16 --json` run: every arm timed on the target
as loaded and on its 8-bit and dequantized copies, side by side in one process. Left, each arm's
decode tokens a second per precision; right, each speculative arm over its own precision's greedy
(what speculation gains there), with the 1.0 line (no gain) and issue #10's 3x goal dashed. Each
bar's tooltip also gives its share of that precision's bandwidth limit.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

PREFIXES = {"q8:": "8-bit copy", "dq:": "dequantized copy"}


def precision_label(prefix: str, model: str) -> str:
    """'' -> 'as loaded (4-bit)' for a model whose directory names its bits; the copies by their prefix."""
    if prefix:
        return PREFIXES.get(prefix, prefix.rstrip(":"))
    bits = re.search(r"-q(\d+)(-|$)", Path(model.rstrip("/")).name)
    return f"as loaded ({bits.group(1)}-bit)" if bits else "as loaded"


def summarize(result: dict) -> list[dict]:
    """One row per arm: its precision, its name without the prefix, tok/s, ratio to its own greedy, share of the limit."""
    rows = []
    for r in result["rows"]:
        prefix = next((p for p in PREFIXES if r["arm"].startswith(p)), "")
        arm = r["arm"].removeprefix(prefix)
        rows.append({"precision": precision_label(prefix, result["model"]), "arm": arm, "tok_s": r["tok_s"],
                     "vs_greedy": r["vs_greedy"], "fraction_of_limit": r["fraction_of_limit"],
                     "speculative": arm not in ("mlx_lm", "greedy", "greedy+c")})
    return rows


def chart(rows: list[dict], title: str):
    import altair as alt

    order = list(dict.fromkeys(r["precision"] for r in rows))
    x = alt.X("precision:N", sort=order, title=None, axis=alt.Axis(labelAngle=0, labelLimit=200))
    tooltip = ["precision:N", "arm:N", "tok_s:Q", "vs_greedy:Q", alt.Tooltip("fraction_of_limit:Q", format=".1%", title="share of the limit")]
    speed = alt.Chart(alt.Data(values=rows)).mark_bar().encode(
        x=x, xOffset="arm:N", y=alt.Y("tok_s:Q", title="decode tokens / s"), color=alt.Color("arm:N", title="arm"), tooltip=tooltip,
    ).properties(title="decode speed", width=120 * len(order), height=240)
    spec_rows = [r for r in rows if r["speculative"]]
    gain = alt.Chart(alt.Data(values=spec_rows)).mark_bar().encode(
        x=x, xOffset="arm:N", y=alt.Y("vs_greedy:Q", title="x its own precision's greedy"), color=alt.Color("arm:N"), tooltip=tooltip,
    )
    labels = gain.mark_text(dy=-6, fontSize=10).encode(text=alt.Text("vs_greedy:Q", format=".2f"))
    lines = alt.Chart(alt.Data(values=[{"y": 1.0, "what": "greedy"}, {"y": 3.0, "what": "goal"}])).mark_rule(strokeDash=[5, 4]).encode(y="y:Q")
    speedup = alt.layer(gain, labels, lines).properties(title="speedup (dashed: 1x, issue #10's 3x)", width=120 * len(order), height=240)
    return alt.hconcat(speed, speedup).properties(title=title)


def main(argv: list[str] | None = None) -> list[dict]:
    from dspark_lab.reports.charts import save_chart

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="pipeline_speed.py --precisions ... --json file")
    ap.add_argument("--out", type=Path, required=True, help="the chart (.png, or .html / .json for the Vega-Lite spec)")
    a = ap.parse_args(argv)
    result = json.loads(a.result.read_text())
    if not result.get("copies"):
        ap.error(f"{a.result} times no copies of its target: run pipeline_speed.py with --precisions 8,16")
    rows = summarize(result)
    name = Path(result["model"].rstrip("/")).name
    spec = chart(rows, f"{name} with {Path(result['head'].rstrip('/')).name}: {result['prompts']} prompts, "
                       f"{result['max_new_tokens']} tokens, {result['repeats']} repeats, {result['device']}")
    save_chart(spec, a.out)
    print(f"{len(rows)} arms at {len({r['precision'] for r in rows})} precisions -> {a.out}")
    return rows


if __name__ == "__main__":
    main()
