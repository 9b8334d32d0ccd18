"""benchmarks/h200_corpus_heads.sh, the device run of a reference head, with python3 replaced by a
stub that records each call: the steps run in order and hand each other the right files (a
mistake here costs a whole device session to find)."""

import gzip
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts import BENCHMARKS

SCRIPT = BENCHMARKS / "h200_corpus_heads.sh"

STUB = """#!/usr/bin/env bash
echo "$* [distill_done=$([ -f "$RUN_DIR/.distill_done" ] && echo 1 || echo 0)]" >> "$CALLS"
[ -f "$RUN_DIR/.run_done" ] && echo "$*" >> "$CALLS.run_done"  # must never happen: the run is not over
[[ "$*" == *--mix* ]] && for a in "$@"; do echo "<$a>"; done >> "$CALLS.args"  # one line per argument
prev=""
for a in "$@"; do  # self_instruct.py writes its --out file
  if [ "$prev" = "--out" ] && [[ "$*" == *self_instruct.py* ]]; then echo '{"id": "selfcode-00001"}' | gzip > "$a"; fi
  if [ "$prev" = "--out" ] && [[ "$*" == *quantize-head* ]]; then mkdir -p "$a" && echo 4bit > "$a/model.safetensors"; fi
  prev=$a
done
"""


def run_script(tmp_path, name="qwen05", **env):
    bin_dir, run = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STUB)
    (bin_dir / "python3").chmod(0o755)
    data = tmp_path / "data.jsonl.gz"
    data.write_bytes(gzip.compress(b'{"ids": [1, 2]}\n'))
    calls = tmp_path / "calls.txt"
    run.mkdir()
    (run / ".distill_done").touch()  # a previous run's marks: removed before this one starts
    (run / ".run_done").touch()
    (run / ".collect").mkdir()  # (and its half-returned snapshot)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "RUN_DIR": str(run),
            "DATA": str(data), "TIMING": "none", "RUNS_ROOT": str(tmp_path / "runs"), **env}
    out = subprocess.run(["bash", str(SCRIPT), name], env=full, capture_output=True, text=True, check=True,
                         cwd=SCRIPT.parents[1]).stdout
    return out, calls.read_text().splitlines(), run


def test_self_instruct_requests_go_first_into_the_generation(tmp_path):
    out, calls, run = run_script(tmp_path, SELF_INSTRUCT="4000", SELF_SEED="1", GEN_PROMPTS="/x/code_synth3.jsonl.gz")
    assert "self_instruct.py" in calls[0] and "--n 4000 --seed 1" in calls[0]
    self_file = run / "self_code_s1.jsonl.gz"
    assert self_file.exists() and f"--out {self_file}" in calls[0]
    generation = calls[1]
    assert "--data-only" in generation and f"--prompts {self_file},/x/code_synth3.jsonl.gz " in generation
    assert "--tokens 0" in calls[2] and "lossless_check.py" in calls[3] and len(calls) == 4  # train, evaluate; TIMING=none
    assert "self-instruct code rc=0" in out and (run / "data.jsonl").read_text() == '{"ids": [1, 2]}\n'
    assert (run / ".shipped_rows").read_text().strip() == "1"  # h200_collect.sh brings back only the rows after it
    # h200_collect.sh returns the final head first once distill has ended, and only then
    assert [c.endswith("[distill_done=1]") for c in calls] == [False, False, False, True]
    assert not (run / ".collect").exists()
    # .run_done (a waiting poll's signal) only once every step is over, not a previous run's
    assert not Path(f"{tmp_path / 'calls.txt'}.run_done").exists() and (run / ".run_done").exists()
    # its pid, so a waiting poll (h200_collect.sh) stops once the run's process is gone
    assert (run / ".pid").read_text().strip().isdigit()


