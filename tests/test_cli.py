"""The command line: help texts, generation, the demo, and one-line errors without tracebacks."""

import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dspark_lab.cli import app

runner = CliRunner()
VERBS = ["generate", "demo", "import-gguf", "fetch-model", "calibrate", "doctor", "sweep", "benchmark", "ingest", "export", "report", "registry", "distill", "quantize-head"]


def test_help_lists_every_verb():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for verb in VERBS:
        assert verb in r.output


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_explains_itself(verb):
    r = runner.invoke(app, [verb, "--help"])
    assert r.exit_code == 0
    assert "Usage" in r.output and len(r.output) > 200


@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_generate_streams_and_reports(tiny_dirs, mode):
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "-p", "a b c a b c a b c", "--mode", mode, "-n", "12"])
    assert r.exit_code == 0, r.output
    assert "12 tokens (length)" in r.output and "mean accept length" in r.output and "tok/s" in r.output


def test_a_slow_rate_keeps_its_digits():
    from dspark_lab.cli import _rate

    assert _rate(267.34) == "267.3" and _rate(1.0) == "1.0"
    assert _rate(0.0234) == "0.023" and _rate(0.5) == "0.5"  # not "0.0" for a bfloat16 model on a CPU


def test_generate_on_a_bfloat16_model_notes_the_cpu_cast(tiny_dirs, tiny_bf16_dir):
    r = runner.invoke(app, ["generate", "-m", str(tiny_bf16_dir), "-p", "a b c", "--mode", "baseline", "-n", "3"])
    assert r.exit_code == 0, r.output
    assert "note:" in r.output and "--dtype float32" in r.output and "Warning" not in r.output  # one line, not Python's warning
    r = runner.invoke(app, ["generate", "-m", str(tiny_bf16_dir), "-p", "a b c", "--mode", "baseline", "-n", "3", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert "note:" not in r.output


def test_generate_error_is_one_clear_line(tmp_path):
    r = runner.invoke(app, ["generate", "-m", str(tmp_path / "missing"), "-p", "hi"])
    assert r.exit_code == 2
    assert "error:" in r.output and "not found" in r.output
    assert "Traceback" not in r.output


def test_generate_bad_sampling_flag(tiny_dirs):
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "-p", "hi", "--top-p", "0"])
    assert r.exit_code == 2 and "top_p must be in (0, 1]" in r.output


def test_bad_mode_is_rejected_by_the_parser(tiny_dirs):
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "-p", "hi", "--mode", "warp"])
    assert r.exit_code != 0 and "warp" in r.output


def test_demo_runs_and_shows_identical_output():
    r = runner.invoke(app, ["demo", "-n", "16"])
    assert r.exit_code == 0, r.output
    assert "identical" in r.output and "NO" not in r.output


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "dspark_lab", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "generate" in r.stdout


def test_generate_dspark_mode(tiny_dirs, tmp_path):
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"])
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "--mode", "dspark", "-p", "hello", "-n", "10", "--max-draft", "3"])
    assert r.exit_code == 0, r.output
    assert "10 tokens" in r.output


def test_generate_pipelined(tiny_dirs, tmp_path):
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"])
    plain = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "-p", "a b c a b c", "-n", "10"])
    args = ["generate", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "-p", "a b c a b c", "-n", "10", "--max-draft", "3"]
    r = runner.invoke(app, args + ["--mode", "dspark-pipe"])
    assert r.exit_code == 0, r.output
    assert "10 tokens" in r.output and r.output.splitlines()[0] == plain.output.splitlines()[0]
    r = runner.invoke(app, args + ["--mode", "dspark-pipe", "--lookup-drafts"])  # matched on the device
    assert r.exit_code == 0, r.output
    assert "10 tokens" in r.output and r.output.splitlines()[0] == plain.output.splitlines()[0]
    r = runner.invoke(app, args + ["--mode", "dspark-pipe", "--lookup-drafts", "--compile-draft", "--db", str(tmp_path / "k.duckdb")])
    assert r.exit_code == 0, r.output
    assert "10 tokens" in r.output and r.output.splitlines()[0] == plain.output.splitlines()[0]
    assert "lookup-kernel" not in r.output and not (tmp_path / "k.duckdb").exists()  # no CUDA: nothing to probe
    r = runner.invoke(app, args + ["--mode", "dspark-pipe", "--lookup-drafts", "--lookup-kernel"])
    assert r.exit_code != 0 and "no CUDA backend" in r.output
    r = runner.invoke(app, args + ["--mode", "dspark", "--compile-draft"])
    assert r.exit_code != 0 and "pipeline=True" in r.output


