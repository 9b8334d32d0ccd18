"""The registry of measured pairs: what it vouches for, what it refuses and why, and that the
engine's reader (read_registry / load_pair) takes the file it writes."""

import io
import json

import pytest
from labdb import CUDA, HEAD_A, METAL, MODEL_A, MODEL_A_CUDA, PROMPTS, store_other_weights, sweep_db, synthetic_db, trial
from rich.console import Console
from sqlalchemy import text
from sqlmodel import Session

from dspark_lab.db.store import open_db
from dspark_lab.engine.speculative import load_pair, read_registry
from dspark_lab.errors import DsparkError
from dspark_lab.engine.names import target_key
from dspark_lab.reports.registry import (MIN_TRIALS, build_registry, load_registry, registry_markdown, registry_table,
                                         write_registry)
from dspark_lab.schemas.records import Run


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return build_registry(synthetic_db(tmp_path_factory.mktemp("registry")))


def test_best_arm_per_target_and_machine(registry):
    assert registry["schema_version"] == 1 and registry["min_trials"] == MIN_TRIALS == 6
    pairs = {(p["target"], p["machine"]): p for p in registry["pairs"]}
    assert set(pairs) == {("qwen3-8b", METAL), ("qwen3-8b", CUDA)}  # both quantizations are one target
    metal = pairs[("qwen3-8b", METAL)]
    # lookup cap 4 is faster (3x) but has a trial that is not lossless; dspark auto is 1.8x.
    assert (metal["mode"], metal["drafter"], metal["cap"]) == ("dspark", HEAD_A, 2)
    assert metal["speedup"] == 2.0 and metal["trials"] == 6 and metal["prompts"] == 3
    assert metal["ci"][0] <= 2.0 <= metal["ci"][1] and metal["mean_accept_len"] == 2.25
    assert metal["model_id"] == MODEL_A and metal["device"] == METAL and metal["device_keys"] == ["dk-metal"]
    assert metal["run_ids"] == ["run-metal"] and metal["date"] == "2026-11-20"
    assert metal["versions"] == {"dspark_lab": "0.1.0", "mlx": "0.32.4", "mlx_lm": "0.32.2"}
    cuda = pairs[("qwen3-8b", CUDA)]
    assert (cuda["model_id"], cuda["cap"], cuda["speedup"]) == (MODEL_A_CUDA, 4, 3.0)
    json.dumps(registry)  # JSON-ready as it is


def test_refusals_say_why(registry):
    refused = {(r["target"], r["mode"], r["cap"]): r["reason"] for r in registry["refused"]}
    assert "not lossless" in refused[("qwen3-8b", "lookup", 4)]
    assert "only 3 trials; at least 6" in refused[("llama-3.2-1b-instruct", "lookup", 2)]
    assert not any(p["target"] == "llama-3.2-1b-instruct" for p in registry["pairs"])


def test_min_trials_is_configurable(tmp_path):
    engine = synthetic_db(tmp_path)
    loose = build_registry(engine, min_trials=1)
    assert any(p["target"] == "llama-3.2-1b-instruct" and p["speedup"] == 1.5 for p in loose["pairs"])
    with pytest.raises(DsparkError, match="at least 1"):
        build_registry(engine, min_trials=0)


def test_a_slower_best_arm_is_refused(tmp_path):
    engine = open_db(tmp_path / "slow.duckdb")
    with Session(engine) as s:
        s.add(Run(id="r", status="finished", dspark_lab_version="0.1.0", device_key="k", machine=METAL, device_stamp="{}",
                  config="{}"))
        for p in PROMPTS:
            for i in range(2):
                s.add(trial("r", "slow-model", "baseline", "0", p, i, 100.0))
                s.add(trial("r", "slow-model", "lookup", "2", p, i, 90.0))
        s.commit()
    reg = build_registry(engine)
    assert reg["pairs"] == []
    assert "not faster than plain decoding (x0.900)" in reg["refused"][0]["reason"]
    assert reg["refused"][0]["slower_than_plain"] is True


