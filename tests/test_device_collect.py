"""benchmarks/h200_collect.sh, the copy that brings a device run's results back in every polling
call (a lent machine given back loses everything on it): within a call's return limits (8 files,
16 MiB each), the weights whole or in parts that join to the original, and the card, logs and the
data's generated rows (not the read corpus rows) in one archive; a head too large for one call comes
back over several, one frozen version at a time, and benchmarks/join_parts.py joins the newest
version whose parts are all there, never parts of two."""

import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "h200_collect.sh"
_join = load_script("join_parts")
join_parts, JoinError = _join.join_parts, _join.JoinError


@pytest.fixture
def run_dir():
    name = f"dspark-collect-test-{uuid.uuid4().hex[:8]}"  # the script reads /tmp/NAME, as on the device
    run = Path("/tmp") / name
    run.mkdir()
    yield name, run
    shutil.rmtree(run, ignore_errors=True)


def collect(name, out, **env):
    return subprocess.run(["bash", str(SCRIPT), name], env={**os.environ, "OUT": str(out), **env},
                          capture_output=True, text=True, check=True).stdout


def test_collect_returns_head_logs_and_generated_rows(run_dir, tmp_path):
    name, run = run_dir
    (run / "config.json").write_text('{"block_size": 5}')
    weights = os.urandom(20_000_000)  # over the 16 MB a returned file may be: comes back in parts
    (run / "model.safetensors").write_bytes(weights)
    (run / "README.md").write_text("card")
    (run / "distill.log").write_text("log")
    (run / "self_instruct.log").write_text("4000 requests")  # SELF_INSTRUCT: what the target wrote itself
    (run / "self_code_s1.jsonl.gz").write_bytes(b"requests")
    (run / "precision.json").write_text("{}")  # GRID: the committed head timed at each precision
    (run / "precision.log").write_text("grid")
    (run / "sweep.json").write_text("{}")  # SWEEP: the lab's sweep of the kept head, a result JSON to ingest
    rows = [{"ids": [1, 2], "prompt_len": 1, "generation": "greedy-batched"},
            {"ids": [3, 4], "prompt_len": 1, "generation": "corpus"},
            {"ids": [5, 6], "prompt_len": 1, "generation": "greedy"}]
    (run / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    out.mkdir()
    collect(name, out)
    returned = sorted(p.name for p in out.iterdir())
    assert len(returned) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in out.iterdir())
    parts = sorted(out.glob("model.safetensors.part[0-9]*"))
    assert len(parts) == 2 and b"".join(p.read_bytes() for p in parts) == weights
    assert _join.read_manifest(out / "model.safetensors.parts") == {
        "sha256": hashlib.sha256(weights).hexdigest(), "parts": 2, "size": len(weights)}
    assert json.loads((out / "config.json").read_text()) == {"block_size": 5}
    with tarfile.open(out / "results.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["README.md", "distill.log", "generated.jsonl", "precision.json", "precision.log",
                                          "self_code_s1.jsonl.gz", "self_instruct.log", "sweep.json"]
        generated = [json.loads(line) for line in tar.extractfile("generated.jsonl").read().decode().splitlines()]
    assert [r["ids"] for r in generated] == [[1, 2], [5, 6]]


