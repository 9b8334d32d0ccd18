"""Summary queries: exact numbers on a hand-built database, and agreement with a plain
recomputation on a real tiny sweep."""

import json
import statistics

import duckdb
import pytest
from labdb import (CUDA, EXPECT_DSPARK2, HEAD_A, METAL, MODEL_A, MODEL_A_CUDA, PROMPTS, fill_synthetic, sweep_db,
                   synthetic_db, trial)
from sqlmodel import Session

from dspark_lab.db.queries import cap_order, summary, trials_frame
from dspark_lab.db.store import open_db
from dspark_lab.errors import DsparkError


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return synthetic_db(tmp_path_factory.mktemp("queries"))


def _row(df, **key):
    rows = [r for r in df.iter_rows(named=True) if all(r[k] == v for k, v in key.items())]
    assert len(rows) == 1, (key, rows)
    return rows[0]


def test_trials_frame_parses_lists_and_carries_the_device(synthetic):
    df = trials_frame(synthetic)
    assert df.height == 6 * 3 * 2 + 2 * 3
    r = df.filter((df["mode"] == "dspark") & (df["cap"] == "2")).row(0, named=True)
    assert r["accept_lengths"] == [3, 2, 1, 3] and r["draft_lengths"] == [2, 2, 2, 2]
    assert r["per_position_acceptance"] == [0.75, 0.5]
    assert r["machine"] == METAL and r["device_key"] == "dk-metal"
    auto = df.filter(df["cap"] == "auto").row(0, named=True)
    assert auto["caps_chosen"] == [2, 2, 2, 2]
    assert trials_frame(synthetic, ["run-cuda"])["run_id"].unique().to_list() == ["run-cuda"]


def test_unknown_run_id_names_the_known_ones(synthetic):
    with pytest.raises(DsparkError, match="no run 'nope'.*run-cuda, run-metal"):
        trials_frame(synthetic, ["nope"])


def test_summary_exact_numbers(synthetic):
    pooled = summary(synthetic, by_domain=False)
    r = _row(pooled, model_id=MODEL_A, mode="dspark", cap="2")
    assert r["machine"] == METAL and r["drafter_id"] == HEAD_A and r["domain"] == "all"
    assert r["speedup"] == pytest.approx(EXPECT_DSPARK2["speedup"])  # median of 2.0, 1.5, 2.5
    assert r["median_tok_s"] == pytest.approx(EXPECT_DSPARK2["median_tok_s"])
    assert r["baseline_median_tok_s"] == pytest.approx(EXPECT_DSPARK2["baseline_median_tok_s"])
    assert (r["trials"], r["prompts"], r["matched_prompts"]) == (6, 3, 3)
    assert r["mean_accept_len"] == pytest.approx(2.25)
    assert r["per_position_acceptance"] == pytest.approx([0.75, 0.5])
    assert (r["lossless_trials"], r["not_lossless_trials"], r["unchecked_trials"]) == (6, 0, 0)
    assert r["run_ids"] == ["run-metal"] and r["device_keys"] == ["dk-metal"]
    assert 1.5 <= r["ci_lo"] <= r["speedup"] <= r["ci_hi"] <= 2.5  # resampled medians stay within the ratios

    by_domain = summary(synthetic)
    code = _row(by_domain, model_id=MODEL_A, mode="dspark", cap="2", domain="code")
    chat = _row(by_domain, model_id=MODEL_A, mode="dspark", cap="2", domain="chat")
    assert code["speedup"] == pytest.approx(1.75) and code["prompts"] == 2 and code["trials"] == 4
    assert code["baseline_median_tok_s"] == pytest.approx(75.0)  # median of 100, 110, 50, 50
    assert (chat["speedup"], chat["ci_lo"], chat["ci_hi"]) == pytest.approx((2.5, 2.5, 2.5))  # one prompt: no spread

    base = _row(pooled, model_id=MODEL_A, mode="baseline")
    assert (base["speedup"], base["ci_lo"], base["ci_hi"]) == (1.0, 1.0, 1.0)
    assert base["median_tok_s"] == base["baseline_median_tok_s"] == pytest.approx(80.0)


def test_not_lossless_trials_are_counted_not_dropped(synthetic):
    r = _row(summary(synthetic, by_domain=False), model_id=MODEL_A, mode="lookup", cap="4")
    assert (r["trials"], r["lossless_trials"], r["not_lossless_trials"]) == (6, 5, 1)
    assert r["speedup"] == pytest.approx(3.0)


