"""A trial's prompt by its own digest: the schema 4 migration, the backfill of trials stored
before it (exact for built-in sets cut by any --prompt-limit, NULL for any other set), and result
JSON written before it, which ingest fills the same way."""

import json

import pytest
from labdb import _run, as_older_schema, rows, trial
from sqlmodel import Session

from dspark_lab.db.store import open_db
from dspark_lab.lab.prompt_identity import backfill_prompt_digests, fill_prompt_digests, known_digest
from dspark_lab.lab.prompts import load_prompt_set
from dspark_lab.lab.results import export_run, ingest
from dspark_lab.schemas.records import SCHEMA_VERSION

MODEL = "mlx-community/Qwen3-8B-4bit"
CODE_3 = load_prompt_set("code", limit=3)  # a sweep with --prompt-limit 3
CODE_002 = CODE_3.prompts[1]


def old_trials(run_id: str) -> list:
    """Trials as stored before digests: code-002 of the built-in code set cut at 3 prompts, a
    prompt of a user's file, and code-002 of a code set edited since (a version no limit of
    today's built-in set gives)."""
    return [trial(run_id, MODEL, "baseline", "0", ("code", CODE_002.id, "code"), 0, 100.0, version=CODE_3.version),
            trial(run_id, MODEL, "baseline", "0", ("mine", "q-1", "chat"), 0, 100.0, version="0123456789ab"),
            trial(run_id, MODEL, "baseline", "0", ("code", CODE_002.id, "code"), 0, 100.0, version="edited000000")]


def write_version_3_database(path):
    """A database as schema 3 left it: old_trials stored, no prompt_digest column."""
    engine = open_db(path)
    with Session(engine) as s:
        s.add(_run("run-old", "Apple M3 Max 64GB (metal)", "dk-metal", "metal"))
        s.add_all(old_trials("run-old"))
        s.commit()
    as_older_schema(engine, 3, ["prompt_digest"])
    engine.dispose()
    return path


def test_a_version_3_database_gains_the_prompt_digest_column(tmp_path):
    db = write_version_3_database(tmp_path / "v3.duckdb")
    assert "prompt_digest" not in {c for (c,) in rows(db, "select column_name from information_schema.columns where table_name = 'trials'")}
    open_db(db).dispose()
    assert "prompt_digest" in {c for (c,) in rows(db, "select column_name from information_schema.columns where table_name = 'trials'")}
    assert rows(db, "select max(version) from schema_info")[0][0] == SCHEMA_VERSION == 4
    # The migration itself guesses nothing: old trials stay NULL until the lab fills what it can.
    assert rows(db, "select count(*) from trials where prompt_digest is null")[0][0] == 3


def test_the_backfill_fills_a_limited_built_in_set_and_leaves_other_sets_alone(tmp_path):
    db = write_version_3_database(tmp_path / "v3.duckdb")
    engine = open_db(db)
    assert backfill_prompt_digests(engine) == 1
    assert backfill_prompt_digests(engine) == 0  # again: nothing left it can fill
    engine.dispose()
    got = dict(rows(db, "select prompt_set || ':' || prompt_set_version, prompt_digest from trials"))
    # The same digest as the prompt has in the whole set, which a sweep today would store.
    assert got == {f"code:{CODE_3.version}": load_prompt_set("code").prompts[1].digest,
                   "mine:0123456789ab": None, "code:edited000000": None}


def test_every_limit_of_a_built_in_set_is_recognised():
    whole = load_prompt_set("math")
    for limit in (1, len(whole) // 2, len(whole) - 1, None):
        kept = load_prompt_set("math", limit=limit)
        assert known_digest("math", kept.version, kept.prompts[-1].id) == kept.prompts[-1].digest
    assert known_digest("math", whole.version, "no-such-id") is None
    assert known_digest("code", whole.version, whole.prompts[0].id) is None  # a version is a set's own


def test_trials_in_memory_are_filled_without_touching_a_digest_they_have():
    trials = old_trials("r")
    trials.append(trial("r", MODEL, "baseline", "0", ("code", CODE_002.id, "code"), 0, 1.0, version=CODE_3.version, digest="kept"))
    assert fill_prompt_digests(trials) == 1
    assert [t.prompt_digest for t in trials] == [CODE_002.digest, None, None, "kept"]


@pytest.fixture()
def old_result_file(tmp_path):
    """Result JSON as dspark-lab wrote it at schema 3: no prompt_digest anywhere."""
    engine = open_db(tmp_path / "measured.duckdb")
    with Session(engine) as s:
        s.add(_run("run-old", "Apple M3 Max 64GB (metal)", "dk-metal", "metal"))
        s.add_all(old_trials("run-old"))
        s.commit()
    path = export_run(engine, "run-old", tmp_path / "old.json")
    engine.dispose()
    doc = json.loads(path.read_text())
    doc["schema_version"] = 3
    doc["fields"]["trial"].remove("prompt_digest")
    for t in doc["trials"]:
        del t["prompt_digest"]
    path.write_text(json.dumps(doc))
    return path


def test_an_old_result_file_is_ingested_with_the_digests_its_sets_fix(old_result_file, tmp_path):
    db = tmp_path / "merged.duckdb"
    engine = open_db(db)
    assert "ingested run run-old: 3 trials" in ingest(engine, [old_result_file])[0][1]
    engine.dispose()
    assert sorted(rows(db, "select prompt_set, prompt_digest from trials"), key=str) == sorted(
        [("code", CODE_002.digest), ("mine", None), ("code", None)], key=str)


def test_ingest_fills_the_old_trials_already_in_the_database(old_result_file, tmp_path):
    db = write_version_3_database(tmp_path / "v3.duckdb")
    engine = open_db(db)
    doc = json.loads(old_result_file.read_text())
    doc["run"]["id"] = "run-other"
    for t in doc["trials"]:
        t["run_id"], t["id"] = "run-other", t["id"] + "-other"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    ingest(engine, [other])
    engine.dispose()
    assert rows(db, "select run_id, count(*) from trials where prompt_digest is not null group by run_id order by run_id") == [
        ("run-old", 1), ("run-other", 1)]


def test_a_new_result_file_keeps_its_digests(tmp_path):
    """Export and ingest carry the field: a digest stored by a sweep survives the round trip."""
    engine = open_db(tmp_path / "a.duckdb")
    with Session(engine) as s:
        s.add(_run("run-new", "Apple M3 Max 64GB (metal)", "dk-metal", "metal"))
        s.add(trial("run-new", MODEL, "baseline", "0", ("mine", "q-1", "chat"), 0, 100.0, version="0123456789ab", digest="d0d0d0d0d0d0"))
        s.commit()
    path = export_run(engine, "run-new", tmp_path / "new.json")
    engine.dispose()
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and "prompt_digest" in doc["fields"]["trial"]
    other = open_db(tmp_path / "b.duckdb")
    ingest(other, [path])
    other.dispose()
    assert rows(tmp_path / "b.duckdb", "select prompt_digest from trials") == [("d0d0d0d0d0d0",)]


def test_building_a_registry_or_a_report_fills_an_old_database_first(tmp_path):
    from typer.testing import CliRunner

    from dspark_lab.cli import app

    for command in (["registry", "build", "--out", str(tmp_path / "registry.json")], ["report", "--out", str(tmp_path / "r.html")]):
        db = write_version_3_database(tmp_path / f"{command[0]}.duckdb")
        result = CliRunner().invoke(app, [*command, "--db", str(db)])
        assert result.exit_code == 0, result.output
        assert rows(db, "select count(*) from trials where prompt_digest is not null")[0][0] == 1
