"""benchmarks/peer_vs_ours.py on tiny random models: every arm runs, outputs match our greedy,
and the peer arm either runs or records why not (the peer engine is optional)."""

import importlib.util
import json

from dspark_lab.tiny import build_tiny_dspark

from scripts import load_script


def _bench():
    return load_script("peer_vs_ours")


def test_smoke_runs_with_or_without_the_peer(tmp_path, capsys):
    out = tmp_path / "r.json"
    result = _bench().main(["--smoke", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    (row,) = result["rows"]
    arms = row["arms"]
    for name in ("mlx_lm", "greedy", "ours@2"):
        assert arms[name]["identical_to_greedy"], name
        assert arms[name]["mismatches"] == 0
        assert arms[name]["tok_s"] > 0 and arms[name]["fraction_of_limit"] > 0
    assert result["copy_bandwidth_gb_s"] > 0 and result["weight_bytes"] > 0 and row["limit_tok_s"] > 0
    if importlib.util.find_spec("mlx_dspark") is None:
        assert result["peer_error"].startswith("not installed")
        assert result["arm_errors"]["peer@2"] == result["peer_error"]
        assert "peer@2" not in arms
    else:
        assert result["peer_error"] is None, result["peer_error"]
        assert arms["peer@2"]["identical_to_greedy"]
        assert "ours_vs_peer@2" in row
    assert "arms not token-identical to our greedy: 0" in capsys.readouterr().out


def test_draft_model_arm_and_caps_past_the_head(tiny_dirs, tmp_path):
    target = tiny_dirs["qwen3"]
    head = build_tiny_dspark(tmp_path / "head", target, block_size=3)
    result = _bench().main([
        "--model", str(target), "--drafter", str(head), "--draft-model", str(target), "--prompts", "chat",
        "--max-new-tokens", "6", "--caps", "1,5", "--repeats", "1", "--drafter-bits", "16", "--copy-mib", "8",
        "--no-peer", "--attention-kernel",
    ])
    arms = result["rows"][0]["arms"]
    assert arms["mlxlm_draft@1"]["identical_to_greedy"] and arms["ours@1"]["identical_to_greedy"]
    assert all(arms[f"ours_draft_pipe_attn@{k}"]["identical_to_greedy"] for k in (1, 5))
    for k in (1, 5):  # our draft-model mode: the target drafting for itself accepts every draft
        assert arms[f"ours_draft@{k}"]["identical_to_greedy"] and arms[f"ours_draft@{k}"]["mean_accept"] > 1
        assert arms[f"ours_draft_pipe@{k}"]["identical_to_greedy"] and arms[f"ours_draft_pipe@{k}"]["mean_accept"] > 1
    assert "ours@5" not in arms and "max drafts" in result["arm_errors"]["ours@5"]
    assert result["arm_errors"]["peer@1"] == "skipped (--no-peer)"