def test_self_instruct_of_two_kinds_writes_n_of_each_and_both_go_first(tmp_path):
    out, calls, run = run_script(tmp_path, SELF_INSTRUCT="3000", SELF_KIND="code,math", SELF_SEED="3",
                                 GEN_PROMPTS="/x/math_synth4.jsonl.gz")
    code, math = run / "self_code_s3.jsonl.gz", run / "self_math_s3.jsonl.gz"
    assert "--kind code --n 3000 --seed 3" in calls[0] and f"--out {code}" in calls[0]
    assert "--kind math --n 3000 --seed 3" in calls[1] and f"--out {math}" in calls[1]
    assert f"--prompts {code},{math},/x/math_synth4.jsonl.gz " in calls[2] and "--data-only" in calls[2]
    assert "self-instruct code rc=0" in out and "self-instruct math rc=0" in out and len(calls) == 5


def test_a_suffixed_name_is_another_run_of_the_same_model(tmp_path):
    """qwen15-wide: the 1.5B's model and defaults, its own run (two can share a GPU side by side);
    a name of no known model is refused before anything runs."""
    _, calls, _ = run_script(tmp_path, name="qwen15-wide", ARCH="--block 8 --intermediate-size 3072")
    assert "-m /root/ship/qwen15/qwen2.5-coder-1.5b-q4-bfloat16 " in calls[0] and "--intermediate-size 3072" in calls[0]
    assert "--cap 7" in calls[1]  # the held-out evaluation at the 1.5B's cap
    r = subprocess.run(["bash", str(SCRIPT), "qwen3-wide"], capture_output=True, text=True, cwd=SCRIPT.parents[1])
    assert r.returncode == 2 and "unknown head qwen3-wide" in r.stdout


def test_without_self_instruct_the_generation_takes_gen_prompts_alone(tmp_path):
    _, calls, _ = run_script(tmp_path, GEN_PROMPTS="/x/a.jsonl.gz,/x/b.jsonl.gz")
    assert not any("self_instruct.py" in c for c in calls)
    assert "--prompts /x/a.jsonl.gz,/x/b.jsonl.gz " in calls[0] and "--data-only" in calls[0]


def test_pipeline_timing_passes_the_arms_and_both_caps(tmp_path):
    _, calls, _ = run_script(tmp_path, TIMING="pipeline", CAPS="4,7", DQ="0", ARMS="dspark,pipe+cd")
    timing = calls[-1]
    assert "pipeline_speed.py" in timing and "--caps 4,7" in timing and "--arms dspark,pipe+cd" in timing
    assert "--dequantized" not in timing
    (tmp_path / "all").mkdir()
    _, calls, _ = run_script(tmp_path / "all", TIMING="pipeline")  # no ARMS: every arm
    assert "--arms" not in calls[-1] and "--dequantized" in calls[-1]


def test_train_0_stops_after_the_generation(tmp_path):
    out, calls, _ = run_script(tmp_path, GEN_PROMPTS="/x/a.jsonl.gz", GEN_MINUTES="20", TRAIN="0")
    assert len(calls) == 1 and "--data-only" in calls[0] and "--data-minutes 20" in calls[0]
    assert "generation only" in out


def test_a_fraction_of_a_minute_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as e:
        run_script(tmp_path, GEN_PROMPTS="/x/a.jsonl.gz", MINUTES="10.5")
    assert "MINUTES must be a whole number of minutes, got '10.5'" in e.value.stdout
    assert not (tmp_path / "calls.txt").exists()


def test_quant_stores_the_head_quantized_and_evaluates_and_times_that_one_then_the_float(tmp_path):
    out, calls, run = run_script(tmp_path, QUANT="4", TIMING="pipeline", CAPS="4", DQ="0", ARMS="pipe+lk")
    train, quantize, evaluate, timing, float_eval = calls
    assert "--tokens 0" in train
    assert f"quantize-head {run} --out {run}/q4.new --bits 4" in quantize  # moved into place once whole
    assert (run / "q4" / "model.safetensors").read_text() == "4bit\n" and not (run / "q4.new").exists()
    assert f"--head {run}/q4 --drafter-bits 4 " in evaluate and f"--out {run}/eval.json" in evaluate
    assert "pipeline_speed.py" in timing and f"--head {run}/q4 --drafter-bits 4 " in timing
    assert "lossless_check.py" in float_eval and f"--head {run} --drafter-bits 16 " in float_eval
    assert f"--out {run}/eval_float.json" in float_eval
    assert "quantize rc=0" in out and "eval (4 bits) rc=0" in out and "eval (16 bits) rc=0" in out and "timing rc=0" in out


