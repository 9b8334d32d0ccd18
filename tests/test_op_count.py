"""benchmarks/op_count.py and benchmarks/launch_overlap.py on a tiny random pair: op_count counts
each part's graph and times its construction (a round's verify builds at least a plain step's
operations); launch_overlap runs every arm and finds the outputs identical at every setting."""

import pytest

from dspark_lab.tiny import build_tiny_dspark

from scripts import load_script


def test_counts_and_build_times_of_a_round(tiny_dirs, tmp_path):
    mod = load_script("op_count")
    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4)
    r = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--caps", "1,3", "--repeats", "2",
                  "--context", "16", "--json", str(tmp_path / "r.json")])
    assert r["greedy_step_total"] > 0 and r["greedy_build_ms"] > 0
    assert [row["cap"] for row in r["rounds"]] == [1, 3]
    for row in r["rounds"]:
        assert row["draft_total"] > 0 and row["accept_trim_append_total"] > 0
        assert row["verify_total"] >= r["greedy_step_total"]  # the same forward, wider, plus the accept rule
        assert row["round_total"] == row["draft_total"] + row["verify_total"] + row["accept_trim_append_total"]
        assert 0 < row["device_lookup_total"] < row["verify_total"]
        assert 0 < row["pipe_draft_step_compiled_total"] < row["pipe_draft_step_total"]  # the trace fuses chains
    assert (tmp_path / "r.json").exists()


def test_launch_overlap_benchmark_runs_and_outputs_match(tiny_dirs, tmp_path):
    mod = load_script("launch_overlap")
    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4)
    r = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--every", "0,1", "--cap", "3", "--prompts", "code",
                  "--limit", "1", "--max-new-tokens", "8", "--repeats", "1"])
    runs = [row for row in r["rows"] if row["kind"] != "ratio"]
    assert {row["arm"] for row in runs} == {"greedy@0", "spec@0", "greedy@1", "spec@1"}
    assert all(row["identical_to_first"] and row["tok_s"] > 0 for row in runs)
    ratios = {row["arm"]: row for row in r["rows"] if row["kind"] == "ratio"}
    assert set(ratios) == {"speedup@0", "speedup@1"}
    assert all(row["spec_over_greedy"] > 0 and row["mean_accept_len"] >= 1 for row in ratios.values())


def test_pipeline_speed_benchmark_runs_every_arm(tiny_dirs, tmp_path):
    """benchmarks/pipeline_speed.py: every arm runs (none is dropped for failing), and on the CPU
    in float32 every arm's tokens are our greedy tokens; the pipelined arm equals the plain loop."""
    mod = load_script("pipeline_speed")
    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4)
    r = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--caps", "3", "--prompts", "code", "--limit", "1",
                  "--max-new-tokens", "8", "--repeats", "1", "--no-compile", "--copy-mib", "16"])
    rows = {row["arm"]: row for row in r["rows"]}
    assert set(rows) == {"mlx_lm", "greedy", "dspark@3", "dspark+lk@3", "pipe@3", "pipe+lk@3", "pipe+cd@3", "pipe+lk+cd@3"}
    assert all(row["identical_to_greedy"] == "1/1" and row["tok_s"] > 0 for name, row in rows.items() if name != "mlx_lm")
    assert all(rows[a]["identical_to_plain_loop"] == "1/1" for a in ("pipe@3", "pipe+lk@3", "pipe+cd@3", "pipe+lk+cd@3"))
    # Each rate as a share of the bandwidth limit, which the limit itself reproduces.
    assert r["limit_tok_s"] > 0 and r["copy_bandwidth_gb_s"] > 0 and r["weight_bytes"] > 0
    assert all(row["fraction_of_limit"] == pytest.approx(row["tok_s"] / r["limit_tok_s"], rel=1e-2) for row in r["rows"])


def test_pipeline_speed_runs_only_the_arms_asked_for(tiny_dirs, tmp_path):
    """--arms names the speculative arms to time (a short device session cannot afford them all);
    the baselines always run, and an unknown arm is refused with the names to choose from."""
    mod = load_script("pipeline_speed")
    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4)
    args = ["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--caps", "2,3", "--prompts", "code", "--limit", "1",
            "--max-new-tokens", "8", "--repeats", "1", "--no-compile", "--copy-mib", "16"]
    r = mod.main(args + ["--arms", "dspark,pipe+cd"])
    rows = {row["arm"]: row for row in r["rows"]}
    assert set(rows) == {"mlx_lm", "greedy", "dspark@2", "pipe+cd@2", "dspark@3", "pipe+cd@3"}
    assert rows["pipe+cd@3"]["identical_to_plain_loop"] == "1/1"  # still compared with the plain loop's arm
    with pytest.raises(SystemExit, match="unknown arm.*pipe-cd.*choose from"):
        mod.main(args + ["--arms", "pipe-cd"])