def test_weights_0_returns_everything_but_the_weights(run_dir, tmp_path):
    name, run = run_dir
    (run / "config.json").write_text('{"block_size": 8}')
    (run / "model.safetensors").write_bytes(os.urandom(20_000_000))
    (run / "eval.json").write_text("{}")
    (run / "data.jsonl").write_text(json.dumps({"ids": [1, 2], "prompt_len": 1, "generation": "greedy-batched"}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    said = collect(name, out, WEIGHTS="0")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "results.tar.gz"] and "weights" not in said
    with tarfile.open(out / "results.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["eval.json", "generated.jsonl"]


def test_collect_leaves_out_the_rows_that_were_shipped(run_dir, tmp_path):
    # h200_corpus_heads.sh counts the rows that came in DATA; only the ones made on the device
    # come back (the fifteenth round's Qwen 1.5B run trained on 42,944 shipped rows and made none).
    name, run = run_dir
    rows = [{"ids": [i, i], "prompt_len": 1, "generation": "greedy-batched"} for i in range(3)]
    (run / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / ".shipped_rows").write_text("2\n")
    (run / "distill.log").write_text("log")
    out = tmp_path / "out"
    out.mkdir()
    collect(name, out)
    with tarfile.open(out / "results.tar.gz") as tar:
        generated = [json.loads(line) for line in tar.extractfile("generated.jsonl").read().decode().splitlines()]
    assert [r["ids"] for r in generated] == [[2, 2]]
    (run / ".shipped_rows").write_text("3\n")  # nothing made here: no rows file at all
    again = tmp_path / "again"
    again.mkdir()
    collect(name, again)
    with tarfile.open(again / "results.tar.gz") as tar:
        assert tar.getnames() == ["distill.log"]


def test_collect_before_anything_exists_returns_nothing_and_succeeds(run_dir, tmp_path):
    name, _ = run_dir
    collect(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def _safetensors(n: int) -> bytes:
    """A valid safetensors file of one n-byte tensor (what join_parts checks the header of)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + os.urandom(n)


HEAD = 80_000_000  # 6 parts of 15 MB: more than one call carries (4 beside a small archive, 3 beside a large one)


def _parts(out):
    return sorted(p.name.removeprefix("model.safetensors.part") for p in out.glob("model.safetensors.part[0-9]*"))


def test_large_head_comes_back_over_several_polls_and_joins(run_dir, tmp_path):
    # The ninth round's Qwen head was 103 MB (7 parts) and the old script returned parts 00-02
    # unless told otherwise: 05 and 06 never came back. Now each poll brings the parts not yet
    # returned of the current version, and says which are still to fetch.
    name, run = run_dir
    (run / "config.json").write_text('{"block_size": 8}')
    weights = _safetensors(HEAD)
    (run / "model.safetensors").write_bytes(weights)
    outs = []
    for i in range(3):
        out = tmp_path / f"call{i}"
        out.mkdir()
        said = collect(name, out)
        outs.append(out)
        assert len(list(out.iterdir())) <= 8 and sum(p.stat().st_size for p in out.iterdir()) <= 64 * 2**20
        if i == 0:  # no results archive yet: four 15 MB parts fit in the call's 64 MiB
            assert _parts(out) == ["00", "01", "02", "03"] and "STILL TO FETCH: 04 05" in said
        elif i == 1:
            assert _parts(out) == ["04", "05"] and "all 6 parts returned" in said
        else:
            assert _parts(out) == [] and "all 6 parts returned" in said
    head = join_parts(tmp_path / "head", outs)
    assert head.read_bytes() == weights
    assert json.loads((tmp_path / "head" / "config.json").read_text()) == {"block_size": 8}


def _call(name, tmp_path, label):
    out = tmp_path / label
    out.mkdir()
    return out, collect(name, out)


def test_a_version_comes_back_whole_before_the_next_checkpoint_is_taken(run_dir, tmp_path):
    # Checkpoints every minute or two, polls every three or four: when each poll restarted on the
    # newest weights, no version ever came back whole (the twelfth round's polls brought only logs,
    # and its head was lost with the machine). The parts now come from one frozen version until
    # all of it is home; join_parts takes the newest whole version and never mixes two.
    name, run = run_dir
    old, new = _safetensors(HEAD), _safetensors(HEAD)
    (run / "model.safetensors").write_bytes(old)
    first, _ = _call(name, tmp_path, "first")  # parts 00-03 of the old version
    (run / "model.safetensors").write_bytes(new)  # a checkpoint in between
    second, said = _call(name, tmp_path, "second")
    assert _parts(second) == ["04", "05"] and "all 6 parts returned" in said  # the old version finished first
    assert join_parts(tmp_path / "old", [first, second]).read_bytes() == old
    third, said = _call(name, tmp_path, "third")  # now the new version
    assert _parts(third) == ["00", "01", "02", "03"] and "STILL TO FETCH: 04 05" in said
    # The newest version lacks parts 04-05: the newest whole one (the old) is joined, not a mix.
    assert join_parts(tmp_path / "head", [first, second, third]).read_bytes() == old
    with pytest.raises(JoinError, match="parts 04, 05 of version"):
        join_parts(tmp_path / "mixed", [first, third])  # old 00-03 and new 00-03: neither whole
    fourth, _ = _call(name, tmp_path, "fourth")
    assert join_parts(tmp_path / "head", [first, second, third, fourth]).read_bytes() == new


def test_the_final_head_goes_first_once_distill_has_ended(run_dir, tmp_path):
    name, run = run_dir
    checkpoint, final = _safetensors(HEAD), _safetensors(HEAD)
    (run / "model.safetensors").write_bytes(checkpoint)
    first, _ = _call(name, tmp_path, "first")  # a checkpoint's parts 00-03
    (run / "model.safetensors").write_bytes(final)
    (run / ".distill_done").touch()  # h200_corpus_heads.sh, after distill
    second, said = _call(name, tmp_path, "second")
    assert _parts(second) == ["00", "01", "02", "03"] and "STILL TO FETCH: 04 05" in said
    third, _ = _call(name, tmp_path, "third")
    assert join_parts(tmp_path / "head", [first, second, third]).read_bytes() == final


def test_join_refuses_a_damaged_part_and_a_cut_file(tmp_path):
    whole = _safetensors(40_000_000)
    d = tmp_path / "call"
    d.mkdir()
    for i in range(0, len(whole), 15_000_000):
        (d / f"model.safetensors.part{i // 15_000_000:02d}").write_bytes(whole[i : i + 15_000_000])
    manifest = f"sha256 {hashlib.sha256(whole).hexdigest()}\nparts 3\nsize {len(whole)}\n"
    (d / "model.safetensors.parts").write_text(manifest)
    assert join_parts(tmp_path / "ok", [d]).read_bytes() == whole
    damaged = bytearray((d / "model.safetensors.part01").read_bytes())
    damaged[5] ^= 1
    (d / "model.safetensors.part01").write_bytes(bytes(damaged))
    with pytest.raises(JoinError, match="damaged"):
        join_parts(tmp_path / "bad", [d])
    # A file cut short on the device (sha256 of the cut copy) is caught by its own header.
    cut = whole[:-1000]
    for p in d.glob("model.safetensors.part[0-9]*"):
        p.unlink()
    (d / "model.safetensors.part00").write_bytes(cut)
    (d / "model.safetensors.parts").write_text(f"sha256 {hashlib.sha256(cut).hexdigest()}\nparts 1\nsize {len(cut)}\n")
    with pytest.raises(JoinError, match="header ends at"):
        join_parts(tmp_path / "cut", [d])
    with pytest.raises(JoinError, match="none of the folders"):
        join_parts(tmp_path / "none", [tmp_path / "ok"])


def _archived(out):
    with tarfile.open(out / "results.tar.gz") as tar:
        return sorted(tar.getnames())


def test_unchanged_generated_rows_give_their_room_to_weight_parts(run_dir, tmp_path):
    # In the fourteenth round the 12 MB of generated rows came back in every call, beside 3 weight
    # parts; the final head took three polls and the timing after it was cut off by the session's
    # end. Rows that already came back and have not changed since are left out while parts wait
    # (a fourth part fits instead), except every fourth call, in case one call's files were lost.
    name, run = run_dir
    rng = random.Random(0)
    rows = [{"ids": [rng.randrange(10**9) for _ in range(500)], "prompt_len": 1, "generation": "greedy-batched"}
            for _ in range(3000)]  # about 15 MB of JSON that compresses to about 7 MB
    (run / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "distill.log").write_text("log")
    old, new = _safetensors(110_000_000), _safetensors(110_000_000)  # 8 parts
    (run / "model.safetensors").write_bytes(old)
    calls = []
    for i in range(3):
        out, said = _call(name, tmp_path, f"call{i}")
        calls.append(out)
        assert len(list(out.iterdir())) <= 8 and sum(p.stat().st_size for p in out.iterdir()) <= 64 * 2**20
        if i == 0:  # the rows' first time: 3 parts beside them
            assert "generated.jsonl" in _archived(out) and _parts(out) == ["00", "01", "02"]
        elif i == 1:  # the same rows, parts waiting: rows left out, 4 parts
            assert _archived(out) == ["distill.log"] and _parts(out) == ["03", "04", "05", "06"]
            assert "generated rows left out" in said
        else:
            assert _archived(out) == ["distill.log"] and _parts(out) == ["07"] and "all 8 parts returned" in said
    assert join_parts(tmp_path / "old", calls).read_bytes() == old
    (run / "model.safetensors").write_bytes(new)  # a checkpoint: parts wait again, but this is call 4
    fourth, _ = _call(name, tmp_path, "call3")
    assert "generated.jsonl" in _archived(fourth) and _parts(fourth) == ["00", "01", "02"]
    fifth, _ = _call(name, tmp_path, "call4")
    assert _archived(fifth) == ["distill.log"] and _parts(fifth) == ["03", "04", "05", "06"]
    with open(run / "data.jsonl", "a") as f:  # the generation wrote more rows: they come back at once
        f.write(json.dumps({"ids": [7, 8], "prompt_len": 1, "generation": "greedy"}) + "\n")
    sixth, _ = _call(name, tmp_path, "call5")
    assert "generated.jsonl" in _archived(sixth) and _parts(sixth) == ["07"]
    assert join_parts(tmp_path / "new", [fourth, fifth, sixth]).read_bytes() == new
    seventh, said = _call(name, tmp_path, "call6")  # nothing waits: the whole archive, as before
    assert "generated.jsonl" in _archived(seventh) and _parts(seventh) == []


def test_head_q4_returns_the_quantized_head_its_card_and_the_float_evaluation(run_dir, tmp_path):
    name, run = run_dir
    (run / "config.json").write_text('{"block_size": 8}')
    (run / "model.safetensors").write_bytes(os.urandom(20_000_000))  # the float head: stays there
    (run / "q4").mkdir()
    (run / "q4" / "config.json").write_text('{"block_size": 8, "quantization": {"bits": 4, "group_size": 64}}')
    q4 = os.urandom(1_000_000)
    (run / "q4" / "model.safetensors").write_bytes(q4)
    (run / "q4" / "README.md").write_text("card, 4 bits")
    for f in ("eval.json", "eval_float.json", "quantize.log"):
        (run / f).write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    collect(name, out, HEAD="q4")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "results.tar.gz"]
    assert (out / "model.safetensors").read_bytes() == q4 and "quantization" in (out / "config.json").read_text()
    with tarfile.open(out / "results.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["eval.json", "eval_float.json", "q4/README.md", "quantize.log"]


QUANTIZE_STUB = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
prev=""
for a in "$@"; do
  [ "$prev" = "--out" ] && mkdir -p "$a" && echo '{"quantization": {"bits": 4}}' > "$a/config.json" && cp "$4/model.safetensors" "$a/model.safetensors"
  prev=$a
done
echo "$4: weights 64.5 MB -> 18.1 MB at 4 bits"
"""


def test_head_q4_stores_each_new_checkpoint_quantized_while_distill_runs(run_dir, tmp_path):
    # A machine given back between two polls loses what is on it: each poll brings back the head
    # as far as it has trained, at 4 bits (small enough to commit), not only the final one.
    name, run = run_dir
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(QUANTIZE_STUB)
    (bin_dir / "python3").chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {"HEAD": "q4", "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls)}
    (run / "config.json").write_text("{}")
    (run / "model.safetensors").write_bytes(b"checkpoint 1")
    out = tmp_path / "out"
    out.mkdir()
    said = collect(name, out, **env)
    assert f"quantize-head {run} --out {run}/q4.poll --bits 4" in calls.read_text() and "stored the newest checkpoint" in said
    assert (out / "model.safetensors").read_bytes() == b"checkpoint 1" and not (run / "q4.poll").exists()
    shutil.rmtree(out); out.mkdir()
    collect(name, out, **env)  # no newer checkpoint: nothing quantized again
    assert len(calls.read_text().splitlines()) == 1 and (out / "model.safetensors").read_bytes() == b"checkpoint 1"
    os.utime(run / "model.safetensors", (2e9, 2e9))  # a newer checkpoint
    (run / "model.safetensors").write_bytes(b"checkpoint 2")
    os.utime(run / "model.safetensors", (2e9, 2e9))
    shutil.rmtree(out); out.mkdir()
    collect(name, out, **env)
    assert len(calls.read_text().splitlines()) == 2 and (out / "model.safetensors").read_bytes() == b"checkpoint 2"
    (run / ".distill_done").touch()  # the run script stores the final head itself
    os.utime(run / "model.safetensors", (3e9, 3e9))
    shutil.rmtree(out); out.mkdir()
    collect(name, out, **env)
    assert len(calls.read_text().splitlines()) == 2


def test_wait_ends_when_the_run_reaches_its_next_stage_not_on_an_earlier_mark(run_dir, tmp_path):
    # WAIT lets one poll call spend its time waiting on the device and return as soon as distill or
    # the run ends. A mark from before the call (distill ended in an earlier poll) must not end it.
    name, run = run_dir
    (run / ".distill_done").touch()
    (run / "eval.json").write_text("{}")
    threading.Timer(2.0, lambda: (run / ".run_done").touch()).start()
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    # Without the early end this call would wait 300 s, and the timeout fails the test.
    said = subprocess.run(["bash", str(SCRIPT), name], env={**os.environ, "OUT": str(out), "WAIT": "300"},
                          capture_output=True, text=True, check=True, timeout=120).stdout
    assert "the run has ended" in said and time.monotonic() - started >= 1.5
    assert (out / "results.tar.gz").exists()  # and then it collects as always


def test_until_end_waits_past_distills_end_for_the_runs(run_dir, tmp_path):
    # The twenty-eighth round lost its run in the gap after a poll: UNTIL=end lets a run planned to
    # end inside one poll come back whole (head stored, evaluated) in that poll.
    name, run = run_dir
    (run / ".pid").write_text(f"{os.getpid()}\n")  # alive throughout
    for until, want in (("stage", "the run reached its next stage"), ("end", "the run has ended")):
        for mark in (".distill_done", ".run_done"):
            (run / mark).unlink(missing_ok=True)
        distill_ends = threading.Timer(1.0, lambda: (run / ".distill_done").touch())
        run_ends = threading.Timer(6.0, lambda: (run / ".run_done").touch())
        distill_ends.start(), run_ends.start()
        out = tmp_path / until
        out.mkdir()
        said = subprocess.run(["bash", str(SCRIPT), name], env={**os.environ, "OUT": str(out), "WAIT": "300", "UNTIL": until},
                              capture_output=True, text=True, check=True, timeout=120).stdout
        run_ends.join()  # before the next case clears the marks
        waited = int(re.search(r"waited (\d+) s of 300", said).group(1))
        assert want in said, (until, said)
        assert (waited < 5) if until == "stage" else (waited >= 3), (until, said)  # stage: not the run's end


def test_until_refuses_a_word_it_does_not_know(run_dir, tmp_path):
    name, _ = run_dir
    result = subprocess.run(["bash", str(SCRIPT), name], env={**os.environ, "OUT": str(tmp_path), "UNTIL": "done"},
                            capture_output=True, text=True)
    assert result.returncode == 2 and "UNTIL must be 'stage'" in result.stdout and "got 'done'" in result.stdout


def test_wait_collects_after_its_seconds_when_nothing_happens(run_dir, tmp_path):
    name, run = run_dir
    (run / "distill.log").write_text("log")
    out = tmp_path / "out"
    out.mkdir()
    said = collect(name, out, WAIT="1")
    assert "waited 1 s of 1" in said and "next stage" not in said and (out / "results.tar.gz").exists()


def test_wait_refuses_what_is_not_whole_seconds(run_dir, tmp_path):
    name, _ = run_dir
    result = subprocess.run(["bash", str(SCRIPT), name], env={**os.environ, "OUT": str(tmp_path), "WAIT": "9.5"},
                            capture_output=True, text=True)
    assert result.returncode == 2 and "WAIT must be a whole number of seconds, got '9.5'" in result.stdout


def test_a_fresh_machine_says_the_run_is_lost_at_once_instead_of_waiting(tmp_path):
    # The twenty-third round's machine was given back between two polls; the next poll started a
    # fresh one and waited its whole WAIT (540 s of device time) for a run that was not there.
    name = f"dspark-collect-test-{uuid.uuid4().hex[:8]}"  # no /tmp/NAME: nothing ever ran here
    started = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT), name], env={**os.environ, "OUT": str(tmp_path), "WAIT": "300"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 3 and time.monotonic() - started < 60
    assert f"no run {name} on this machine" in result.stdout and "start the run anew" in result.stdout
    assert list(tmp_path.iterdir()) == []


def _ended_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_wait_ends_when_the_run_process_has_died_without_finishing(run_dir, tmp_path):
    name, run = run_dir
    (run / "distill.log").write_text("Traceback: out of memory")
    (run / ".pid").write_text(f"{_ended_pid()}\n")
    out = tmp_path / "out"
    out.mkdir()
    said = subprocess.run(["bash", str(SCRIPT), name], env={**os.environ, "OUT": str(out), "WAIT": "300"},
                          capture_output=True, text=True, check=True, timeout=120).stdout
    assert "has ended without finishing" in said and "waited 0 s of 300" in said
    with tarfile.open(out / "results.tar.gz") as tar:  # and it still brings back what there is
        assert "distill.log" in tar.getnames()


def test_wait_ends_at_once_when_the_run_had_already_finished(run_dir, tmp_path):
    name, run = run_dir
    (run / ".pid").write_text(f"{_ended_pid()}\n")
    (run / ".run_done").touch()
    os.utime(run / ".run_done", (time.time() - 60, time.time() - 60))  # before this call began
    said = collect(name, tmp_path, WAIT="300")
    assert "the run had finished before this call" in said


def test_wait_goes_on_while_the_run_process_lives(run_dir, tmp_path):
    name, run = run_dir
    (run / ".pid").write_text(f"{os.getpid()}\n")  # this test's own process: alive throughout
    (run / "held.log").write_text("")  # what the run writes last: it is at its held-out measure
    said = collect(name, tmp_path, WAIT="2")
    assert "waited 2 s of 2" in said and "ended" not in said
    assert "the run is still going (its newest file: held.log); poll again at once" in said
