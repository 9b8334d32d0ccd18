"""benchmarks/synthetic_prompts.py: generated math and code requests for distill data. They must be
reproducible (the ninth round's math file is remade by its seed), distinct, readable by the prompt
loader, and never a held-out built-in prompt."""

import json

import pytest

from dspark_lab.lab.prompts import load_prompt_set

from scripts import load_script

synth = load_script("synthetic_prompts")


def _text(row):
    return row.get("text") or row["messages"][-1]["content"]


@pytest.mark.parametrize("kind", ["math", "code"])
def test_prompts_are_reproducible_distinct_and_load(kind, tmp_path):
    make = synth.synthetic_math_prompts if kind == "math" else synth.synthetic_code_prompts
    rows = make(400, seed=3)
    assert rows == make(400, seed=3) and rows != make(400, seed=4)
    assert len({_text(r) for r in rows}) == 400 and len({r["id"] for r in rows}) == 400
    path = tmp_path / f"{kind}_synth.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_prompt_set(str(path))
    assert len(ps.prompts) == 400 and {p.domain for p in ps.prompts} == {kind}


@pytest.mark.parametrize("kind", ["math", "code"])
def test_no_generated_prompt_is_a_held_out_one(kind):
    make = synth.synthetic_math_prompts if kind == "math" else synth.synthetic_code_prompts
    held = synth.builtin_texts(kind)
    assert held and not held & {_text(r) for r in make(2000, seed=0, exclude=held)}
    # The exclusion works: forbid what one run made, and a rerun makes none of it.
    first = {_text(r) for r in make(50, seed=0)}
    assert not first & {_text(r) for r in make(50, seed=0, exclude=first)}


def test_math_problems_state_consistent_numbers():
    # The change problems once asked for change from a bill smaller than the cost.
    import re

    for r in synth.synthetic_math_prompts(3000, seed=1):
        m = re.search(r"buys (\d+) notebooks at \$(\d+)\.(\d\d) each and pays with a \$(\d+) bill", _text(r))
        if m:
            count, dollars, cents, bill = map(int, m.groups())
            assert count * (100 * dollars + cents) <= 100 * bill


def test_asking_for_more_code_prompts_than_exist_is_a_clear_error():
    with pytest.raises(ValueError, match="more than the distinct code prompts"):
        synth.synthetic_code_prompts(10**6)


def test_exclude_makes_a_second_file_of_fresh_prompts(tmp_path, capsys):
    """--exclude FILE: a second run (another seed) repeats none of the first file's prompts."""
    first, second = tmp_path / "code_synth.jsonl", tmp_path / "code_synth2.jsonl"
    synth.main(["--kind", "code", "--n", "300", "--out", str(first)])
    synth.main(["--kind", "code", "--n", "300", "--seed", "1", "--exclude", str(first), "--out", str(second)])
    a, b = ({_text(json.loads(line)) for line in p.read_text().splitlines()} for p in (first, second))
    assert len(a) == len(b) == 300 and not a & b
    # Without the exclusion the two seeds do meet (the check above is not vacuous).
    again = tmp_path / "again.jsonl"
    synth.main(["--kind", "code", "--n", "300", "--seed", "1", "--out", str(again)])
    assert a & {_text(json.loads(line)) for line in again.read_text().splitlines()}


def test_no_mirrors_leaves_out_the_families_that_copy_held_out_wording():
    """Ten math families copy the wording of held-out prompts (the tenth round's finding); with
    mirrors=False none of them appears, and mirrors=True still makes the files made before."""
    twins = ("Evaluate the definite integral", "Solve the system of equations", "Find the derivative", "discounted by",
             "compounded yearly", "greatest common divisor", "A car drives", "A tank holds", "A rectangle is", "Solve for x:")
    default = [_text(r) for r in synth.synthetic_math_prompts(1500, seed=0)]
    clean = [_text(r) for r in synth.synthetic_math_prompts(1500, seed=0, mirrors=False)]
    assert all(any(t in x for x in default) for t in twins)  # not vacuous: the default makes every one
    assert not any(t in x for t in twins for x in clean)
    assert len(set(clean)) == 1500