def test_quant_3_stores_3_bits_in_qgroup_groups_and_loads_them_as_stored(tmp_path):
    """QUANT=3 QGROUP=128 (a head 4 bits leave over 20 MB): quantize-head gets both, and every
    later step loads the 3-bit head at --drafter-bits 4, which keeps it as stored."""
    out, calls, run = run_script(tmp_path, QUANT="3", QGROUP="128", SWEEP="1", CAPS="7")
    train, quantize, evaluate, sweep, float_eval = calls
    assert f"quantize-head {run} --out {run}/q3.new --bits 3 --group-size 128" in quantize
    assert f"--head {run}/q3 --drafter-bits 4 " in evaluate and f"-d {run}/q3 --drafter-bits 4 " in sweep
    assert "eval (4 bits) rc=0" in out


def test_without_quant_the_float_head_is_evaluated_once_and_timed(tmp_path):
    out, calls, run = run_script(tmp_path, TIMING="overlap")
    assert len(calls) == 3 and not any("quantize-head" in c for c in calls)
    assert f"--head {run} --drafter-bits 16 " in calls[1] and f"--head {run} --drafter-bits 16 " in calls[2]
    assert "launch_overlap.py" in calls[2] and "timing rc=0" in out


def test_mix_reaches_the_training_run_as_one_argument(tmp_path):
    _, calls, _ = run_script(tmp_path, MIX="self_code*=2, corpus:*=0.5")  # a space and globs: still one argument
    assert any("--tokens 0" in c and "--mix" in c for c in calls)
    assert "<--mix>\n<self_code*=2, corpus:*=0.5>\n" in (tmp_path / "calls.txt.args").read_text()
    (tmp_path / "plain").mkdir()
    _, calls, _ = run_script(tmp_path / "plain")
    assert not any("--mix" in c for c in calls)


def test_grid_times_the_init_head_at_each_precision_before_training(tmp_path):
    out, calls, run = run_script(tmp_path, GRID="8,16", INIT="/root/ship/data/head", CAPS="4,7", ARMS="pipe+lk+cd")
    grid, train = calls[0], calls[1]
    assert "pipeline_speed.py" in grid and "--head /root/ship/data/head --drafter-bits 4 " in grid
    assert "--precisions 8,16" in grid and "--caps 4,7" in grid and "--arms pipe+lk+cd" in grid
    assert f"--json {run}/precision.json" in grid and "--tokens 0" in train and "--init /root/ship/data/head" in train
    assert "precision grid rc=0" in out
    (tmp_path / "no_init").mkdir()
    with pytest.raises(subprocess.CalledProcessError) as e:  # nothing to time without a head
        run_script(tmp_path / "no_init", GRID="8,16")
    assert "GRID times INIT's head: set INIT=DIR" in e.value.stdout


def test_sweep_runs_the_labs_sweep_on_the_kept_head_before_the_float_evaluation(tmp_path):
    out, calls, run = run_script(tmp_path, QUANT="4", SWEEP="1", CAPS="4,7")
    sweep = next(c for c in calls if "dspark_lab sweep" in c)
    assert f"-d {run}/q4 --drafter-bits 4 " in sweep and "--modes lookup,dspark-pipe,mlx-lm --pipe-lookup --compile-draft" in sweep
    assert "--caps 4,7 --prompt-limit 2 " in sweep and f"--json {run}/sweep.json" in sweep
    assert calls.index(sweep) == len(calls) - 2 and "eval_float.json" in calls[-1]  # the float head's evaluation goes last
    assert "sweep rc=0" in out
    (tmp_path / "plain").mkdir()
    _, calls, _ = run_script(tmp_path / "plain", QUANT="4")
    assert not any("dspark_lab sweep" in c for c in calls)
    assert "--precisions" not in sweep
    (tmp_path / "grid").mkdir()
    _, calls, _ = run_script(tmp_path / "grid", QUANT="4", SWEEP="1", SWEEP_PRECISIONS="as-loaded,8,dequantized")
    assert "--precisions as-loaded,8,dequantized " in next(c for c in calls if "dspark_lab sweep" in c)