def test_where_the_registry_measured_plain_decoding_faster_load_pair_says_so_and_auto_decodes_plainly(tmp_path):
    """A model whose every speculative arm lost to plain decoding on this machine: load_pair raises
    PlainIsFaster there (another machine's entry would not hold here), and `generate --mode auto`
    decodes plainly; on the machine whose entry won, the entry still serves. A sweep's @unfused
    trials (the stacked projections' side-by-side comparison) never become an entry."""
    from typer.testing import CliRunner

    from dspark_lab.cli import app
    from dspark_lab.errors import PlainIsFaster
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "tinytarget", "qwen3")
    head = build_tiny_dspark(tmp_path / "tinyhead", model, block_size=4)
    engine = open_db(tmp_path / "db.duckdb")
    with Session(engine) as s:
        for run, machine, rate in (("fast", METAL, 180.0), ("slow", CUDA, 90.0)):
            s.add(Run(id=run, status="finished", dspark_lab_version="0.1.0", device_key=run, machine=machine,
                      device_stamp=json.dumps({"mlx_version": "0.32.4"}), config="{}"))
            for p in PROMPTS:
                for i in range(2):
                    for model_id in (str(model), f"{model}@unfused"):
                        s.add(trial(run, model_id, "baseline", "0", p, i, 100.0))
                        s.add(trial(run, model_id, "dspark", "3", p, i, rate + (50.0 if "@" in model_id else 0.0), drafter=str(head)))
        s.commit()
    reg = build_registry(engine)
    assert [(p["target"], p["machine"]) for p in reg["pairs"]] == [("tinytarget", METAL)]
    assert [(r["target"], r["machine"], r.get("slower_than_plain")) for r in reg["refused"]] == [("tinytarget", CUDA, True)]
    path = write_registry(reg, tmp_path / "registry.json")
    assert load_pair(str(model), registry=path, machine=METAL)[3].evidence["speedup"] == 1.8
    with pytest.raises(PlainIsFaster, match="faster plainly than with any drafter .*x0.9"):
        load_pair(str(model), registry=path, machine=CUDA)

    import dspark_lab.lab.device as device

    stamp = device.collect_device_stamp()
    machine = device.machine_class(stamp)
    reg["refused"][0]["machine"] = machine  # as if measured on this very machine
    write_registry(reg, path)
    from unittest import mock

    with mock.patch("dspark_lab.engine.speculative.read_registry", lambda registry=None: read_registry(path)), \
            mock.patch("dspark_lab.engine.speculative._registry_data", lambda registry=None: json.loads(path.read_text())):
        result = CliRunner().invoke(app, ["generate", "--model", str(model), "--prompt", "def f(x):", "--max-new-tokens", "4",
                                          "--mode", "auto", "--db", str(tmp_path / "gen.duckdb")])
    assert result.exit_code == 0, result.output
    assert "Decoding plainly" in result.output


def test_table_and_markdown(registry):
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(registry_table(registry))
    out = console.export_text()
    assert "qwen3-8b" in out and "2.00x" in out and "3.00x" in out and "2 arm(s) refused" in out
    md = registry_markdown(registry)
    lines = md.splitlines()
    assert lines[0].startswith("| target | machine | mode | drafter | cap | speedup")
    assert any(line.startswith("| qwen3-8b | Apple M3 Max 64GB (metal) | dspark | qwen3-8b-dspark | 2 | 2.00x") for line in lines)
    assert "Refused (2):" in md
    assert "no pair measured yet" in str(registry_table({"pairs": [], "refused": []}).caption)


