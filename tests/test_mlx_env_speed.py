"""benchmarks/mlx_env_speed.py: pipeline_speed.py once per MLX environment setting, each in its own
process (MLX reads the settings once), the setting reaching the child exactly (this shell's own
MLX_* variables cleared), rounds rotating the order, and bad settings refused with the form to use."""

import pytest

from dspark_lab.tiny import build_tiny_dspark

from scripts import load_script


def _module():
    return load_script("mlx_env_speed")


def test_each_setting_runs_in_its_own_process_and_reaches_it(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FROM_THE_SHELL", "1")  # cleared in every child: a setting is exactly what it says
    mod = _module()
    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4)
    r = mod.main(["--env", "", "--env", "MLX_MAX_OPS_PER_BUFFER=7", "--rounds", "1", "--json", str(tmp_path / "r.json"), "--",
                  "--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--caps", "3", "--prompts", "code", "--limit", "1",
                  "--max-new-tokens", "8", "--repeats", "1", "--no-compile", "--arms", "pipe+cd", "--copy-mib", "16"])
    assert [run["result"].get("error") for run in r["runs"]] == [None, None]
    assert [run["result"]["mlx_env"] for run in r["runs"]] == [{}, {"MLX_MAX_OPS_PER_BUFFER": "7"}]
    rows = {(row["arm"], row["setting"]): row for row in r["table"]}
    assert set(rows) == {(arm, s) for arm in ("mlx_lm", "greedy", "pipe+cd@3") for s in ("defaults", "MLX_MAX_OPS_PER_BUFFER=7")}
    assert all(row["tok_s"] > 0 and row["processes"] == 1 for row in rows.values())
    assert rows[("greedy", "defaults")]["vs_first_setting"] == 1.0 and rows[("greedy", "defaults")]["vs_own_greedy"] == 1.0
    tuned = rows[("pipe+cd@3", "MLX_MAX_OPS_PER_BUFFER=7")]
    assert tuned["vs_own_greedy"] == pytest.approx(tuned["tok_s"] / rows[("greedy", "MLX_MAX_OPS_PER_BUFFER=7")]["tok_s"], rel=1e-2)
    assert (tmp_path / "r.json").exists()


def test_rounds_rotate_the_order_and_a_failed_process_is_reported(monkeypatch, capsys):
    mod = _module()
    seen = []

    def fake_run(setting, speed_args, timeout):
        seen.append(mod.label(setting))
        if setting.get("MLX_X") == "2":
            return {"error": "pipeline_speed.py exited with status 1", "tail": "Traceback: boom"}
        return {"mlx_env": setting, "rows": [{"arm": "greedy", "tok_s": 100.0 if not setting else 120.0}]}

    monkeypatch.setattr(mod, "run_once", fake_run)
    r = mod.main(["--env", "", "--env", "MLX_X=1", "--env", "MLX_X=2", "--rounds", "2", "--", "--model", "m", "--head", "h"])
    assert seen == ["defaults", "MLX_X=1", "MLX_X=2", "MLX_X=1", "MLX_X=2", "defaults"]
    out = capsys.readouterr().out
    assert "MLX_X=2: pipeline_speed.py exited with status 1" in out and "Traceback: boom" in out
    greedy = {row["setting"]: row for row in r["table"]}
    assert greedy["MLX_X=1"]["vs_first_setting"] == 1.2 and greedy["MLX_X=1"]["processes"] == 2 and "MLX_X=2" not in greedy


def test_bad_settings_and_missing_arguments_are_refused():
    mod = _module()
    with pytest.raises(SystemExit, match="'MAXOPS' is not KEY=VALUE.*MLX_MAX_OPS_PER_BUFFER=100"):
        mod.parse_setting("MAXOPS")
    with pytest.raises(SystemExit, match="is not KEY=VALUE"):
        mod.parse_setting("mlx_lower=1")
    assert mod.parse_setting("MLX_A=1  MLX_B=x") == {"MLX_A": "1", "MLX_B": "x"} and mod.parse_setting("") == {}
    with pytest.raises(SystemExit, match="arguments after --"):
        mod.main(["--env", ""])
    assert mod.child_environment({"MLX_A": "1"}, {"PATH": "/bin", "MLX_B": "2"}) == {"PATH": "/bin", "MLX_A": "1"}