def test_generate_tree_mode(tiny_dirs, tmp_path):
    """--mode dspark-tree prints the plain decode's text; its options are refused where they mean nothing."""
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], markov_rank=0)
    plain = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "-p", "a b c a b c", "-n", "10"])
    args = ["generate", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "-p", "a b c a b c", "-n", "10"]
    for mode, extra in (("dspark-tree", []), ("dspark-tree", ["--tree-nodes", "5", "--max-draft", "2"]),
                        ("dspark-tree-pipe", ["--tree-nodes", "5", "--compile-draft"])):
        r = runner.invoke(app, args + ["--mode", mode] + extra)
        assert r.exit_code == 0, r.output
        assert "10 tokens" in r.output and r.output.splitlines()[0] == plain.output.splitlines()[0]
    r = runner.invoke(app, args + ["--mode", "dspark", "--tree-nodes", "5"])
    assert r.exit_code != 0 and "--tree-nodes is a --mode dspark-tree" in r.output
    r = runner.invoke(app, args + ["--mode", "dspark-tree", "--max-draft", "auto"])
    assert r.exit_code != 0 and "no cost curves for tree rounds" in r.output
    sampled = [runner.invoke(app, args + ["--mode", "dspark-tree-pipe", "--temperature", "0.7", "--seed", "3"]) for _ in range(2)]
    assert sampled[0].exit_code == 0 and "10 tokens" in sampled[0].output, sampled[0].output
    assert sampled[0].output.splitlines()[0] == sampled[1].output.splitlines()[0]  # seeded
    markov = build_tiny_dspark(tmp_path / "markov", tiny_dirs["qwen3"])
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "-d", str(markov), "-p", "hi", "--mode", "dspark-tree"])
    assert r.exit_code != 0 and "Markov term" in r.output


def test_generate_runs_the_head_it_is_given_without_a_mode(tiny_dirs, tmp_path):
    # A user who passes a head means it to draft: with --mode left out it runs in dspark mode
    # (it used to decode plainly and report an accept length of 1.00).
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"])
    common = ["generate", "-m", str(tiny_dirs["qwen3"]), "-p", "a b c a b c", "-n", "10"]
    plain = runner.invoke(app, common)
    inferred = runner.invoke(app, [*common, "-d", str(head), "--max-draft", "3"])
    explicit = runner.invoke(app, [*common, "-d", str(head), "--max-draft", "3", "--mode", "dspark"])
    assert inferred.exit_code == 0, inferred.output
    assert "--mode dspark (from --drafter)" in inferred.output
    assert inferred.stdout.splitlines()[0] == explicit.stdout.splitlines()[0] == plain.stdout.splitlines()[0]
    report = lambda r: re.search(r"\d+ tokens \(\w+\) in \d+ rounds, mean accept length [\d.]+", r.output).group()  # noqa: E731
    assert report(inferred) == report(explicit) != report(plain)  # the rounds of --mode dspark, not plain decoding's


def test_generate_runs_a_dflash_head_in_dflash_mode_without_a_mode(tiny_dirs, tmp_path):
    from dspark_lab.tiny import build_tiny_dflash

    head = build_tiny_dflash(tmp_path / "dflash", tiny_dirs["qwen3"])
    common = ["generate", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "-p", "a b c a b c", "-n", "8"]
    inferred, explicit = runner.invoke(app, common), runner.invoke(app, [*common, "--mode", "dflash"])
    assert inferred.exit_code == 0, inferred.output
    assert "--mode dflash (from --drafter)" in inferred.output
    report = lambda r: re.search(r"\d+ tokens \(\w+\) in \d+ rounds, mean accept length [\d.]+", r.output).group()  # noqa: E731
    assert report(inferred) == report(explicit)


@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_generate_refuses_a_head_its_mode_would_leave_unused(tiny_dirs, tmp_path, mode):
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"])
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "--mode", mode, "-p", "hello"])
    assert r.exit_code == 2 and f"this run is --mode {mode}" in r.output and "add --mode dspark" in r.output
    assert "Traceback" not in r.output


def test_generate_dspark_needs_a_drafter(tiny_dirs):
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "--mode", "dspark", "-p", "hello"])
    assert r.exit_code == 2 and "needs --drafter" in r.output


def test_generate_auto_without_registry_entry_falls_back_to_lookup(tiny_dirs):
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "--mode", "auto", "-p", "hello", "-n", "6"])
    assert r.exit_code == 0, r.output
    assert "no measured drafter" in r.output and "Using lookup decoding" in r.output