def test_a_narrow_table_wraps_names_instead_of_cutting_them():
    entry = {"target": "qwen2.5-coder-1.5b@dequantized", "machine": "NVIDIA H200 (cuda)", "mode": "dspark-pipe",
             "drafter": "fixtures/qwen2.5-coder-1.5b-dspark", "cap": 4, "speedup": 1.4, "ci": [1.2, 1.7],
             "mean_accept_len": 2.3, "trials": 24, "run_ids": ["65a7b72cdc3b"], "date": "2026-12-03"}
    console = Console(file=io.StringIO(), width=110, record=True)
    console.print(registry_table({"pairs": [entry], "refused": []}))
    text = console.export_text()
    assert "…" not in text
    body = [line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│")]
    # each cell's wrapped pieces joined (spaces dropped: a wrap may fall on one)
    cells = ["".join(piece.replace(" ", "") for piece in column) for column in zip(*body)]
    whole = ["qwen2.5-coder-1.5b@dequantized", "NVIDIA H200 (cuda)", "dspark-pipe", "qwen2.5-coder-1.5b-dspark", "4",
             "1.40x", "[1.20, 1.70]", "2.30", "24", "65a7b72cdc3b", "2026-12-03"]
    assert cells == [c.replace(" ", "") for c in whole]


def test_written_file_reads_back_and_is_checked(registry, tmp_path):
    path = write_registry(registry, tmp_path / "registry.json")
    assert load_registry(path) == registry
    pairs = read_registry(path)  # the engine's reader
    for key in ("target", "drafter", "cap", "speedup", "trials", "device", "run_ids", "date"):
        assert all(key in p for p in pairs)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(DsparkError, match="not valid JSON"):
        load_registry(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(DsparkError, match="no \"pairs\" list"):
        load_registry(tmp_path / "other.json")
    with pytest.raises(DsparkError, match="not found"):
        load_registry(tmp_path / "missing.json")


def test_target_key_is_quant_agnostic():
    assert target_key("mlx-community/Qwen3-8B-4bit") == "qwen3-8b"
    assert target_key("/models/Qwen3-8B-MLX-bf16/") == "qwen3-8b"
    assert target_key("SmolLM2-135M-Instruct-q4") == "smollm2-135m-instruct"
    assert target_key("gemma-3-4b-it") == "gemma-3-4b-it"  # "-it" is the instruct tune, not a quantization
    # fetch-model's folders name the bits and the scales' dtype: every import of a model is one target
    assert target_key("/root/.cache/dspark-lab/models/qwen2.5-coder-0.5b-q4-bfloat16") == "qwen2.5-coder-0.5b"
    assert target_key("qwen2.5-coder-0.5b-q8-float32") == target_key("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b"
    # a sweep's precision keeps its label: its speedup is over its own baseline
    assert target_key("/root/ship/qwen15/qwen2.5-coder-1.5b-q4-bfloat16@q8") == "qwen2.5-coder-1.5b@q8"
    assert target_key("Qwen3-8B-4bit@dequantized") == target_key("qwen3-8b@dequantized") == "qwen3-8b@dequantized"
    assert target_key("/models/me@work/Qwen3-8B-4bit") == "qwen3-8b"  # an @ in a path is no label


def test_load_pair_picks_the_registry_drafter(tmp_path):
    """A registry built from stored trials of a real tiny model and head drives load_pair."""
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "tinytarget", "qwen3")
    head = build_tiny_dspark(tmp_path / "tinyhead", model, block_size=4)
    engine = open_db(tmp_path / "db.duckdb")
    with Session(engine) as s:
        s.add(Run(id="r1", status="finished", dspark_lab_version="0.1.0", device_key="k", machine=METAL,
                  device_stamp=json.dumps({"mlx_version": "0.32.4"}), config="{}"))
        for p in PROMPTS:
            for i in range(2):
                s.add(trial("r1", str(model), "baseline", "0", p, i, 100.0))
                s.add(trial("r1", str(model), "dspark", "3", p, i, 180.0, drafter=str(head)))
        s.commit()
    reg = build_registry(engine)
    assert [(p["target"], p["cap"], p["speedup"]) for p in reg["pairs"]] == [("tinytarget", 3, 1.8)]
    path = write_registry(reg, tmp_path / "registry.json")
    _, _, drafter, cfg = load_pair(str(model), registry=path)
    assert cfg.source == "registry" and cfg.drafter == str(head) and cfg.max_draft_tokens == 3
    assert cfg.evidence["speedup"] == 1.8 and cfg.evidence["trials"] == 6 and cfg.evidence["run_ids"] == ["r1"]
    assert drafter.config.max_drafts >= 3


def test_real_sweep_too_few_trials_and_a_flipped_lossless_flag(tmp_path):
    engine = sweep_db(tmp_path)
    reg = build_registry(engine)  # 4 trials per arm (2 prompts x 2 sets x 1 trial) < 6
    assert reg["pairs"] == []
    assert len(reg["refused"]) == 4 and all("only 4 trials; at least 6" in r["reason"] for r in reg["refused"])

    with engine.begin() as conn:
        tid = conn.execute(text("select id from trials where mode = 'dspark' and cap = '2' order by id limit 1")).scalar()
        conn.execute(text("update trials set lossless = false, mismatch_index = 5 where id = :id"), {"id": tid})
    loose = build_registry(engine, min_trials=1)
    refused = {(r["mode"], r["cap"]): r["reason"] for r in loose["refused"]}
    assert "1 of 4 trials not lossless" in refused[("dspark", 2)]
    vouched = [(p["mode"], p["cap"]) for p in loose["pairs"]]
    assert ("dspark", 2) not in vouched
    # Every other arm is either vouched for (the fastest, if faster than plain) or refused with a reason.
    for p in loose["pairs"]:
        assert p["speedup"] > 1.0 and p["trials"] == 4 and p["target"] == "model"


def test_a_mismatch_at_a_numerical_tie_is_vouched_for_and_counted(tmp_path):
    """On a GPU in bf16, plain and speculative decoding may order two logits within one rounding
    step differently. Such a trial stays flagged not lossless, but the registry accepts an arm
    whose every difference is such a tie, and the entry says how many there were."""
    from sqlalchemy import text

    engine = synthetic_db(tmp_path)
    with engine.begin() as conn:  # lookup cap 4's one mismatch turns out to be a one-step bf16 tie
        conn.execute(text("UPDATE trials SET mismatch_gap = 0.125, mismatch_tie = true WHERE lossless = false AND mode = 'lookup' "
                          "AND model_id = :m"), {"m": MODEL_A})
    pairs = {(p["target"], p["machine"]): p for p in build_registry(engine)["pairs"]}
    metal = pairs[("qwen3-8b", METAL)]
    assert (metal["mode"], metal["cap"], metal["speedup"], metal["tie_trials"]) == ("lookup", 4, 3.0, 1)


def test_an_entry_carries_its_share_of_the_bandwidth_limit(tmp_path):
    """Where the runs recorded their bandwidth (sweeps do), the entry says how close its tok/s came
    to the plain-decoding limit; where they did not, it says nothing rather than guess."""
    engine = synthetic_db(tmp_path)
    assert all(p["limit_share"] is None for p in build_registry(engine)["pairs"])
    # 1 GB/s over 10 MB of weights (no KV): a limit of 100 tok/s for every trial of MODEL_A
    config = {"bandwidth": {"copy_bytes_per_s": 1e9, "models": {MODEL_A: {"weight_bytes": 10_000_000, "kv_bytes_per_position": 0}}}}
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET config = :c"), {"c": json.dumps(config)})
    pairs = {(p["target"], p["machine"]): p for p in build_registry(engine)["pairs"]}
    metal = pairs[("qwen3-8b", METAL)]
    assert metal["model_id"] == MODEL_A and metal["limit_share"] == pytest.approx(metal["tok_s"] / 100.0)
    assert pairs[("qwen3-8b", CUDA)]["limit_share"] is None  # another model id: no bytes recorded for it


def _pipe_db(tmp_path, model: str, head: str, config: dict, mode: str = "dspark-pipe"):
    """A run of a dspark-pipe (or `mode`) arm at cap 3, 1.8x plain decoding over 6 trials, with this run config."""
    engine = open_db(tmp_path / f"{mode}.duckdb")
    with Session(engine) as s:
        s.add(Run(id="rp", status="finished", dspark_lab_version="0.1.0", device_key="k", machine=CUDA,
                  device_stamp=json.dumps({"backend": "cuda"}), config=json.dumps(config)))
        for p in PROMPTS:
            for i in range(2):
                s.add(trial("rp", model, "baseline", "0", p, i, 100.0))
                s.add(trial("rp", model, mode, "3", p, i, 180.0, drafter=head))
        s.commit()
    return engine


def test_an_entry_names_its_heads_where_users_have_them_and_its_loop_options(tmp_path, monkeypatch):
    """A registry built on the GPU machine names the head by the measuring machine's path; --name
    records it as fixtures/NAME, which load_pair finds from a checkout (or refuses, saying where it
    is); a dspark-pipe entry keeps the loop options it ran with, which callers must repeat."""
    from dspark_lab.errors import LoadError
    from dspark_lab.reports.registry import parse_names
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "tinytarget-q4-bfloat16", "qwen3")
    checkout = tmp_path / "checkout"
    head = build_tiny_dspark(checkout / "fixtures" / "tiny-dspark", model, block_size=4)
    engine = _pipe_db(tmp_path, str(model), "/root/ship/data/head", {"pipe_lookup": True, "compile_draft": True})
    names = parse_names(["/root/ship/data/head=fixtures/tiny-dspark", f"{model}=tinytarget"])
    reg = build_registry(engine, names=names)
    [entry] = reg["pairs"]
    assert (entry["target"], entry["model_id"], entry["drafter"]) == ("tinytarget", "tinytarget", "fixtures/tiny-dspark")
    assert (entry["mode"], entry["cap"], entry["speedup"]) == ("dspark-pipe", 3, 1.8)
    assert entry["options"] == {"lookup_drafts": True, "compile_draft": True}
    path = write_registry(reg, tmp_path / "registry.json")

    monkeypatch.chdir(checkout)  # a clone of the repository: fixtures/ is where the registry says
    _, _, drafter, cfg = load_pair(str(model), registry=path)
    assert cfg.mode == "dspark-pipe" and cfg.max_draft_tokens == 3 and cfg.drafter == "fixtures/tiny-dspark"
    assert cfg.evidence["options"] == {"lookup_drafts": True, "compile_draft": True}
    monkeypatch.chdir(tmp_path)  # an installation with no checkout beside it
    with pytest.raises(LoadError, match="'fixtures/tiny-dspark', a head committed in the dspark-lab repository.*pass drafter="):
        load_pair(str(model), registry=path)
    assert head.exists()

    for bad in (["nothing-to-rename"], ["=x"], ["x="]):
        with pytest.raises(DsparkError, match="give OLD=NEW"):
            parse_names(bad)
    # Runs that disagree on an option are arms apart: each entry claims the options its trials ran.
    with Session(engine) as s:
        s.add(Run(id="rp2", status="finished", dspark_lab_version="0.1.0", device_key="k", machine=CUDA,
                  device_stamp=json.dumps({"backend": "cuda"}), config=json.dumps({"pipe_lookup": False, "compile_draft": True})))
        s.commit()
    with engine.begin() as conn:
        conn.execute(text("UPDATE trials SET run_id = 'rp2' WHERE trial_index = 1"))
        conn.execute(text("UPDATE trials SET decode_tokens_per_sec = 200.0 WHERE run_id = 'rp2' AND mode = 'dspark-pipe'"))
    [entry] = build_registry(engine, min_trials=3)["pairs"]
    assert (entry["speedup"], entry["trials"], entry["run_ids"]) == (2.0, 3, ["rp2"])
    assert entry["options"] == {"lookup_drafts": False, "compile_draft": True}
    with engine.begin() as conn:  # a run whose config cannot be read: the entry claims no option
        conn.execute(text("UPDATE runs SET config = 'not json'"))
    [entry] = build_registry(engine, min_trials=3)["pairs"]
    assert entry["options"] == {}


def test_a_tree_entry_keeps_its_tree_size(tmp_path):
    """A dspark-tree entry records the tree size its runs drafted (which generate --mode auto repeats)."""
    engine = _pipe_db(tmp_path, "some/model", "some/head", {"tree_nodes": 24}, mode="dspark-tree")
    [entry] = build_registry(engine)["pairs"]
    assert (entry["mode"], entry["cap"], entry["options"]) == ("dspark-tree", 3, {"tree_nodes": 24})
    engine = _pipe_db(tmp_path, "some/model", "some/head", {"tree_nodes": 24, "compile_draft": True}, mode="dspark-tree-pipe")
    [entry] = build_registry(engine)["pairs"]
    assert (entry["mode"], entry["options"]) == ("dspark-tree-pipe", {"tree_nodes": 24, "lookup_drafts": False, "compile_draft": True})


def test_trees_of_other_sizes_are_arms_apart(tmp_path):
    """Two sweeps of the same tree mode and cap with trees of 15 and 31 nodes: pooling their trials
    would give a speedup of no tree anyone can run, so each size is its own arm and the entry is the
    faster size's, with its size in its options; a mode the tree size does not touch (dspark-pipe)
    still pools both runs. The slower size, refused for too few trials, says which size it was."""
    engine = open_db(tmp_path / "trees.duckdb")
    with Session(engine) as s:
        for run_id, nodes, tok_s in (("r15", 15, 150.0), ("r31", 31, 180.0)):
            s.add(Run(id=run_id, status="finished", dspark_lab_version="0.1.0", device_key="k", machine=CUDA,
                      device_stamp=json.dumps({"backend": "cuda"}),
                      config=json.dumps({"tree_nodes": nodes, "compile_draft": True, "pipe_lookup": False})))
            for p in PROMPTS:
                for i in range(2):
                    s.add(trial(run_id, "some/model", "baseline", "0", p, i, 100.0))
                    s.add(trial(run_id, "some/model", "dspark-tree-pipe", "7", p, i, tok_s, drafter="some/head"))
                    s.add(trial(run_id, "some/model", "dspark-pipe", "7", p, i, 120.0, drafter="some/head"))
        s.commit()
    [entry] = build_registry(engine)["pairs"]
    assert (entry["mode"], entry["cap"], entry["speedup"], entry["trials"], entry["run_ids"]) == ("dspark-tree-pipe", 7, 1.8, 6, ["r31"])
    assert entry["options"] == {"tree_nodes": 31, "lookup_drafts": False, "compile_draft": True}
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM trials WHERE run_id = 'r15' AND mode = 'dspark-tree-pipe' AND trial_index = 1"))
    reg = build_registry(engine)
    [refused] = reg["refused"]
    assert refused["options"]["tree_nodes"] == 15 and "only 3 trials" in refused["reason"]
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM trials WHERE mode = 'dspark-tree-pipe'"))
    [pipe] = build_registry(engine)["pairs"]
    assert (pipe["mode"], pipe["trials"], sorted(pipe["run_ids"])) == ("dspark-pipe", 12, ["r15", "r31"])


def test_a_precision_gets_its_own_entry_and_load_pair_takes_the_one_the_model_is_stored_at(tmp_path):
    """A sweep with --precisions stores MODEL@q8 trials beside the model's: the registry keeps them
    as their own target (a speedup over the 8-bit baseline says nothing of the 4-bit one), renames
    the model part with --name and keeps the label. load_pair takes the entry of the precision the
    model is stored at where the registry has one (an 8-bit folder: @q8; float weights:
    @dequantized), else the as-loaded entry, even where another precision measured faster."""
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "tinytarget-q4-bfloat16", "qwen3")
    head = build_tiny_dspark(tmp_path / "head", model, block_size=4)
    engine = _pipe_db(tmp_path, str(model), str(head), {})
    with Session(engine) as s:
        for p in PROMPTS:
            for i in range(2):
                s.add(trial("rp", f"{model}@q8", "baseline", "0", p, i, 100.0))
                s.add(trial("rp", f"{model}@q8", "dspark-pipe", "2", p, i, 250.0, drafter=str(head)))
        s.commit()
    reg = build_registry(engine, names={str(model): "tinytarget-q4-bfloat16"})
    pairs = {p["target"]: p for p in reg["pairs"]}
    assert set(pairs) == {"tinytarget", "tinytarget@q8"}
    assert (pairs["tinytarget"]["model_id"], pairs["tinytarget"]["cap"], pairs["tinytarget"]["speedup"]) == ("tinytarget-q4-bfloat16", 3, 1.8)
    assert (pairs["tinytarget@q8"]["model_id"], pairs["tinytarget@q8"]["cap"], pairs["tinytarget@q8"]["speedup"]) == (
        "tinytarget-q4-bfloat16@q8", 2, 2.5)
    path = write_registry(reg, tmp_path / "registry.json")
    _, _, _, cfg = load_pair(str(model), registry=path)  # float weights, no @dequantized entry
    assert cfg.max_draft_tokens == 3 and cfg.evidence["speedup"] == 1.8

    from dspark_lab.engine.speculative import _registry_entry

    eight_bit = tmp_path / "tinytarget-8bit"  # an 8-bit folder of the model: the @q8 entry is its own
    eight_bit.mkdir()
    config = json.loads((model / "config.json").read_text())
    (eight_bit / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 64, "bits": 8}}))
    assert _registry_entry(str(eight_bit), path, None)["target"] == "tinytarget@q8"
    four_bit = tmp_path / "tinytarget-4bit"  # no @q4 entry: the as-loaded one
    four_bit.mkdir()
    (four_bit / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 64, "bits": 4}}))
    assert _registry_entry(str(four_bit), path, None)["target"] == "tinytarget"
    assert _registry_entry("someone/tinytarget-q4-bfloat16", path, None)["target"] == "tinytarget"  # a hub id: unknown
    for entry in reg["pairs"]:
        entry["target"] = entry["target"].replace("@q8", "@dequantized")
    path = write_registry(reg, tmp_path / "registry2.json")
    _, _, _, cfg = load_pair(str(model), registry=path)  # float weights: the @dequantized entry
    assert cfg.max_draft_tokens == 2 and cfg.evidence["speedup"] == 2.5