def test_machines_are_kept_apart(synthetic):
    pooled = summary(synthetic, by_domain=False)
    cuda = _row(pooled, model_id=MODEL_A_CUDA, mode="dspark")
    assert cuda["machine"] == CUDA and cuda["speedup"] == pytest.approx(3.0) and cuda["run_ids"] == ["run-cuda"]
    only_cuda = summary(synthetic, ["run-cuda"], by_domain=False)
    assert set(only_cuda["machine"]) == {CUDA}


def test_same_model_on_two_machines_gives_two_rows(tmp_path):
    engine = open_db(fill_synthetic(tmp_path / "db.duckdb"))
    with Session(engine) as s:  # model A measured on the cuda machine too (run-cuda's device)
        for p in PROMPTS:
            s.add(trial("run-cuda", MODEL_A, "baseline", "0", p, 0, 100.0))
            s.add(trial("run-cuda", MODEL_A, "dspark", "2", p, 0, 400.0, drafter=HEAD_A))
        s.commit()
    got = {(r["machine"], r["speedup"]) for r in summary(engine, by_domain=False).iter_rows(named=True)
           if r["model_id"] == MODEL_A and r["mode"] == "dspark" and r["cap"] == "2"}
    assert got == {(METAL, 2.0), (CUDA, 4.0)}


def test_an_arm_is_paired_with_the_baseline_of_its_own_run(tmp_path):
    """Two lent machines of one class share a device key but not a speed: a second run on a
    host where everything ran slower is compared with its own baseline, not a pooled one."""
    from labdb import _run

    engine = open_db(fill_synthetic(tmp_path / "db.duckdb"))
    with Session(engine) as s:
        s.add(_run("run-metal-slow", METAL, "dk-metal", "metal"))
        s.add(_run("run-metal-nobase", METAL, "dk-metal", "metal"))
        for p in PROMPTS:
            for i in range(2):
                s.add(trial("run-metal-slow", MODEL_A, "baseline", "0", p, i, 40.0))
                s.add(trial("run-metal-slow", MODEL_A, "dspark", "7", p, i, 100.0, drafter=HEAD_A))
            s.add(trial("run-metal-nobase", MODEL_A, "dspark", "9", p, 0, 600.0, drafter=HEAD_A))
        s.commit()
    pooled = summary(engine, by_domain=False)
    slow = _row(pooled, model_id=MODEL_A, mode="dspark", cap="7")
    assert slow["speedup"] == pytest.approx(2.5) and (slow["ci_lo"], slow["ci_hi"]) == pytest.approx((2.5, 2.5))
    assert slow["baseline_median_tok_s"] == pytest.approx(40.0) and slow["run_ids"] == ["run-metal-slow"]
    # The first run's arm keeps its numbers: the slow run's baseline does not leak into it.
    assert _row(pooled, model_id=MODEL_A, mode="dspark", cap="2")["speedup"] == pytest.approx(EXPECT_DSPARK2["speedup"])
    # A run without a baseline of its own falls back to the device's baselines, pooled.
    nobase = _row(pooled, model_id=MODEL_A, mode="dspark", cap="9")
    assert nobase["matched_prompts"] == 3 and 600.0 / 80.0 < nobase["speedup"] < 600.0 / 40.0