def test_generate_auto_runs_the_registry_pair_with_its_measured_loop_options(tiny_dirs, tmp_path, monkeypatch):
    """--mode auto takes the registry's head, mode and cap, and the loop options the pair was measured
    with (dspark-pipe: device lookup drafts, the compiled draft) unless the command line sets them."""
    import dspark_lab.engine as engine_mod
    from dspark_lab.engine import speculative as spec_mod
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4)
    entry = {"model_id": str(tiny_dirs["qwen3"]), "mode": "dspark-pipe", "drafter": str(head), "cap": 3,
             "speedup": 1.8206, "trials": 6, "device": "NVIDIA H200 (cuda)", "run_ids": ["r"], "date": "2026-12-03",
             "options": {"lookup_drafts": True, "compile_draft": True}}
    from dspark_lab.engine.names import target_key

    entry["target"] = target_key(str(tiny_dirs["qwen3"]))
    monkeypatch.setattr(spec_mod, "read_registry", lambda path=None: [entry])
    seen = []
    real = engine_mod.speculative_generate
    monkeypatch.setattr(engine_mod, "speculative_generate", lambda *a, **k: seen.append(k) or real(*a, **k))
    args = ["generate", "-m", str(tiny_dirs["qwen3"]), "--mode", "auto", "-p", "hello", "-n", "6"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "auto: dspark-pipe drafter" in r.output and "measured with lookup_drafts=True, compile_draft=True" in r.output
    assert "measured 1.82x over 6 trials" in r.output  # two decimals, as every table prints a speedup
    assert (seen[-1]["pipeline"], seen[-1]["lookup_drafts"], seen[-1]["compile_draft"], seen[-1]["max_draft_tokens"]) == (True, True, True, 3)
    r = runner.invoke(app, args + ["--no-compile-draft", "--no-lookup-drafts"])  # the command line wins
    assert r.exit_code == 0, r.output
    assert (seen[-1]["lookup_drafts"], seen[-1]["compile_draft"]) == (False, False)


def test_generate_auto_runs_a_registry_tree_row_as_measured(tiny_dirs, tmp_path, monkeypatch):
    """A dspark-tree-pipe row (the shipped registry's H100 rows since the fiftieth round): --mode
    auto runs the pipelined trees at the row's cap with its tree size and compiled draft, losslessly."""
    import dspark_lab.engine as engine_mod
    from dspark_lab.engine import greedy_generate, load_target
    from dspark_lab.engine import speculative as spec_mod
    from dspark_lab.engine.names import target_key
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4, markov_rank=0)
    entry = {"model_id": str(tiny_dirs["qwen3"]), "target": target_key(str(tiny_dirs["qwen3"])), "mode": "dspark-tree-pipe",
             "drafter": str(head), "cap": 3, "speedup": 1.75, "trials": 48, "device": "NVIDIA H100 80GB HBM3 (cuda)",
             "run_ids": ["r"], "date": "2026-12-07", "options": {"tree_nodes": 6, "lookup_drafts": False, "compile_draft": True}}
    monkeypatch.setattr(spec_mod, "read_registry", lambda path=None: [entry])
    seen, results = [], []
    real = engine_mod.speculative_generate
    monkeypatch.setattr(engine_mod, "speculative_generate", lambda *a, **k: seen.append(k) or results.append(real(*a, **k)) or results[-1])
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "--mode", "auto", "-p", "hello", "-n", "8", "--no-chat-template"])
    assert r.exit_code == 0, r.output
    assert "auto: dspark-tree-pipe drafter" in r.output and "tree_nodes=6" in r.output
    k = seen[-1]
    assert (k["pipeline"], k["tree_nodes"], k["compile_draft"], k["max_draft_tokens"]) == (True, 6, True, 3)
    target, tok = load_target(tiny_dirs["qwen3"])
    assert results[-1].token_ids == greedy_generate(target, tok, tok.encode("hello"), max_new_tokens=8).token_ids


def test_doctor_prints_stamp_and_checks():
    r = runner.invoke(app, ["doctor"])
    assert r.exit_code == 0, r.output
    assert "mlx_version" in r.output and "ok" in r.output