def test_the_shipped_registry_names_heads_this_checkout_has():
    """dspark_lab/data/registry.json (built from the sweeps of docs/results): every entry's head
    is a committed fixture, the pair is faster than plain decoding over enough lossless trials."""
    from pathlib import Path

    from dspark_lab.engine.speculative import _registry_drafter

    pairs = read_registry()
    assert pairs, "the shipped registry is empty"
    root = Path(__file__).resolve().parents[1]
    for p in pairs:
        assert p["drafter"].startswith("fixtures/") and (root / p["drafter"] / "config.json").is_file()
        assert Path(_registry_drafter(p["drafter"], p["target"])).resolve() == (root / p["drafter"]).resolve()
        assert p["speedup"] > 1.0 and p["trials"] >= MIN_TRIALS and p["target"] == target_key(p["target"])
        assert p["mode"] in ("dspark", "dspark-pipe", "dspark-tree", "dspark-tree-pipe", "lookup") and isinstance(p["options"], dict)
        if p["mode"].startswith("dspark-tree"):
            assert p["options"]["tree_nodes"] >= 1  # generate --mode auto runs the tree it measured


def test_the_readme_shows_the_shipped_registry_as_it_is():
    """The README's table of measured pairs is the shipped registry's Markdown, row for row."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rows = [line for line in registry_markdown(load_registry(root / "dspark_lab" / "data" / "registry.json")).splitlines()
            if line.startswith("| ")]
    readme = (root / "README.md").read_text().splitlines()
    assert rows and all(row in readme for row in rows)


def test_registry_show_without_a_file_shows_the_shipped_registry():
    """`dspark-lab registry show` alone prints the registry --mode auto reads, the README's rows."""
    from pathlib import Path

    from typer.testing import CliRunner

    from dspark_lab.cli import app

    root = Path(__file__).resolve().parents[1]
    shipped = root / "dspark_lab" / "data" / "registry.json"
    r = CliRunner().invoke(app, ["registry", "show", "--markdown"])
    assert r.exit_code == 0, r.output
    assert "the shipped registry" in r.output and "registry.json" in r.output
    rows = [line for line in registry_markdown(load_registry(shipped)).splitlines() if line.startswith("| ")]
    assert rows and all(row in r.output for row in rows)