def test_a_routed_copy_is_divided_by_its_models_plain_decoding(tmp_path):
    """MODEL@rows-kernel's arms divide by MODEL's baseline where their run measured it: plain
    decoding never routes products through the rows kernel, so MODEL's is the decoding a user
    would otherwise get (the routed copy's own baseline, slower, inflated its speedups); without
    MODEL's baseline in the run, the routed copy's own. Other models keep their own baseline."""
    from labdb import _run

    from dspark_lab.db.queries import plain_decoding_model

    routed = f"{MODEL_A}@rows-kernel"
    assert plain_decoding_model(routed) == MODEL_A and plain_decoding_model(f"{MODEL_A}@q8") == f"{MODEL_A}@q8"
    engine = open_db(tmp_path / "db.duckdb")
    with Session(engine) as s:
        s.add(_run("both", METAL, "dk-metal", "metal"))
        s.add(_run("routed-only", METAL, "dk-metal", "metal"))
        for p in PROMPTS:
            for i in range(2):
                s.add(trial("both", MODEL_A, "baseline", "0", p, i, 100.0))
                s.add(trial("both", MODEL_A, "dspark-pipe", "3", p, i, 150.0, drafter=HEAD_A))
                s.add(trial("both", routed, "baseline", "0", p, i, 80.0))
                s.add(trial("both", routed, "dspark-pipe", "3", p, i, 170.0, drafter=HEAD_A))
                s.add(trial("routed-only", routed, "baseline", "0", p, i, 50.0))
                s.add(trial("routed-only", routed, "dspark-pipe", "4", p, i, 100.0, drafter=HEAD_A))
        s.commit()
    rows = summary(engine, by_domain=False)
    own = _row(rows, model_id=MODEL_A, mode="dspark-pipe", cap="3")
    assert own["speedup"] == pytest.approx(1.5) and own["baseline_median_tok_s"] == pytest.approx(100.0)
    arm = _row(rows, model_id=routed, mode="dspark-pipe", cap="3")
    assert arm["speedup"] == pytest.approx(1.7) and arm["baseline_median_tok_s"] == pytest.approx(100.0)  # not 170 / 80
    alone = _row(rows, model_id=routed, mode="dspark-pipe", cap="4")
    assert alone["speedup"] == pytest.approx(2.0) and alone["baseline_median_tok_s"] == pytest.approx(50.0)
    assert _row(rows, model_id=routed, mode="baseline", cap="0")["speedup"] == 1.0


def test_summary_is_deterministic_in_the_seed(synthetic):
    assert summary(synthetic, seed=3).equals(summary(synthetic, seed=3))
    no_boot = summary(synthetic, n_boot=0, by_domain=False).filter(summary(synthetic, by_domain=False)["mode"] == "dspark")
    assert no_boot["ci_lo"].to_list() == no_boot["speedup"].to_list() == no_boot["ci_hi"].to_list()


def test_empty_database(tmp_path):
    engine = open_db(tmp_path / "empty.duckdb")
    assert trials_frame(engine).height == 0
    s = summary(engine)
    assert s.height == 0 and "speedup" in s.columns


def test_cap_order():
    assert sorted(["auto", "10", "2", "0"], key=cap_order) == ["0", "2", "10", "auto"]


def test_summary_matches_a_plain_recomputation_on_a_real_sweep(tmp_path):
    engine = sweep_db(tmp_path)
    s = summary(engine)
    path = engine.url.database
    engine.dispose()
    con = duckdb.connect(path, read_only=True)
    rows = con.execute("select model_id, drafter_id, mode, cap, domain, prompt_id, decode_tokens_per_sec, lossless "
                       "from trials").fetchall()
    con.close()
    assert s.height == 2 * (1 + 2 * 2)  # domains x (baseline + {lookup, dspark} x caps {2, 4})
    base = {(r[4], r[5]): r[6] for r in rows if r[2] == "baseline"}  # one trial per prompt
    for arm in s.iter_rows(named=True):
        mine = [r for r in rows if (r[1], r[2], r[3], r[4]) == (arm["drafter_id"], arm["mode"], arm["cap"], arm["domain"])]
        assert arm["trials"] == len(mine) == 2
        assert arm["median_tok_s"] == pytest.approx(statistics.median(r[6] for r in mine))
        ratios = [r[6] / base[(r[4], r[5])] for r in mine]
        assert arm["speedup"] == pytest.approx(1.0 if arm["mode"] == "baseline" else statistics.median(ratios))
        if arm["mode"] != "baseline":
            assert arm["lossless_trials"] + arm["not_lossless_trials"] + arm["unchecked_trials"] == len(mine)
            assert arm["not_lossless_trials"] == sum(1 for r in mine if r[7] is False)
    json.dumps(s.to_dicts())  # plain data all the way down


def test_a_malformed_list_column_is_a_clear_error(tmp_path):
    engine = synthetic_db(tmp_path)
    with engine.begin() as conn:
        conn.exec_driver_sql("update trials set accept_lengths = '[1, 2' where id = (select min(id) from trials)")
    with pytest.raises(DsparkError, match="has a malformed accept_lengths"):
        trials_frame(engine)


