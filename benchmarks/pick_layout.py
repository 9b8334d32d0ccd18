"""Which rows-kernel layout a device session's sweep should build (DSPARK_LAB_ROWS_LAYOUT), from
benchmarks/rows_kernel.py's report (--json) of a model's decoding with a words-layout copy beside
an mma-layout copy: the layout whose routed chain decoded faster at --cap (the median over the
prompts of each arm's rate over MLX's greedy). Prints the layout's name; given no report, or a
report without both arms, it prints the engine's default layout and says why on stderr.

    python3 benchmarks/pick_layout.py REPORT.json [--cap 7] [--words worthrouting] [--mma withverifiesmma]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_lab.engine.rows_kernel import DEFAULT_LAYOUT as DEFAULT  # noqa: E402


def faster_layout(report: dict, cap: int = 7, words: str = "worthrouting", mma: str = "withverifiesmma") -> tuple[str, str]:
    """(layout, why): mma where its copy's chain at `cap` beat the words copy's, else words."""
    rates = {}
    for layout, copy in (("words", words), ("mma", mma)):
        arm = f"pipe{cap}-{copy}"
        got = [r["over_mlx_greedy"] for r in report.get("decode", []) if r.get("arm") == arm]
        if not got:
            return DEFAULT, f"no arm {arm} in the report: the default layout"
        rates[layout] = statistics.median(got)
    layout = "mma" if rates["mma"] > rates["words"] else "words"
    return layout, f"chain at cap {cap}: words {rates['words']:.2f}x, mma {rates['mma']:.2f}x MLX's greedy"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--cap", type=int, default=7)
    ap.add_argument("--words", default="worthrouting", help="the words-layout copy's name in the report's arms")
    ap.add_argument("--mma", default="withverifiesmma", help="the mma-layout copy's name in the report's arms")
    args = ap.parse_args()
    path = Path(args.report)
    if not path.is_file():
        layout, why = DEFAULT, f"no report at {path}: the default layout"
    else:
        layout, why = faster_layout(json.loads(path.read_text()), args.cap, args.words, args.mma)
    print(why, file=sys.stderr)
    print(layout)


if __name__ == "__main__":
    main()