def _store_head_trials(engine, model, head, digests):
    """Six lossless dspark trials of `head` at cap 3 beside their baselines, the i-th pair of
    trials (one per prompt index) stamped with digests[i % len(digests)]."""
    with Session(engine) as s:
        s.add(Run(id="r1", status="finished", dspark_lab_version="0.1.0", device_key="k", machine=METAL,
                  device_stamp=json.dumps({"mlx_version": "0.32.4"}), config="{}"))
        for n, p in enumerate(PROMPTS):
            for i in range(2):
                s.add(trial("r1", str(model), "baseline", "0", p, i, 100.0))
                t = trial("r1", str(model), "dspark", "3", p, i, 180.0, drafter=str(head))
                t.drafter_digest = digests[n % len(digests)]
                s.add(t)
        s.commit()


def test_the_registry_names_the_measured_weights_and_load_pair_notices_new_ones(tmp_path):
    """A head continued and stored again at the same path (fixtures/NAME after each training
    session) is another head: the entry records which weights were measured, and load_pair warns
    when the folder holds others, without refusing to run them."""
    import warnings

    from typer.testing import CliRunner

    from dspark_lab.cli import app
    from dspark_lab.engine.loading import weights_digest
    from dspark_lab.errors import MeasuredVersionWarning
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "tinytarget", "qwen3")
    head = build_tiny_dspark(tmp_path / "tinyhead", model, block_size=4)
    measured = weights_digest(head)
    assert measured and len(measured) == 16 and weights_digest(head) == measured  # stable
    engine = open_db(tmp_path / "db.duckdb")
    _store_head_trials(engine, model, head, [measured])
    reg = build_registry(engine)
    assert [p["drafter_digest"] for p in reg["pairs"]] == [measured]
    path = write_registry(reg, tmp_path / "registry.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeasuredVersionWarning)
        _, _, _, cfg = load_pair(str(model), registry=path)  # the measured weights: no warning
    assert cfg.evidence["drafter_digest"] == measured
    assert "other weights" not in CliRunner().invoke(app, ["registry", "show", str(path)]).output

    store_other_weights(head)
    now = weights_digest(head)
    assert now != measured
    with pytest.warns(MeasuredVersionWarning, match=f"weights digest {measured}; this folder's: {now}.*dspark-lab sweep"):
        _, _, drafter, cfg = load_pair(str(model), registry=path)
    assert cfg.source == "registry" and drafter.config.max_drafts >= 3  # it still runs
    # `registry show` says so too, for every head on this machine changed since it was measured.
    r = CliRunner().invoke(app, ["registry", "show", str(path)])
    assert r.exit_code == 0 and f"holds other weights than were measured (weights digest {now}, measured {measured})" in " ".join(r.output.split())


def test_an_arm_pooling_two_versions_of_a_head_is_refused(tmp_path):
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "tinytarget", "qwen3")
    head = build_tiny_dspark(tmp_path / "tinyhead", model, block_size=4)
    engine = open_db(tmp_path / "db.duckdb")
    _store_head_trials(engine, model, head, ["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"])
    reg = build_registry(engine)
    assert reg["pairs"] == []
    (refused,) = [r for r in reg["refused"] if r["mode"] == "dspark"]
    assert "2 versions of the drafter" in refused["reason"] and "aaaaaaaaaaaaaaaa, bbbbbbbbbbbbbbbb" in refused["reason"]
    assert "--run" in refused["reason"]


