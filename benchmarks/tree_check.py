"""The tree forward's load-time check on one model, at its stored precision and in float32, for the
compiled and the op-by-op tree forward: the relative difference from plain forwards of each path,
the chain's own rounding on this machine (Target.chain_rounding) and the check's verdict.

    python benchmarks/tree_check.py MODEL_DIR

(docs/performance.md, thirty-fifth round: the H200 refused Qwen2 trees in bfloat16 at 1.4e-2 against
references of other shapes; thirty-sixth: an H100 at equal shapes.)"""

import sys

from dspark_lab.engine import load_target
from dspark_lab.errors import LoadError


def main(model: str) -> None:
    for dtype in (None, "float32"):
        target, _ = load_target(model, dtype=dtype)
        rounding = target.chain_rounding([(5 * i + 2) % target.vocab_size for i in range(8)] + [7, 18, 29])
        for compiled in (True, False):
            target.tree_compiled = compiled
            try:
                verdict = f"passes, relative difference {target.check_tree_forward():.2e}"
            except LoadError as e:
                verdict = f"refused: {e}"
            print(f"{dtype or 'stored'} compiled={compiled}: chain rounding {rounding:.2e}; tree check {verdict}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