def test_math_007_has_the_coin_flip_family_as_twin_and_the_unmirrored_prompts_have_none(tmp_path):
    """Why math-007 (dice) is in MIRRORED_PROMPTS: among a math file's prompts prompt_twins.py finds
    a coin-flip question at its twin flag (0.5); the evaluated prompts left out of it have none."""
    twins = load_script("prompt_twins")
    path = tmp_path / "math_synth.jsonl"
    synth.write_prompt_file(path, synth.synthetic_math_prompts(2500, seed=0))
    training = [("math_synth", p) for p in load_prompt_set(str(path)).prompts]
    rows = {r["prompt"]: r for r in twins.nearest(load_prompt_set("math", limit=8).prompts, training)}
    assert rows["math-007"]["likeness"] >= 0.5 and "If you flip a fair coin" in rows["math-007"]["nearest_text"]
    unmirrored = sorted(p for p in rows if p not in synth.MIRRORED_PROMPTS)
    assert unmirrored == ["math-003", "math-008"] and all(rows[p]["likeness"] < 0.5 for p in unmirrored)


def test_the_ninth_rounds_math_file_is_remade_byte_for_byte():
    """`--kind math --n 2500` (seed 0) is the file the ninth and tenth rounds trained on; its sha256
    is pinned so that no change to the generator silently changes what a seed makes."""
    import hashlib

    rows = synth.synthetic_math_prompts(2500, 0, synth.builtin_texts("math"))
    text = "".join(json.dumps(row) + "\n" for row in rows)
    assert hashlib.sha256(text.encode()).hexdigest() == "258188f9e5b0853c12d4bab708031a2f8fb26a30ccab804b8b59d3d64c010c36"


def test_a_space_used_up_by_exclusions_is_a_clear_error_not_a_hang(monkeypatch):
    """Asking for more fresh prompts than the --exclude files leave once looped forever (a third
    code file after 9,000 made); now the generator stops and says how many it could make. The
    generators' spaces are shrunk so that using one up takes a moment."""
    monkeypatch.setattr(synth, "MAX_MISSES", 2000)
    # Code: one task in one language, one SQL and one shell task: 18 + 6 + 6 distinct prompts.
    monkeypatch.setattr(synth, "CODE_TASKS", [("add", "adds two numbers")])
    monkeypatch.setattr(synth, "CODE_LANGS", ["Python"])
    monkeypatch.setattr(synth, "SQL_TASKS", [("orders(id, total)", "sums the totals")])
    monkeypatch.setattr(synth, "SHELL_TASKS", ["lists files"])
    taken = {_text(r) for r in synth.synthetic_code_prompts(15, seed=0)}
    with pytest.raises(ValueError, match=r"only 15 of the 18 code prompts .* \(--n 15\)"):
        synth.synthetic_code_prompts(18, seed=1, exclude=taken)
    assert len(synth.synthetic_code_prompts(15, seed=1, exclude=taken)) == 15  # what is left is still made
    # Math: a single family of five problems.
    monkeypatch.setattr(synth, "_math_families", lambda r: iter([f"What is {r.randint(1, 5)} + 1?"]))
    with pytest.raises(ValueError, match=r"only 5 of the 6 math prompts"):
        synth.synthetic_math_prompts(6, seed=0)
    assert len(synth.synthetic_math_prompts(5, seed=0)) == 5


def test_a_gz_out_is_written_gzipped_and_loads(tmp_path):
    out = tmp_path / "code_synth.jsonl.gz"
    synth.main(["--kind", "code", "--n", "50", "--out", str(out)])
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    assert len(load_prompt_set(str(out)).prompts) == 50