def test_on_cuda_a_rows_kernel_entry_competes_and_says_to_route(tmp_path, monkeypatch):
    """A sweep's MODEL@rows-kernel entry (the stored weights, products through the rows kernel)
    is the model's own on CUDA only: there the faster of the two is taken and its evidence asks
    for the routing (the CLI's --mode auto then routes); elsewhere it is never chosen."""
    from dspark_lab.engine import speculative
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "tinytarget-q4-bfloat16", "qwen3", quantize_bits=4)
    head = build_tiny_dspark(tmp_path / "head", model, block_size=4)

    def entry(target, speedup):
        return {"target": target, "model_id": "tinytarget-q4-bfloat16", "mode": "dspark-pipe", "drafter": str(head), "cap": 3,
                "speedup": speedup, "trials": 24, "backend": "cuda", "machine": "m", "options": {"compile_draft": True}}

    path = tmp_path / "registry.json"
    path.write_text(json.dumps({"pairs": [entry("tinytarget", 1.5), entry("tinytarget@rows-kernel", 1.7)]}))
    assert speculative._registry_entry(str(model), path, None)["target"] == "tinytarget"  # not CUDA here
    monkeypatch.setattr(speculative, "_backend", lambda: "cuda")
    assert speculative._registry_entry(str(model), path, None)["target"] == "tinytarget@rows-kernel"
    _, _, _, cfg = speculative.load_pair(str(model), registry=path)
    assert cfg.evidence["speedup"] == 1.7 and cfg.evidence["options"] == {"compile_draft": True, "rows_kernel": True}
    path.write_text(json.dumps({"pairs": [entry("tinytarget", 1.8), entry("tinytarget@rows-kernel", 1.7)]}))
    _, _, _, cfg = speculative.load_pair(str(model), registry=path)
    assert cfg.evidence["speedup"] == 1.8 and "rows_kernel" not in cfg.evidence["options"]
