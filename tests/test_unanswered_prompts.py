"""benchmarks/unanswered_prompts.py: what a distill round's generation left of its prompt files, for
the next round: the prompts whose (set, id) has no generated row, unchanged and in order, one file
per prompt file, and loadable as a prompt set again."""

import gzip
import json
import subprocess
import sys

from dspark_lab.lab.prompts import load_prompt_set

from scripts import BENCHMARKS

SCRIPT = BENCHMARKS / "unanswered_prompts.py"


def _prompt(i, domain="code"):
    return {"id": f"p-{i:03d}", "domain": domain, "messages": [{"role": "user", "content": f"request {i}"}],
            "reference": f"ref {i}"}


def test_the_unanswered_prompts_of_each_file_are_left_for_the_next_round(tmp_path):
    code = tmp_path / "code_synth.jsonl.gz"
    code.write_bytes(gzip.compress("".join(json.dumps(_prompt(i)) + "\n" for i in range(5)).encode()))
    math = tmp_path / "math_synth.jsonl"  # plain JSONL too
    math.write_text("".join(json.dumps(_prompt(i, "math")) + "\n" for i in range(3)))
    # Generated rows name their prompt file by `set`; the same id in another set answers nothing here.
    rows = [{"ids": [1], "set": "code_synth", "prompt_id": "p-001"}, {"ids": [1], "set": "code_synth", "prompt_id": "p-003"},
            {"ids": [1], "set": "math_synth", "prompt_id": "p-000"}, {"ids": [1], "set": "other", "prompt_id": "p-002"}]
    data = tmp_path / "generated.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(SCRIPT), "--data", str(data), str(code), str(math), "--out-dir",
                          str(tmp_path / "next"), "--suffix", "_left12"], capture_output=True, text=True, check=True).stdout
    assert "code_synth: 2 of 5 answered, 3 left" in out and "math_synth: 1 of 3 answered, 2 left" in out
    left_code = [json.loads(line) for line in gzip.open(tmp_path / "next" / "code_synth_left12.jsonl.gz", "rt")]
    assert left_code == [_prompt(0), _prompt(2), _prompt(4)]  # the records unchanged, reference included
    left_math = load_prompt_set(str(tmp_path / "next" / "math_synth_left12.jsonl.gz"))
    assert left_math.name == "math_synth_left12" and [p.id for p in left_math.prompts] == ["p-001", "p-002"]