def _two_runs_of_one_prompt(tmp_path, first: dict, second: dict):
    """code-001 measured by two runs on one device: baseline 100 tok/s and dspark at 200 (ratio 2)
    in the first, baseline 100 and dspark 300 (ratio 3) in the second. `first` and `second`: each
    run's prompt_set_version and prompt_digest (trial's version=, digest=)."""
    from labdb import _run

    engine = open_db(tmp_path / "db.duckdb")
    prompt = PROMPTS[0]
    with Session(engine) as s:
        for run_id, stored, arm_tok_s in (("run-1", first, 200.0), ("run-2", second, 300.0)):
            s.add(_run(run_id, METAL, "dk-metal", "metal"))
            s.add(trial(run_id, MODEL_A, "baseline", "0", prompt, 0, 100.0, **stored))
            s.add(trial(run_id, MODEL_A, "dspark", "2", prompt, 0, arm_tok_s, drafter=HEAD_A, **stored))
        s.commit()
    return summary(engine, by_domain=False)


def test_one_prompt_run_from_two_prompt_limits_counts_once(tmp_path):
    """The same prompt, run by a sweep that kept 2 prompts of its set and one that kept 4: two set
    versions, one prompt digest. It is one prompt, its ratio the mean of the two runs' (2 and 3)."""
    from dspark_lab.lab.prompts import load_prompt_set

    short, long = load_prompt_set("code", limit=2), load_prompt_set("code", limit=4)
    assert short.version != long.version and short.prompts[0].id == PROMPTS[0][1]
    digest = short.prompts[0].digest
    rows = _two_runs_of_one_prompt(tmp_path, {"version": short.version, "digest": digest},
                                   {"version": long.version, "digest": digest})
    arm = _row(rows, mode="dspark", cap="2")
    assert (arm["trials"], arm["prompts"], arm["matched_prompts"]) == (2, 1, 1)
    assert arm["speedup"] == pytest.approx(2.5) and (arm["ci_lo"], arm["ci_hi"]) == pytest.approx((2.5, 2.5))
    assert _row(rows, mode="baseline")["prompts"] == 1


def test_without_digests_a_prompt_is_known_by_its_set_version(tmp_path):
    """Trials stored before digests, of a set the lab cannot rebuild, keep today's identity: two
    set versions are two prompts (each its own run's ratio), one version is one prompt."""
    two = _row(_two_runs_of_one_prompt(tmp_path / "two", {"version": "mine-a"}, {"version": "mine-b"}), mode="dspark")
    assert (two["prompts"], two["matched_prompts"]) == (2, 2)
    assert two["speedup"] == pytest.approx(2.5) and two["ci_lo"] < 2.5 < two["ci_hi"]  # resamples {2, 3}
    one = _row(_two_runs_of_one_prompt(tmp_path / "one", {"version": "mine-a"}, {"version": "mine-a"}), mode="dspark")
    assert (one["prompts"], one["matched_prompts"]) == (1, 1) and one["speedup"] == pytest.approx(2.5)


def test_a_trial_without_a_digest_takes_the_one_its_set_version_fixes(tmp_path):
    """A run of a user's prompt file stored before digests, beside one stored after: the same set
    version is the same text, so the prompt counts once. Within one run resumed across the upgrade
    (a baseline without a digest, an arm with one) the arm still pairs with its own run's baseline."""
    old, new = {"version": "mine-a"}, {"version": "mine-a", "digest": "d1"}
    rows = _two_runs_of_one_prompt(tmp_path / "mixed", old, new)
    assert (_row(rows, mode="dspark")["prompts"], _row(rows, mode="baseline")["prompts"]) == (1, 1)

    from labdb import _run

    engine = open_db(tmp_path / "resumed.duckdb")
    prompt = PROMPTS[0]
    with Session(engine) as s:
        s.add(_run("resumed", METAL, "dk-metal", "metal"))
        s.add(_run("other", METAL, "dk-metal", "metal"))
        s.add(trial("resumed", MODEL_A, "baseline", "0", prompt, 0, 100.0, **old))
        s.add(trial("resumed", MODEL_A, "dspark", "2", prompt, 0, 200.0, drafter=HEAD_A, **new))
        s.add(trial("other", MODEL_A, "baseline", "0", prompt, 0, 50.0, **new))  # a slower machine's baseline
        s.commit()
    arm = _row(summary(engine, by_domain=False), mode="dspark")
    assert arm["speedup"] == pytest.approx(2.0)  # 200 / its own run's 100, not / the other run's 50
