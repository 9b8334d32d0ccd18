"""benchmarks/round_host_time.py, benchmarks/primitive_cost.py and benchmarks/ptx_cache.sh, the
fifty-second round's tools for where a pipelined round's host time goes, on this machine's CPU:
each round's timing comes with a census of the primitives it hands over (a round hands over more
than a step, and the tree's more than the chain's); one primitive's cost is priced by kind; MLX's
kernel cache goes from one device session to the next."""

import subprocess
import tarfile
from pathlib import Path

from dspark_lab.tiny import build_tiny_dspark

from scripts import ROOT, load_script


def test_round_host_time_counts_each_arms_primitives(tiny_dirs, tmp_path):
    mod = load_script("round_host_time")
    head = build_tiny_dspark(tmp_path / "head", tiny_dirs["qwen3"], block_size=4, markov_rank=0, confidence=False)
    r = mod.main(["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--caps", "3", "--tree-nodes", "0,4",
                  "--prompts", "1", "--max-new-tokens", "12", "--head-bits", "16", "--primitives", "--json", str(tmp_path / "r.json")])
    assert {(row["cap"], row["nodes"]) for row in r["rows"]} == {(3, 0), (3, 4)} and len(r["rows"]) == 6  # 3 sets, 1 prompt each
    assert all(row["build_ms"] > 0 and row["accept"] >= 1 for row in r["rows"])
    counts = {k: sum(c.values()) for k, c in r["primitives"].items()}
    assert set(counts) == {"greedy", "cap 3 chain", "cap 3 tree 4"}
    # A round verifies the step's forward, wider, and adds the head's draft and the verdict; the
    # tree adds its choice and the walk of its path.
    assert counts["greedy"] < counts["cap 3 chain"] < counts["cap 3 tree 4"]
    assert r["primitives"]["cap 3 chain"]["ArgReduce"] >= r["primitives"]["greedy"]["ArgReduce"] + 1  # the draft's, the verdict's
    assert (tmp_path / "r.json").exists()


def test_primitive_cost_prices_each_kind():
    r = load_script("primitive_cost").main(["--count", "8", "--repeats", "2"])
    assert set(r) == {"add", "astype (a copy)", "reshape", "transpose", "compiled, 4 ops fused", "rms_norm (fast)", "qmv (1 row, 4-bit)",
                      "qmm (8 rows, 4-bit)"}  # (custom kernels only on CUDA)
    assert all(v["async_eval_us"] > 0 and v["build_us"] > 0 for v in r.values())


def _sh(*args, env):
    return subprocess.run(["bash", "-c", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def test_the_kernel_cache_goes_from_one_session_to_the_next(tmp_path):
    """`use` seeds MLX_PTX_CACHE_DIR from a shipped cache of the shipped MLX's version, once;
    `save` packs it into $OUT; `keep` stores it where prepare_device_session.sh ships it from."""
    ship, out = tmp_path / "ship", tmp_path / "out"
    (ship / "mlx").mkdir(parents=True)
    (ship / "mlx" / "mlx-0.32.4-cp312-cp312-manylinux_2_35_x86_64.whl").write_text("")
    (ship / "data" / "ptx").mkdir(parents=True)
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "binary_add.ptx").write_text("ptx")
    with tarfile.open(ship / "data" / "ptx" / "ptx_cache-0.32.4.tgz", "w:gz") as t:
        t.add(seed / "binary_add.ptx", arcname="./binary_add.ptx")
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SHIP_ROOT": str(ship), "PTX_ROOT": str(tmp_path / "ptx"), "OUT": str(out)}
    r = _sh('source benchmarks/ptx_cache.sh use && echo "dir=$MLX_PTX_CACHE_DIR" && echo new > "$MLX_PTX_CACHE_DIR/rope.ptx" '
            '&& bash benchmarks/ptx_cache.sh save', env=env)
    assert r.returncode == 0, r.stderr
    assert f"dir={tmp_path / 'ptx' / '0.32.4'}" in r.stdout and "1 kernels seeded" in r.stdout and "2 kernels" in r.stdout
    with tarfile.open(out / "ptx_cache-0.32.4.tgz") as t:
        assert sorted(Path(n).name for n in t.getnames() if n.endswith(".ptx")) == ["binary_add.ptx", "rope.ptx"]
    again = _sh("source benchmarks/ptx_cache.sh use", env=env)  # seeded already: the kernels compiled since stay
    assert again.returncode == 0 and "seeded" not in again.stdout
    assert (tmp_path / "ptx" / "0.32.4" / "rope.ptx").exists()
    kept = _sh(f"bash benchmarks/ptx_cache.sh keep {out / 'ptx_cache-0.32.4.tgz'}", env=env)
    assert kept.returncode == 0 and (tmp_path / ".cache" / "dspark-lab" / "ptx" / "ptx_cache-0.32.4.tgz").exists()
    missing = _sh("bash benchmarks/ptx_cache.sh save", env={**env, "PTX_ROOT": str(tmp_path / "none")})
    assert missing.returncode == 1 and "no ptx cache" in missing.stderr
