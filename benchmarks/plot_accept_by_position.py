"""Chart a head's accept length by where in the answer a round starts, per prompt set: is the
opening of an answer the hard part, or the kind of request?

    python benchmarks/plot_accept_by_position.py [--anchors ANCHORS.jsonl.gz] [--decoded DECODED.json] \
        [--head NAME] [--bin 32] [--upto 256] [--out CHART.png] [--json TABLE.json]

ANCHORS is a `block_accept.py --anchors-out` file (teacher-forced, held-out rows): each row's
decode path is walked again from its anchors (round 0 at the first answer token, the next
`accepted + 1` tokens on). DECODED is a `block_accept.py --against-decode --json` file: the
built-in prompts decoded with the head, each round's accepted drafts in order. Either or both;
the same measure (the decode's rounds, accepted drafts + 1), binned by the answer position the
round starts at. A held-out set's name is read as the built-in set it ends in ("held30_code" ->
code). Prints the table; the chart has a line per set and source.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dspark_lab.lab.block_accept import decode_path_rounds as path_rounds  # noqa: E402: a row's rounds, where each starts
from plot_held_accept import GOALS, SETS, base_set, pick_head  # noqa: E402
from unanswered_prompts import read_jsonl  # noqa: E402

HELD, DECODED = "held-out rows (teacher-forced path)", "built-in prompts (decoded)"


def decoded_rounds(rounds: list[int]) -> list[tuple[int, int]]:
    """(answer position, accepted drafts) of a decode's rounds: round 0 drafts after the first
    answer token, each next one `accepted + 1` tokens on."""
    out, at = [], 0
    for r in rounds:
        out.append((at, r))
        at += r + 1
    return out


def by_position(rounds: dict[tuple[str, str], list[tuple[int, int]]], bin_size: int, upto: int) -> list[dict]:
    """Mean accept length (accepted + 1) of the rounds starting in each bin of answer positions,
    per (source, set)."""
    table = []
    for (source, name), rs in sorted(rounds.items()):
        for lo in range(0, upto, bin_size):
            inside = [a for at, a in rs if lo <= at < lo + bin_size]
            if inside:
                table.append({"source": source, "set": name, "from": lo, "to": lo + bin_size, "rounds": len(inside),
                              "mean_accept": round(1 + sum(inside) / len(inside), 3)})
    return table


def head_anchors(path: Path, head: str | None) -> tuple[str, list[dict]]:
    """The head a `block_accept.py --anchors-out` file holds by that name (its path or the end of
    it; the first by default) and its rows."""
    rows = read_jsonl(path)
    pick = pick_head(dict.fromkeys(r["head"] for r in rows), head)
    return pick, [r for r in rows if r["head"] == pick]


def read_anchors(path: Path, head: str | None) -> dict[tuple[str, str], list[tuple[int, int]]]:
    out: dict = {}
    for r in head_anchors(path, head)[1]:
        out.setdefault((HELD, base_set(r["set"])), []).extend(path_rounds(r["offsets"], r["accepted"]))
    return out


def read_decoded(path: Path) -> dict[tuple[str, str], list[tuple[int, int]]]:
    out: dict = {}
    for c in json.loads(path.read_text())["checks"]:
        out.setdefault((DECODED, c["prompt"].rsplit("-", 1)[0]), []).extend(decoded_rounds(c["rounds"]))
    return out


def chart(table: list[dict], title: str):
    import altair as alt

    sets = [s for s in SETS if any(r["set"] == s for r in table)]
    lines = alt.Chart(alt.Data(values=table)).mark_line(point=True).encode(
        x=alt.X("from:Q", title="answer position a round starts at (bin start)"),
        y=alt.Y("mean_accept:Q", title="mean accept length (cap 7)", scale=alt.Scale(zero=False)),
        color=alt.Color("set:N", sort=sets, title="set"),
        strokeDash=alt.StrokeDash("source:N", title="measured on"),
        tooltip=["source:N", "set:N", "from:Q", "to:Q", "rounds:Q", "mean_accept:Q"],
    )
    goals = alt.Chart(alt.Data(values=[{"set": s, "goal": g} for s, g in GOALS.items() if s in sets])).mark_rule(
        strokeDash=[2, 4], opacity=0.6).encode(y="goal:Q", color=alt.Color("set:N", sort=sets))
    return alt.layer(lines, goals).properties(title=title, width=520, height=300)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", type=Path, help="a block_accept.py --anchors-out file (held-out rows)")
    ap.add_argument("--decoded", type=Path, help="a block_accept.py --against-decode --json file (built-in prompts)")
    ap.add_argument("--head", help="which head of the anchors file (its path or the end of it); the first by default")
    ap.add_argument("--bin", type=int, default=32, help="answer positions per bin")
    ap.add_argument("--upto", type=int, default=256, help="the last answer position charted")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", type=Path, help="the chart (.png, or .html / .json for the Vega-Lite spec)")
    ap.add_argument("--json", type=Path, help="the table as JSON")
    a = ap.parse_args(argv)
    if not (a.anchors or a.decoded):
        ap.error("give --anchors FILE, --decoded FILE or both")
    for path in (a.anchors, a.decoded):
        if path is not None and not path.is_file():
            ap.error(f"{path}: no such file")
    if a.bin < 1 or a.upto < a.bin:
        ap.error(f"--bin must be >= 1 and --upto >= --bin, got --bin {a.bin} --upto {a.upto}")
    rounds = {}
    if a.anchors:
        rounds.update(read_anchors(a.anchors, a.head))
    if a.decoded:
        rounds.update(read_decoded(a.decoded))
    table = by_position(rounds, a.bin, a.upto)
    for r in table:
        print(f"{r['source']:<38} {r['set']:<5} {r['from']:>4}-{r['to']:<4} {r['mean_accept']:.3f} over {r['rounds']} rounds")
    if a.json:
        a.json.write_text(json.dumps(table, indent=2))
    if a.out:
        from dspark_lab.reports.charts import save_chart

        save_chart(chart(table, a.title or "accept length by where the round starts in the answer"), a.out)
        print(f"{len(table)} points -> {a.out}")
    return table


if __name__ == "__main__":
    main()