def test_detach_starts_the_run_in_the_background_and_returns(tmp_path):
    # DETACH=1 is the whole start command: the run goes on after the calling shell (the device
    # call) has ended, with nothing sent to the background by hand.
    import time

    log = tmp_path / "run.out"
    out, _, run = run_script(tmp_path, DETACH="1", SETTLE="0", LOG=str(log))
    assert "qwen05 started detached" in out and str(log) in out
    for _ in range(200):  # the detached run finishes on its own (python3 is the stub)
        if (run / ".run_done").exists() and "qwen05 done" in log.read_text():
            break
        time.sleep(0.05)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert "qwen05 done" in log.read_text() and any("lossless_check.py" in c for c in calls)


def test_detach_refuses_a_shell_without_mlx(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/usr/bin/env bash\nexit 1\n")  # `import mlx.core` fails
    (bin_dir / "python3").chmod(0o755)
    r = subprocess.run(["bash", str(SCRIPT), "qwen05"], env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                       "DETACH": "1", "RUN_DIR": str(tmp_path / "run")}, capture_output=True, text=True)
    assert r.returncode == 2 and "source /root/ship/mlx/activate first" in r.stdout
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_second_uncapped_run_beside_a_live_one_is_refused_before_anything_runs(tmp_path):
    runs = tmp_path / "runs"
    other = runs / "qwen15"
    other.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])  # the other run, still going
    try:
        (other / ".pid").write_text(f"{sleeper.pid}\n")
        with pytest.raises(subprocess.CalledProcessError) as e:
            run_script(tmp_path, name="qwen15-wide", GEN_PROMPTS="/x/a.jsonl.gz")
        assert e.value.returncode == 2 and "two runs need CACHE_GB=4 MEM_GB=60 each" in e.value.stdout and str(other) in e.value.stdout
        assert not (tmp_path / "calls.txt").exists()
        # Capped, it starts (the other run must have been started capped too: the message says so).
        for d in ("bin", "run"):
            shutil.rmtree(tmp_path / d)
        out, calls, _ = run_script(tmp_path, name="qwen15-wide", GEN_PROMPTS="/x/a.jsonl.gz", CACHE_GB="4", MEM_GB="60")
        assert calls and any("--cache-gb 4 --memory-gb 60" in c for c in calls)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_finished_or_dead_run_does_not_block_the_next(tmp_path):
    runs = tmp_path / "runs"
    done, dead = runs / "qwen05", runs / "smol"
    done.mkdir(parents=True)
    dead.mkdir()
    (done / ".pid").write_text(f"{os.getpid()}\n")  # alive, but its run is over
    (done / ".run_done").touch()
    (dead / ".pid").write_text("999999999\n")  # no such process: a run that crashed
    out, calls, _ = run_script(tmp_path, GEN_PROMPTS="/x/a.jsonl.gz")
    assert calls


def test_held_rows_measure_the_kept_head_beside_init_on_the_same_anchors(tmp_path):
    out, calls, run = run_script(tmp_path, name="qwen15-soft", HELD="/root/ship/data/held30_qwen15.jsonl.gz",
                                 INIT="/root/ship/data/head", QUANT="4")
    held = [c for c in calls if "block_accept.py" in c]
    assert len(held) == 1 and "held-out rows rc=0" in out
    assert (f"--head /root/ship/data/head --head {run}/q4 --drafter-bits 4 --data /root/ship/data/held30_qwen15.jsonl.gz "
            f"--rows 0 --cap 7 --cache-gb 4 --first 128 --json {run}/held.json --anchors-out {run}/held_anchors.jsonl.gz") in held[0]  # the cache capped: two runs share a GPU
    assert calls.index(held[0]) == next(i for i, c in enumerate(calls) if "lossless_check.py" in c) + 1  # right after the evaluation
    (tmp_path / "none").mkdir()
    out, calls, _ = run_script(tmp_path / "none", name="qwen15")
    assert not any("block_accept.py" in c for c in calls)