def test_pipeline_speed_classifies_an_output_that_differs_from_greedy(tiny_dirs, tmp_path, monkeypatch):
    """An arm whose tokens leave greedy's is reported with its first difference, and a changed
    token that is no near-tie is counted as NOT a tie (what a real bug would look like)."""
    import dataclasses

    import dspark_lab

    mod = load_script("pipeline_speed")
    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4)
    real = dspark_lab.speculative_generate

    def broken_plain_loop(*a, **kw):  # the plain loop without lookup emits a wrong 4th token
        r = real(*a, **kw)
        if kw.get("pipeline") or kw.get("lookup_drafts"):
            return r
        ids = list(r.token_ids)
        ids[3] = (ids[3] + 1) % 300
        return dataclasses.replace(r, token_ids=ids)

    monkeypatch.setattr(dspark_lab, "speculative_generate", broken_plain_loop)
    r = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--caps", "3", "--prompts", "code", "--limit", "1",
                  "--max-new-tokens", "8", "--repeats", "1", "--no-compile", "--copy-mib", "16"])
    rows = {row["arm"]: row for row in r["rows"]}
    bad = rows["dspark@3"]
    assert bad["identical_to_greedy"] == "0/1" and (bad["not_ties"], bad["ties"], bad["length_only"]) == (1, 0, 0)
    assert bad["differences_from_greedy"][0]["index"] == 3 and bad["differences_from_greedy"][0]["prefill_picks"] == "a"
    assert rows["pipe@3"]["identical_to_plain_loop"] == "0/1"  # the pipelined loop kept greedy's tokens
    assert all(row["differences_from_greedy"] == [] for name, row in rows.items() if name not in ("dspark@3", "mlx_lm"))


def test_pipeline_speed_times_a_dequantized_copy_beside_the_quantized_target(tmp_path):
    """--dequantized: dq: arms on the dense copy of a 4-bit target, their share of a bandwidth limit
    of their own (more bytes), their tokens our greedy's (float32 CPU: no ties to fall either way)."""
    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    head = build_tiny_dspark(tmp_path / "head", model, block_size=4)
    mod = load_script("pipeline_speed")
    r = mod.main(["--model", str(model), "--head", str(head), "--caps", "3", "--prompts", "code", "--limit", "1",
                  "--max-new-tokens", "8", "--repeats", "1", "--no-compile", "--copy-mib", "16", "--dequantized"])
    rows = {row["arm"]: row for row in r["rows"]}
    assert {"dq:mlx_lm", "dq:greedy", "dq:pipe+cd@3"} <= set(rows)
    assert rows["dq:greedy"]["identical_to_greedy"] == "1/1" and rows["dq:pipe+cd@3"]["identical_to_greedy"] == "1/1"
    assert rows["dq:pipe+cd@3"]["identical_to_plain_loop"] is None  # no plain-loop arm on the copy was asked for
    dq = rows["dq:greedy"]
    assert dq["fraction_of_limit"] > dq["tok_s"] / r["limit_tok_s"] * 1.01  # the copy reads more bytes: a lower limit
    assert r["copies"]["dq:"]["weight_bytes"] > r["weight_bytes"]