def test_calibrate_lookup_stores_and_reuses(tiny_dirs, tmp_path):
    args = ["calibrate", "-m", str(tiny_dirs["qwen3"]), "--mode", "lookup", "--db", str(tmp_path / "r.duckdb"), "--repeats", "2", "--max-draft", "3"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "cost curves" in r.output and "verify fit: knee" in r.output and "static cap" in r.output
    r = runner.invoke(app, args)
    assert "(stored, reused)" in r.output


def test_calibrate_dspark_validate(tiny_dirs, tmp_path):
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], block_size=3)
    r = runner.invoke(app, ["calibrate", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "--db", str(tmp_path / "r.duckdb"),
                            "--repeats", "2", "--validate"])
    assert r.exit_code == 0, r.output
    assert "validation" in r.output and "controller's cap" in r.output


def test_calibrate_a_pipelined_mode(tiny_dirs, tmp_path):
    """--mode dspark-pipe, as generate and sweep spell it, measures the pipelined loop's own parts
    under their own key (mode dspark then measures its plain loop's); draft-pipe shares mode
    draft's curves and says so; --compile-draft belongs to dspark-pipe alone."""
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], block_size=3)
    db = str(tmp_path / "r.duckdb")
    base = ["calibrate", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "--db", db, "--repeats", "2"]
    r = runner.invoke(app, base + ["--mode", "dspark-pipe", "--compile-draft"])
    assert r.exit_code == 0, r.output
    assert "the pipelined loop's parts" in r.output and "(stored, reused)" not in r.output
    r = runner.invoke(app, base + ["--mode", "dspark-pipe", "--compile-draft"])
    assert r.exit_code == 0 and "(stored, reused)" in r.output
    r = runner.invoke(app, base)
    assert r.exit_code == 0 and "(stored, reused)" not in r.output  # mode dspark: the plain loop's own curves
    r = runner.invoke(app, base + ["--compile-draft"])
    assert r.exit_code == 2 and "applies to --mode dspark-pipe" in r.output
    r = runner.invoke(app, base + ["--lookup-drafts"])
    assert r.exit_code == 2 and "--lookup-drafts times the pipelined loop's rounds" in r.output
    r = runner.invoke(app, base + ["--mode", "dspark-pipe", "--compile-draft", "--lookup-drafts"])
    assert r.exit_code == 0 and "(stored, reused)" not in r.output  # the lookup overlay: rounds of their own
    r = runner.invoke(app, ["calibrate", "-m", str(tiny_dirs["qwen3"]), "--db", db, "--mode", "draft-pipe"])
    assert r.exit_code == 2 and "--mode draft-pipe needs --draft-model DIR" in r.output
    r = runner.invoke(app, ["calibrate", "-m", str(tiny_dirs["qwen3"]), "--db", db, "--mode", "dspark-pipe"])
    assert r.exit_code == 2 and "--mode dspark-pipe needs --drafter DIR" in r.output


def test_calibrate_dspark_needs_drafter(tiny_dirs, tmp_path):
    r = runner.invoke(app, ["calibrate", "-m", str(tiny_dirs["qwen3"]), "--db", str(tmp_path / "r.duckdb")])
    assert r.exit_code == 2 and "needs --drafter" in r.output


@pytest.mark.parametrize("mode", ["lookup", "dspark"])
def test_generate_with_auto_cap(tiny_dirs, tmp_path, mode):
    from dspark_lab.tiny import build_tiny_dspark

    args = ["generate", "-m", str(tiny_dirs["qwen3"]), "--mode", mode, "-p", "a b c a b c a b c", "-n", "12",
            "--max-draft", "auto", "--db", str(tmp_path / "r.duckdb")]
    if mode == "dspark":
        args += ["-d", str(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], block_size=3))]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "caps chosen per round" in r.output and "12 tokens" in r.output


def test_generate_bad_max_draft(tiny_dirs):
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "--mode", "lookup", "-p", "x", "--max-draft", "lots"])
    assert r.exit_code == 2 and "must be a number or 'auto'" in r.output


