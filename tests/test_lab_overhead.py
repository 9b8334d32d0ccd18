"""benchmarks/lab_overhead.py: the same loaded model timed bare and inside run_sweep, stage by
stage, with the sweep's loader put back afterwards."""

import json

from dspark_lab.lab import sweep
from dspark_lab.tiny import build_tiny_dspark

from scripts import load_script


def _module():
    return load_script("lab_overhead")


def test_every_stage_times_every_arm_on_every_prompt(tiny_dirs, tmp_path):
    loader, mod = sweep.load_variant, _module()
    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4)
    r = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--cap", "3", "--prompts", "code,math",
                        "--limit", "1", "--max-new-tokens", "6", "--json", str(tmp_path / "r.json")])
    assert sweep.load_variant is loader  # the patch is undone
    rows = {(row["stage"], row["arm"]): row for row in r["table"]}
    assert set(rows) == {(s, a) for s in mod.STAGES for a in ("baseline", "mlx-lm", "dspark-pipe")}
    # 2 prompts in every stage: the sweep stages read back one stored trial per prompt and arm
    assert all(len(row["rates"]) == 2 and all(x > 0 for x in row["rates"]) for row in rows.values())
    assert all(row["vs_bare"] == 1.0 for (stage, _), row in rows.items() if stage == "bare")
    assert json.loads((tmp_path / "r.json").read_text())["prompts"] == 2
