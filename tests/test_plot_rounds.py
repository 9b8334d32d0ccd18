"""benchmarks/plot_distill_rounds.py: per-set means of evaluation JSONs, in round order, charted."""

import json

import pytest

from scripts import load_script

plot = load_script("plot_distill_rounds")


def _eval(path, model, accepts):
    rows = [{"prompt": f"{s}-{i}", "set": s, "arm": "dspark", "mean_accept": a} for s, values in accepts.items() for i, a in enumerate(values)]
    path.write_text(json.dumps({"model": model, "rows": rows}))
    return path


def test_rounds_are_summarized_per_set_in_round_order_and_rendered(tmp_path):
    late = _eval(tmp_path / "eval10_qwen05_b.json", "/root/ship/qwen05/qwen2.5-coder-0.5b-q4-bfloat16", {"code": [2.0, 3.0], "chat": [2.5]})
    early = _eval(tmp_path / "eval2_qwen05.json", "/root/ship/qwen05/qwen2.5-coder-0.5b-q4-bfloat16", {"code": [1.0, 1.5]})
    smol = _eval(tmp_path / "eval3_smol.json", "/x/smollm2-135m", {"code": [1.9]})
    out = tmp_path / "rounds.png"
    rows = plot.main([str(late), str(smol), str(early), "--out", str(out)])
    assert [(r["run"], r["set"], r["mean_accept"], r["prompts"]) for r in rows] == [
        ("2_qwen05", "code", 1.25, 2), ("3_smol", "code", 1.9, 1), ("10_qwen05_b", "chat", 2.5, 1), ("10_qwen05_b", "code", 2.5, 2)]
    assert {r["model"] for r in rows} == {"qwen2.5-coder-0.5b", "smollm2-135m"}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    spec = plot.chart(rows).to_dict()
    qwen = spec["vconcat"][0]
    assert qwen["layer"][1]["data"]["values"] == [{"set": "code", "goal": 3.0}, {"set": "math", "goal": 3.0}, {"set": "chat", "goal": 2.0},
                                                   {"set": "math (no twin)", "goal": 3.0}]


def test_a_math_bar_leaves_out_the_prompts_a_training_template_copies(tmp_path):
    """math-001 has a twin among the synthetic math families (MIRRORED_PROMPTS), and so has math-007
    (dice, the coin-flip family's sentence); math-003 has none."""
    f = tmp_path / "eval9_q.json"
    f.write_text(json.dumps({"model": "/m/qwen2.5-coder-0.5b-q4-bfloat16", "rows": [
        {"prompt": "math-001", "set": "math", "arm": "dspark", "mean_accept": 4.0},
        {"prompt": "math-003", "set": "math", "arm": "dspark", "mean_accept": 2.0}]}))
    rows = {r["set"]: r for r in plot.summarize([f])}
    assert not plot.math_without_twin({"set": "math", "prompt": "math-001"}) and plot.math_without_twin({"set": "math", "prompt": "math-003"})
    assert not plot.math_without_twin({"set": "math", "prompt": "math-007"}) and plot.math_without_twin({"set": "math", "prompt": "math-008"})
    assert rows["math"]["mean_accept"] == 3.0 and rows["math (no twin)"]["mean_accept"] == 2.0
    assert rows["math (no twin)"]["prompts"] == 1


def test_files_without_evaluated_prompts_are_a_clear_error(tmp_path):
    empty = tmp_path / "eval1_x.json"
    empty.write_text(json.dumps({"model": "m", "rows": []}))
    with pytest.raises(SystemExit):
        plot.main([str(empty), "--out", str(tmp_path / "x.png")])


def test_precision_grid_is_summarized_per_precision_and_rendered(tmp_path):
    """benchmarks/plot_precision_grid.py: pipeline_speed's --precisions JSON as one row per arm and
    precision, speculative arms marked, and a PNG; a run without copies is refused with the fix."""
    grid = load_script("plot_precision_grid")
    rows = [{"arm": a, "tok_s": t, "vs_greedy": g, "fraction_of_limit": f} for a, t, g, f in [
        ("mlx_lm", 290.0, 0.94, 0.031), ("greedy", 309.0, 1.0, 0.033), ("pipe+lk+cd@7", 468.0, 1.51, 0.05),
        ("q8:greedy", 292.0, 0.94, 0.059), ("q8:pipe+lk+cd@7", 526.0, 1.80, 0.107), ("dq:greedy", 232.0, 0.75, 0.089)]]
    result = {"model": "/m/qwen2.5-coder-0.5b-q4-bfloat16", "head": "/h/head", "prompts": 6, "max_new_tokens": 128, "repeats": 2,
              "device": "Device(gpu, 0)", "rows": rows, "copies": {"q8:": {}, "dq:": {}}}
    path = tmp_path / "precision.json"
    path.write_text(json.dumps(result))
    out = tmp_path / "grid.png"
    got = grid.main([str(path), "--out", str(out)])
    assert [(r["precision"], r["arm"], r["speculative"]) for r in got] == [
        ("as loaded (4-bit)", "mlx_lm", False), ("as loaded (4-bit)", "greedy", False), ("as loaded (4-bit)", "pipe+lk+cd@7", True),
        ("8-bit copy", "greedy", False), ("8-bit copy", "pipe+lk+cd@7", True), ("dequantized copy", "greedy", False)]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path.write_text(json.dumps({**result, "copies": {}}))
    with pytest.raises(SystemExit):
        grid.main([str(path), "--out", str(out)])