def test_benchmark_report_and_registry_verbs(tiny_dirs, tmp_path):
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=384, repeat_bias=20.0, block_size=3)
    db = tmp_path / "b.duckdb"
    r = runner.invoke(app, ["benchmark", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "--caps", "2", "--trials", "1",
                            "--prompts", "code", "--prompt-limit", "2", "-n", "8", "--db", str(db), "--json", str(tmp_path / "res.json")])
    assert r.exit_code == 0, r.output
    assert "speedup" in r.output and "dspark" in r.output and "2/2" in r.output and (tmp_path / "res.json").exists()
    # mlx-lm's own decoder ran beside ours on the same prompts (a reference row, no cap), with the same tokens
    ref_row = next(line for line in r.output.splitlines() if "mlx-lm" in line and "code" in line)
    assert "2/2" in ref_row and "NOT" not in ref_row, r.output
    r = runner.invoke(app, ["report", "--db", str(db), "--out", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "r.html").read_text().count("vega") > 3
    r = runner.invoke(app, ["registry", "build", "--db", str(db), "--out", str(tmp_path / "reg.json"), "--min-trials", "1"])
    assert r.exit_code == 0, r.output
    assert "mlx-lm" not in (tmp_path / "reg.json").read_text()  # a reference, never a registry's best arm
    r = runner.invoke(app, ["registry", "show", str(tmp_path / "reg.json"), "--markdown"])
    assert r.exit_code == 0 and "|" in r.output
    r = runner.invoke(app, ["report", "--db", str(tmp_path / "none.duckdb"), "--out", str(tmp_path / "x.html")])
    assert r.exit_code == 2 and "no database" in r.output


def test_head_modes_tell_a_dspark_head_from_a_dflash_head(tiny_dirs, tmp_path):
    # A sweep or benchmark whose --modes are left out runs each head in its own kind's modes,
    # instead of loading a DSpark head in dflash mode only to print that it skips it.
    from dspark_lab.cli import _head_modes
    from dspark_lab.engine.drafters.load import head_modes
    from dspark_lab.tiny import build_tiny_dflash, build_tiny_dspark

    dspark = build_tiny_dspark(tmp_path / "dspark", tiny_dirs["qwen3"])
    dflash = build_tiny_dflash(tmp_path / "dflash", tiny_dirs["qwen3"])
    causal = build_tiny_dspark(tmp_path / "causal", tiny_dirs["qwen3"], layout="dflash-causal")
    assert head_modes(dspark) == head_modes(causal) == ("dspark", "dspark-pipe")
    assert head_modes(dflash) == ("dflash",)
    assert head_modes(tmp_path / "missing") == ("dspark", "dspark-pipe", "dflash")  # unreadable here: the loader decides
    assert _head_modes([str(dflash), str(dspark)]) == ["dspark", "dspark-pipe", "dflash"]
    assert _head_modes([]) == []


def test_benchmark_runs_a_dspark_head_in_its_own_modes_only(tiny_dirs, tmp_path):
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"])
    r = runner.invoke(app, ["benchmark", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "--caps", "2", "--trials", "1",
                            "--prompts", "code", "--prompt-limit", "1", "-n", "4", "--no-mlx-lm", "--db", str(tmp_path / "b.duckdb")])
    assert r.exit_code == 0, r.output
    assert "skipping" not in r.output and "dflash" not in r.output
    assert "dspark-pipe" in r.output and "dspark " in r.output
    assert "compiled-step" not in r.output


def test_benchmark_times_the_compiled_step_beside_the_plain_one_when_asked(tiny_dirs, tmp_path):
    """--compiled-step adds both steps as rows beside the baseline, and the table says how the
    baseline itself stepped (--baseline-step: here forced compiled, off CUDA)."""
    r = runner.invoke(app, ["benchmark", "-m", str(tiny_dirs["qwen3"]), "--caps", "2", "--trials", "1", "--prompts", "code",
                            "--prompt-limit", "1", "-n", "4", "--no-mlx-lm", "--compiled-step", "--baseline-step", "compiled",
                            "--db", str(tmp_path / "c.duckdb")])
    assert r.exit_code == 0, r.output
    assert "compiled-step" in r.output and "plain-step" in r.output and "lookup" in r.output
    assert "compiled one-row steps" in " ".join(r.output.split())


def test_benchmark_adds_tree_arms_when_asked(tiny_dirs, tmp_path):
    from dspark_lab.tiny import build_tiny_dspark

    head = build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0)
    args = ["benchmark", "-m", str(tiny_dirs["qwen3"]), "--caps", "2", "--trials", "1", "--prompts", "code", "--prompt-limit", "1",
            "-n", "4", "--no-mlx-lm", "--tree-nodes", "5"]
    r = runner.invoke(app, args + ["-d", str(head), "--db", str(tmp_path / "b.duckdb")])
    assert r.exit_code == 0, r.output
    assert "dspark-tree " in r.output and "dspark-tree-pipe" in r.output and "dspark-pipe" in r.output
    r = runner.invoke(app, args + ["--db", str(tmp_path / "c.duckdb")])
    assert r.exit_code != 0 and "--tree-nodes needs a DSpark head" in r.output