def test_pipeline_speed_precision_grid_times_each_precision_against_its_own_greedy(tmp_path):
    """--precisions 8,16 with --arms: every precision gets mlx_lm, greedy and the arms asked for; a
    copy's speculative arms equal that copy's greedy token for token and are divided by it; the
    8-bit copy reads more bytes than the 4-bit file and fewer than the float one, and its greedy,
    on other weights, is counted against the as-loaded greedy, never classified as a tie or a bug."""
    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    head = build_tiny_dspark(tmp_path / "head", model, block_size=4)
    mod = load_script("pipeline_speed")
    r = mod.main(["--model", str(model), "--head", str(head), "--caps", "3", "--prompts", "code", "--limit", "1",
                  "--max-new-tokens", "8", "--repeats", "1", "--no-compile", "--copy-mib", "16", "--precisions", "8,16",
                  "--arms", "pipe+lk+cd"])
    rows = {row["arm"]: row for row in r["rows"]}
    assert set(rows) == {f"{p}{a}" for p in ("", "q8:", "dq:") for a in ("mlx_lm", "greedy", "pipe+lk+cd@3")}
    for p in ("", "q8:", "dq:"):
        spec = rows[f"{p}pipe+lk+cd@3"]
        assert spec["identical_to_greedy"] == "1/1" and spec["differences_from_greedy"] == []
        assert spec["vs_greedy"] == pytest.approx(spec["tok_s"] / rows[f"{p}greedy"]["tok_s"], rel=1e-2)
        assert spec["vs_mlx_lm"] == pytest.approx(spec["tok_s"] / rows[f"{p}mlx_lm"]["tok_s"], rel=1e-2)
    assert r["weight_bytes"] < r["copies"]["q8:"]["weight_bytes"] < r["copies"]["dq:"]["weight_bytes"]
    assert rows["q8:greedy"]["other_weights"] and rows["q8:greedy"]["not_ties"] == 0
    assert not rows["dq:greedy"]["other_weights"]
    with pytest.raises(SystemExit, match="--precisions.*choose from 8 and 16"):
        mod.main(["--model", str(model), "--head", str(head), "--precisions", "4"])


