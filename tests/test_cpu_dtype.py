"""benchmarks/cpu_dtype.py: the model as stored and cast to float32, both timed after a warm-up."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("cpu_dtype", Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_dtype.py")
cd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cd)


def test_both_arms_are_timed_and_reported_against_the_stored_model(tiny_dirs, capsys):
    med = cd.main(["--model", str(tiny_dirs["qwen3"]), "--tokens", "3", "--repeats", "1"])
    assert set(med) == {"as stored", "float32"} and all(t > 0 for t in med.values())
    out = capsys.readouterr().out
    assert "1.00x as stored" in out and "float32" in out and "3 tokens" in out