def test_held_accept_chart_puts_the_three_measures_of_one_head_side_by_side_per_set(tmp_path):
    """benchmarks/plot_held_accept.py: a block_accept.py JSON's path and all-anchor means per
    set, the held-out sets read as the built-in set they end in, beside the built-in decode's."""
    held = load_script("plot_held_accept")
    head = {"mean_accept": 3.0, "by_set": {"held30_code": 3.4, "held30_chat": 2.4},
            "path": {"mean_accept": 2.7, "by_set": {"held30_code": 3.0, "held30_chat": 2.2}}}
    ba = tmp_path / "held.json"
    ba.write_text(json.dumps({"heads": {"/root/ship/data/head": head, "/tmp/other": dict(head, by_set={"held30_code": 9.0})}}))
    builtin = _eval(tmp_path / "eval29.json", "/m/qwen2.5-coder-1.5b-q4-bfloat16", {"code": [2.5, 2.6], "chat": [1.8]})
    out = tmp_path / "held.png"
    rows = held.main([str(ba), "--builtin", str(builtin), "--out", str(out)])
    got = {(r["set"], r["measure"]): r["mean_accept"] for r in rows}
    assert got == {("code", held.MEASURES[1]): 3.0, ("chat", held.MEASURES[1]): 2.2, ("code", held.MEASURES[2]): 3.4,
                   ("chat", held.MEASURES[2]): 2.4, ("code", held.MEASURES[0]): 2.55, ("chat", held.MEASURES[0]): 1.8}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {r["mean_accept"] for r in held.main([str(ba), "--head", "other", "--out", str(out)]) if r["set"] == "code"} == {3.0, 9.0}
    with pytest.raises(SystemExit, match="no head"):
        held.main([str(ba), "--head", "missing", "--out", str(out)])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"heads": {"h": {"by_set": {}}}}))  # measured before the path was
    with pytest.raises(SystemExit):
        held.main([str(old), "--out", str(out)])


def test_accept_by_position_walks_the_decode_path_and_bins_rounds_by_where_they_start(tmp_path):
    """benchmarks/plot_accept_by_position.py: a --anchors-out file's rows walked as the decode
    would (the same rounds as lab/block_accept.decode_path), a decoded JSON's rounds placed by
    their commits, both binned by the answer position each round starts at."""
    import gzip

    from dspark_lab.lab.block_accept import decode_path

    pos = load_script("plot_accept_by_position")
    offsets, accepted = [0, 1, 2, 3, 5, 6, 7, 8], [2, 0, 3, 1, 0, 6, 0, 0]  # position 4 skipped (off the path)
    walked = pos.path_rounds(offsets, accepted)
    assert walked == [(0, 2), (3, 1), (5, 0), (6, 6)] and [a for _, a in walked] == decode_path(offsets, accepted)
    assert pos.decoded_rounds([2, 0, 3]) == [(0, 2), (3, 0), (4, 3)]
    anchors = tmp_path / "anchors.jsonl.gz"
    with gzip.open(anchors, "wt") as f:
        for head in ("/ship/head", "/tmp/other"):
            f.write(json.dumps({"head": head, "prompt_id": "q1", "set": "held30_code", "prompt_len": 9,
                                "offsets": offsets, "accepted": accepted if head == "/ship/head" else [6] * 8, "path": []}) + "\n")
    decoded = tmp_path / "decoded.json"
    decoded.write_text(json.dumps({"checks": [{"prompt": "code-001", "rounds": [2, 0, 3]}, {"prompt": "chat-002", "rounds": [1]}]}))
    out = tmp_path / "pos.png"
    table = pos.main(["--anchors", str(anchors), "--decoded", str(decoded), "--bin", "4", "--upto", "8", "--out", str(out),
                      "--json", str(tmp_path / "t.json")])
    got = {(r["source"], r["set"], r["from"]): (r["rounds"], r["mean_accept"]) for r in table}
    assert got == {(pos.HELD, "code", 0): (2, 2.5), (pos.HELD, "code", 4): (2, 4.0),
                   (pos.DECODED, "code", 0): (2, 2.0), (pos.DECODED, "code", 4): (1, 4.0), (pos.DECODED, "chat", 0): (1, 2.0)}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and json.loads((tmp_path / "t.json").read_text()) == table
    other = pos.main(["--anchors", str(anchors), "--head", "other", "--bin", "4", "--upto", "8"])
    assert [r["rounds"] for r in other] == [1, 1]  # 0 -> 7: one round in each bin
    for bad in ([], ["--anchors", str(tmp_path / "none.gz")], ["--decoded", str(decoded), "--bin", "0"],
                ["--anchors", str(anchors), "--head", "missing"]):
        with pytest.raises(SystemExit):
            pos.main(bad)