def test_load_target_quantize_stores_the_layers_at_those_bits(tmp_path):
    """load_target(quantize=8) on a 4-bit file: 8-bit layers holding nearly the same values (logits
    close to the file's), in more bytes; unsupported bits are refused with the choices."""
    import mlx.core as mx
    import mlx.nn as nn

    from dspark_lab import load_target
    from dspark_lab.engine.loading import LoadError
    from dspark_lab.lab.bandwidth import decode_bytes
    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    q4, _ = load_target(model)
    q8, _ = load_target(model, quantize=8)
    bits = {m.bits for _, m in q8.model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    assert bits == {8}
    assert decode_bytes(q4)[0] < decode_bytes(q8)[0]
    ids = mx.array([[1, 5, 9, 13, 2, 7]])
    a, b = q4.model(ids), q8.model(ids)
    assert mx.allclose(a, b, atol=0.05 * mx.abs(a).max().item()).item()
    with pytest.raises(LoadError, match="quantize=7 is not supported.*2, 3, 4, 5, 6, 8"):
        load_target(model, quantize=7)


def test_chain_agreement_counts_where_text_leaves_the_targets_path(tiny_dirs, tmp_path):
    """benchmarks/chain_agreement.py: on the target's own greedy output every position follows it
    and every slot is kept; on a copy whose text departs, the shares fall."""
    import json

    from conftest import PROMPTS
    from dspark_lab import greedy_generate, load_target
    from dspark_lab.engine.text import encode_prompt

    target, tok = load_target(tiny_dirs["qwen3"])
    rows = []
    for i, p in enumerate(PROMPTS[:2]):
        ids = encode_prompt(tok, p)
        out = greedy_generate(target, tok, ids, max_new_tokens=24).token_ids
        rows.append({"ids": ids + out, "prompt_len": len(ids), "set": "code", "prompt_id": str(i), "generation": "greedy"})
        bent = list(out)
        bent[5::6] = [(t + 1) % target.vocab_size for t in bent[5::6]]  # the text leaves the target's path
        rows.append({"ids": ids + bent, "prompt_len": len(ids), "set": "corpus:sharegpt", "prompt_id": str(i), "generation": "corpus"})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = load_script("chain_agreement").main(["--model", str(tiny_dirs["qwen3"]), "--data", str(data), "--block", "4"])
    assert r["generated"]["text_follows_target"] == 1.0 and r["generated"]["slots_kept"] == [1.0] * 4
    bent = r["corpus:sharegpt"]
    assert bent["text_follows_target"] < 1.0 and bent["slots_kept"][0] == 1.0
    assert bent["slots_kept"] == sorted(bent["slots_kept"], reverse=True) and bent["slots_kept"][3] < 1.0


def test_distill_step_benchmark_splits_a_real_training_step(tiny_dirs, tmp_path):
    """benchmarks/distill_step.py (which anchor count a step affords): one row per anchor count,
    the target's forward and the head's step both measured, a finite loss, and more anchors
    needing more memory."""
    import gzip
    import json
    import random

    mod = load_script("distill_step")
    rng = random.Random(0)
    rows = [{"ids": [rng.randrange(1, 200) for _ in range(rng.randrange(80, 120))], "prompt_len": 10, "generation": "corpus"}
            for _ in range(20)]
    data = tmp_path / "data.jsonl.gz"
    with gzip.open(data, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = mod.main(["--model", str(tiny_dirs["qwen3"]), "--data", str(data), "--seqs", "2", "--anchors", "4,64",
                    "--block", "4", "--layers", "1", "--markov-rank", "8", "--max-len", "128", "--steps", "1",
                    "--json", str(tmp_path / "r.json")])
    assert [(r["anchors"], r["gather"]) for r in out] == [(4, False), (4, True), (64, False), (64, True)]
    for r in out:
        assert r["target_forward_ms"] > 0 and r["head_step_ms"] > 0 and 0 < r["loss"] < 50
    for full, gathered in (out[:2], out[2:]):  # same head, same batches: the same loss either way
        assert gathered["loss"] == pytest.approx(full["loss"], abs=2e-3)
        assert 0 < gathered["labelled_slots"] <= gathered["slots"]
    assert out[2]["peak_bytes"] > out[0]["peak_bytes"]
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == out


def _step_data(tmp_path, seed: int, length: int, n: int = 8):
    """A distill data file of n read-corpus rows of random tokens, for distill_step.py."""
    import gzip
    import json
    import random

    rng = random.Random(seed)
    rows = [{"ids": [rng.randrange(1, 200) for _ in range(length)], "prompt_len": 10, "generation": "corpus"} for _ in range(n)]
    data = tmp_path / "data.jsonl.gz"
    with gzip.open(data, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return data


def test_distill_step_benchmark_times_the_target_as_loaded_and_dequantized(tmp_path):
    """--weights as-loaded,dequantized: the same step on a quantized target and on its dense copy;
    the same weights, so the same loss up to summation order."""
    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=2, quantize_bits=4)
    mod = load_script("distill_step")
    data = _step_data(tmp_path, seed=1, length=90)
    args = ["--model", str(model), "--data", str(data), "--seqs", "2", "--anchors", "16", "--block", "4", "--layers", "1",
            "--markov-rank", "8", "--max-len", "128", "--steps", "1"]
    out = mod.main(args + ["--weights", "as-loaded,dequantized"])
    assert [(r["weights"], r["gather"]) for r in out] == [("as-loaded", False), ("as-loaded", True),
                                                          ("dequantized", False), ("dequantized", True)]
    assert out[2]["loss"] == pytest.approx(out[0]["loss"], abs=1e-2)
    with pytest.raises(SystemExit):
        mod.main(args + ["--weights", "dense"])


def test_distill_step_benchmark_times_float32_and_bfloat16_compute(tiny_dirs, tmp_path, capsys):
    """--compute float32,bfloat16: distill's --compute-dtype, timed on the same head and batches;
    the losses agree to bfloat16 rounding, and an unknown dtype is refused by name."""
    mod = load_script("distill_step")
    data = _step_data(tmp_path, seed=2, length=100)
    common = ["--model", str(tiny_dirs["qwen3"]), "--data", str(data), "--seqs", "2", "--anchors", "16", "--block", "4",
              "--layers", "1", "--markov-rank", "8", "--max-len", "128", "--steps", "1"]
    out = mod.main(common + ["--compute", "float32,bfloat16"])
    assert [(r["compute"], r["gather"]) for r in out] == [("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True)]
    assert all(r["head_step_ms"] > 0 for r in out)
    assert out[3]["loss"] == pytest.approx(out[1]["loss"], rel=5e-2)
    with pytest.raises(SystemExit):
        mod.main(common + ["--compute", "float16"])
    assert "--compute must be float32 or bfloat16" in capsys.readouterr().err


def test_distill_step_benchmark_times_soft_labels_beside_the_greedy_token(tiny_dirs, tmp_path):
    """--soft-labels 0,4: distill's soft labels timed beside the hard ones on the same head and
    batches; projecting only the labelled slots gives the same soft loss as projecting every slot."""
    mod = load_script("distill_step")
    data = _step_data(tmp_path, seed=3, length=100)
    out = mod.main(["--model", str(tiny_dirs["qwen3"]), "--data", str(data), "--seqs", "2", "--anchors", "16", "--block", "4",
                    "--layers", "1", "--markov-rank", "8", "--max-len", "128", "--steps", "1", "--soft-labels", "0,4"])
    assert [(r["soft_labels"], r["gather"]) for r in out] == [(0, False), (0, True), (4, False), (4, True)]
    assert all(r["target_forward_ms"] > 0 and 0 < r["loss"] < 50 for r in out)
    assert out[3]["loss"] == pytest.approx(out[2]["loss"], abs=2e-3)
    assert out[2]["loss"] != pytest.approx(out[0]["loss"], abs=1e-3)  # another objective, not the hard one relabelled
