"""benchmarks/cpu_dtype.py: the model as stored and cast to float32, both timed after a warm-up."""

from scripts import load_script

cd = load_script("cpu_dtype")


def test_both_arms_are_timed_and_reported_against_the_stored_model(tiny_dirs, capsys):
    med = cd.main(["--model", str(tiny_dirs["qwen3"]), "--tokens", "3", "--repeats", "1"])
    assert set(med) == {"as stored", "float32"} and all(t > 0 for t in med.values())
    out = capsys.readouterr().out
    assert "1.00x as stored" in out and "float32" in out and "3 tokens" in out
