"""engine/attention_kernel.py off CUDA: its float32 reference (the CPU's stand-in, and what the
kernel is checked against on the GPU) and which attentions the kernel takes."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import numpy as np
import pytest

from dspark_lab.engine import attention_kernel, cache_kernels


def _numpy_attention(q, k, v, offset, scale):
    heads, rows, d = q.shape[1:]
    groups = heads // k.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for h in range(heads):
        for r in range(rows):
            keys, values = k[0, h // groups, : offset + r + 1], v[0, h // groups, : offset + r + 1]
            s = keys @ q[0, h, r] * scale
            p = np.exp(s - s.max())
            out[0, h, r] = (p / p.sum()) @ values
    return out


def test_the_reference_lets_each_row_see_the_positions_up_to_its_own():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 6, 5, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, 40, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 40, 32)).astype(np.float32)
    k[:, :, 20:] = 1e3  # past the last row's position: garbage the mask must hide
    got = attention_kernel.reference_rows_attention(mx.array(q), mx.array(k), mx.array(v), mx.array(15, dtype=mx.int32), 0.3)
    np.testing.assert_allclose(np.array(got), _numpy_attention(q, k, v, 15, 0.3), rtol=1e-5, atol=1e-5)


def test_the_reference_is_the_engine_masks_attention():
    """The reference equals MLX's own attention under the compiled forward's boolean mask."""
    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((1, 4, 8, 64), (1, 2, 64, 64), (1, 2, 64, 64)))
    offset = mx.array(30, dtype=mx.int32)
    mask = mx.arange(64)[None] <= offset + mx.arange(8)[:, None]
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = attention_kernel.reference_rows_attention(q, k, v, offset, 0.125)
    assert mx.abs(got - fused).max().item() < 1e-5


@pytest.mark.parametrize("shape, why", [((1, 6, 33, 64), "33 rows"), ((1, 6, 4, 48), "head dim 48"), ((1, 5, 4, 64), "5 query heads"),
                                         ((2, 6, 4, 64), "one sequence")])
def test_the_kernel_names_what_it_does_not_take(shape, why):
    q = mx.zeros(shape, dtype=mx.bfloat16)
    k = mx.zeros((shape[0], 2, 16, 64), dtype=mx.bfloat16)
    assert why in attention_kernel.supports(q, k, k)
    assert attention_kernel.supports(mx.zeros((1, 6, 8, 64), dtype=mx.bfloat16), k[:1], k[:1]) is None
    assert "bfloat16" in attention_kernel.supports(mx.zeros((1, 6, 8, 64)), k[:1].astype(mx.float32), k[:1].astype(mx.float32))


def test_off_cuda_the_kernel_says_so():
    if attention_kernel.cuda_available():
        pytest.skip("a CUDA backend is here")
    with pytest.raises(RuntimeError, match="CUDA"):
        attention_kernel.rows_attention()


class Counting:
    """The float32 reference standing in for the kernel, recording the query shapes it took."""

    def __init__(self):
        self.shapes = []

    def __call__(self, q, *args):
        self.shapes.append(tuple(q.shape))
        return attention_kernel.reference_rows_attention(q, *args)


@pytest.fixture(scope="module")
def head_dim_32(tmp_path_factory):
    """A tiny qwen3 whose heads the kernel takes (head dim 32), loaded in bfloat16."""
    from dspark_lab.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("hd32") / "qwen3", "qwen3", seed=3, head_dim=32)


def test_a_draft_model_routed_through_the_kernel_drafts_its_one_row_steps_there_losslessly(head_dim_32):
    """draft-pipe: the draft model's one-row steps run at an array offset (Target.forward_at), the
    default route's width. With its attention routed, the output is still exactly the greedy
    tokens, the kernel took only one-row attentions, and MLX's own function is back afterwards."""
    from conftest import PROMPTS
    from dspark_lab import draft_model_generate, greedy_generate, load_target

    target, tok = load_target(head_dim_32, dtype="bfloat16")
    drafter, _ = load_target(head_dim_32, dtype="bfloat16")
    kernel = Counting()
    drafter.route_attention(kernel)
    original = mx.fast.scaled_dot_product_attention
    accepted = 0
    for prompt in PROMPTS[:4]:
        ids = tok.encode(prompt)
        want = greedy_generate(target, tok, ids, max_new_tokens=20).token_ids
        got = draft_model_generate(target, tok, drafter, ids, max_new_tokens=20, max_draft_tokens=4, pipeline=True)
        assert got.token_ids == want, prompt
        accepted += sum(got.accept_lengths) - got.num_rounds
    assert mx.fast.scaled_dot_product_attention is original
    assert kernel.shapes and all(s[2] == 1 for s in kernel.shapes)  # traced once per shape: few calls, one row each
    assert accepted > 20  # the drafter is the target's twin: its routed drafts mostly accepted
    drafter.route_attention(None)
    kernel.shapes.clear()
    draft_model_generate(target, tok, drafter, tok.encode(PROMPTS[0]), max_new_tokens=8, max_draft_tokens=4, pipeline=True)
    assert kernel.shapes == []


def test_a_routed_verify_takes_the_kernel_only_at_the_widths_asked(head_dim_32, tmp_path):
    """The pipelined chain's verify is cap + 1 rows: a policy for 5 rows routes it (and nothing
    else), and the tokens stay the greedy ones."""
    from conftest import PROMPTS
    from dspark_lab import greedy_generate, load_target, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.tiny import build_tiny_dspark

    target, tok = load_target(head_dim_32, dtype="bfloat16")
    head = load_dspark(build_tiny_dspark(tmp_path / "h", head_dim_32, markov_rank=0), target)
    kernel = Counting()
    target.route_attention(kernel, policy=lambda rows: rows == 5)
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        want = greedy_generate(target, tok, ids, max_new_tokens=16).token_ids
        got = speculative_generate(target, tok, head, ids, max_new_tokens=16, max_draft_tokens=4, pipeline=True)
        assert got.token_ids == want, prompt
    assert kernel.shapes and {s[2] for s in kernel.shapes} == {5}


def test_the_cli_routes_a_draft_models_attention_only_in_draft_pipe_and_on_cuda(tiny_dirs):
    """`generate --attention-kernel`: another mode is refused with the modes it applies to; off
    CUDA draft-pipe says the kernel needs CUDA and how to go on."""
    from typer.testing import CliRunner

    from dspark_lab.cli import app

    if attention_kernel.cuda_available():
        pytest.skip("a CUDA backend is here")
    args = ["generate", "-m", str(tiny_dirs["qwen3"]), "-p", "hi", "-n", "4", "--no-chat-template", "--attention-kernel"]
    wrong_mode = CliRunner().invoke(app, args + ["--mode", "lookup"])
    assert wrong_mode.exit_code != 0 and "applies to --mode draft-pipe" in wrong_mode.output
    assert "and --mode baseline" in wrong_mode.output
    no_cuda = CliRunner().invoke(app, args + ["--mode", "draft-pipe", "--draft-model", str(tiny_dirs["qwen3"])])
    assert no_cuda.exit_code != 0 and "CUDA" in no_cuda.output and "Leave --attention-kernel off" in no_cuda.output
    plain = CliRunner().invoke(app, args[:-1] + ["--mode", "draft-pipe", "--draft-model", str(tiny_dirs["qwen3"])])
    assert plain.exit_code == 0, plain.output


def test_the_probe_checks_the_kernel_then_lets_draft_pipes_time_decide(head_dim_32, tmp_path, monkeypatch):
    """lab/kernel_probe.py: the stand-in passes the exactness check at the draft model's head
    layout, draft-pipe is timed both ways with the same tokens, the verdict says which was faster,
    the draft model is left unrouted, and a stored verdict is reused; a candidate off by more
    than a bfloat16 step, or a machine without CUDA, is refused before anything is timed."""
    from dspark_lab import load_target
    from dspark_lab.db import open_db
    from dspark_lab.lab import kernel_probe

    target, tok = load_target(head_dim_32, dtype="bfloat16")
    drafter, _ = load_target(head_dim_32, dtype="bfloat16")
    stand_in = Counting()
    v = kernel_probe.measure_attention_kernel(drafter, stand_in, loop=(target, tok), loop_tokens=12, loop_passes=1)
    assert v.available and v.exact and v.checked == len(kernel_probe.ATTENTION_OFFSETS), v.reason
    assert v.loop_reference_ms > 0 and v.loop_kernel_ms > 0
    assert v.use == (v.loop_kernel_ms <= (1 - kernel_probe.MARGIN) * v.loop_reference_ms)
    assert "draft-pipe" in v.reason and drafter.attention_route is None
    assert any(s[2] == 1 for s in stand_in.shapes[len(kernel_probe.ATTENTION_OFFSETS):])  # it drafted through it

    def off_by_a_tenth(q, k, v, offset, scale):
        return attention_kernel.reference_rows_attention(q, k, v, offset, scale) * 1.1

    wrong = kernel_probe.measure_attention_kernel(drafter, off_by_a_tenth, loop=(target, tok))
    assert not wrong.use and not wrong.exact and "not exact" in wrong.reason and wrong.loop_reference_ms is None
    if not attention_kernel.cuda_available():
        none = kernel_probe.measure_attention_kernel(drafter)
        assert not none.available and "not available" in none.reason
    wide, _ = load_target(head_dim_32, dtype="float32")  # the kernel reads bfloat16: this one's attention it never takes
    f32 = kernel_probe.measure_attention_kernel(wide, stand_in, loop=(target, tok))
    assert not f32.use and "not one the kernel takes" in f32.reason and "float32" in f32.reason
    db = open_db(tmp_path / "probe.duckdb")
    calls = []
    monkeypatch.setattr(kernel_probe, "measure_attention_kernel", lambda *a, **k: calls.append(1) or v)
    first = kernel_probe.choose_attention_kernel(drafter, db=db, candidate=stand_in, loop=(target, tok), model_id="pair")
    again = kernel_probe.choose_attention_kernel(drafter, db=db, candidate=stand_in, loop=(target, tok), model_id="pair")
    assert calls == [1] and not first.reused and again.reused and again.use == v.use
    monkeypatch.setattr(attention_kernel, "SOURCE_DIGEST", "an-older-one")  # a verdict on other sources is measured again
    assert not kernel_probe.choose_attention_kernel(drafter, db=db, candidate=stand_in, loop=(target, tok), model_id="pair").reused
    db.dispose()


def test_the_cli_probes_the_attention_kernel_by_default_in_draft_pipe_on_cuda(tiny_dirs, head_dim_32, tmp_path, monkeypatch):
    """`generate --mode draft-pipe` without --attention-kernel: off CUDA nothing is probed or
    routed; on CUDA (the kernel stood in for) the probe runs once, says its verdict, and a second
    run reads it from --db."""
    from typer.testing import CliRunner

    from dspark_lab.cli import app

    args = ["generate", "-m", str(head_dim_32), "--draft-model", str(head_dim_32), "--mode", "draft-pipe", "-p", "hi",
            "-n", "6", "--no-chat-template", "--dtype", "bfloat16", "--db", str(tmp_path / "r.duckdb")]
    if not attention_kernel.cuda_available():
        plain = CliRunner().invoke(app, args)
        assert plain.exit_code == 0 and "--attention-kernel" not in plain.output, plain.output
    _probed_once_then_stored(args, monkeypatch)


def _probed_once_then_stored(args: list[str], monkeypatch) -> None:
    """On CUDA (the kernel stood in for by its float32 reference), `args` runs the attention probe
    once and says its verdict; run again, it reads the verdict from --db."""
    from typer.testing import CliRunner

    import dspark_lab.engine.attention_kernel as ak
    import dspark_lab.engine.kernels as kernels
    from dspark_lab.cli import app

    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    monkeypatch.setattr(ak, "rows_attention", lambda: attention_kernel.reference_rows_attention)
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "--attention-kernel: rows_attention kernel" in first.output and "measured" in first.output
    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0 and "stored" in second.output, second.output


def test_a_sweeps_draft_pipe_arms_take_the_kernel_as_the_probe_finds_it(head_dim_32, tmp_path, monkeypatch):
    """`sweep --modes draft-pipe` on CUDA (the kernel stood in for) asks the same probe as
    `generate`, routes the draft model's one-row attention when it says so, records the verdict
    in the run's config, and its trials stay lossless; the plain draft arm shares the draft model
    and its forwards are never routed."""
    import json

    import duckdb

    import dspark_lab.engine.attention_kernel as ak
    import dspark_lab.engine.kernels as kernels
    from dspark_lab.lab import kernel_probe
    from dspark_lab.lab.sweep import SweepConfig, run_sweep

    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    stand_in = Counting()
    monkeypatch.setattr(ak, "rows_attention", lambda: stand_in)
    verdict = kernel_probe.KernelVerdict("rows_attention", True, "stood in: faster", exact=True, checked=3)
    monkeypatch.setattr(kernel_probe, "measure_attention_kernel", lambda *a, **k: verdict)
    cfg = SweepConfig(models=[str(head_dim_32)], draft_models=[str(head_dim_32)], modes=["baseline", "draft", "draft-pipe"],
                      caps=["3"], prompt_sets=["code"], prompt_limit=1, trials=1, max_new_tokens=12, dtype="bfloat16")
    db = tmp_path / "s.duckdb"
    run_sweep(cfg, db, progress=False)
    con = duckdb.connect(str(db), read_only=True)
    (config,), = con.sql("select config from runs").fetchall()
    lossless = con.sql("select mode, lossless from trials where mode != 'baseline' order by mode").fetchall()
    con.close()
    chosen = json.loads(config)["attention_kernel_chosen"]
    assert list(chosen) == [f"{head_dim_32}|{head_dim_32}"] and chosen[f"{head_dim_32}|{head_dim_32}"]["use"] is True
    assert lossless == [("draft", True), ("draft-pipe", True)]
    assert stand_in.shapes and all(s[2] == 1 for s in stand_in.shapes)  # one-row steps only


def test_a_compiled_greedy_step_through_the_kernel_decodes_the_plain_steps_tokens(head_dim_32):
    """Plain decoding with compiled_step (one traced step replayed at a device-held position) and
    its one-row attention routed: the same tokens as the plain step's, the kernel taking one-row
    attentions only; compiled with MLX's attention, the same tokens too."""
    from conftest import PROMPTS
    from dspark_lab import greedy_generate, load_target

    plain, tok = load_target(head_dim_32, dtype="bfloat16")
    stepped, _ = load_target(head_dim_32, dtype="bfloat16")
    kernel = Counting()
    stepped.route_attention(kernel)
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        want = greedy_generate(plain, tok, ids, max_new_tokens=24).token_ids
        assert greedy_generate(stepped, tok, ids, max_new_tokens=24, compiled_step=True).token_ids == want, prompt
        assert greedy_generate(plain, tok, ids, max_new_tokens=24, compiled_step=True).token_ids == want, prompt
    assert kernel.shapes and all(s[2] == 1 for s in kernel.shapes)
    # Across a buffer bucket (256 positions): the step's trace and the buffers grow with the generation.
    ids = tok.encode(PROMPTS[0])
    assert greedy_generate(stepped, tok, ids, max_new_tokens=300, compiled_step=True).token_ids == \
        greedy_generate(plain, tok, ids, max_new_tokens=300).token_ids


def test_the_greedy_step_benchmark_runs_here_through_the_stand_in(head_dim_32, tmp_path):
    """benchmarks/greedy_step.py on a tiny model: every arm reports a rate, a spread and whether
    its tokens are the plain step's (the rates mean nothing on a CPU)."""
    import json

    from scripts import load_script

    out = tmp_path / "steps.json"
    load_script("greedy_step").main(["--model", str(head_dim_32), "--prompts", "1", "--max-new-tokens", "12",
                                     "--repeats", "2", "--unfused", "--json", str(out)])
    report = json.loads(out.read_text())
    assert len(report["rows"]) == 3
    assert set(report["summary"]) == {"plain", "compiled", "compiled+kernel", "unfused", "unfused compiled+kernel", "mlx_lm"}
    # the stacked projections give the plain model's logits bit for bit here (MLX's CPU kernels)
    assert set(report["fused_logits"]) == {"prefill", "one_row", "eight_rows"}
    assert all(v["bit_equal"] and v["max_abs_diff"] == 0 for v in report["fused_logits"].values())
    assert all(r["unfused"]["same_tokens_as_plain"] for r in report["rows"])
    assert all(r[a]["tok_s"] > 0 and r[a]["spread"] >= 0 for r in report["rows"] for a in report["summary"])
    assert all(r["plain"]["over_plain"] == 1.0 for r in report["rows"])


def test_the_probe_times_plain_decoding_stepped_plainly_and_compiled_through_the_kernel(head_dim_32, tmp_path, monkeypatch):
    """lab/kernel_probe.measure_greedy_step: the stand-in passes the check at the target's head
    layout, plain decoding is timed both ways, the verdict says which was faster and the target is
    left unrouted; without a tokenizer nothing is timed and the kernel stays off; a stored verdict
    is reused."""
    from dspark_lab import load_target
    from dspark_lab.db import open_db
    from dspark_lab.lab import kernel_probe

    target, tok = load_target(head_dim_32, dtype="bfloat16")
    stand_in = Counting()
    v = kernel_probe.measure_greedy_step(target, stand_in, tokenizer=tok, loop_tokens=12, loop_passes=1)
    assert v.available and v.exact and v.checked == len(kernel_probe.ATTENTION_OFFSETS), v.reason
    assert v.loop_reference_ms > 0 and v.loop_kernel_ms > 0 and "compiled plain decoding" in v.reason
    assert v.use == (v.loop_kernel_ms <= (1 - kernel_probe.MARGIN) * v.loop_reference_ms)
    assert target.attention_route is None
    assert any(s[2] == 1 for s in stand_in.shapes[len(kernel_probe.ATTENTION_OFFSETS):])  # it decoded through it
    unchecked = kernel_probe.measure_greedy_step(target, stand_in)
    assert not unchecked.use and "not timed" in unchecked.reason
    db = open_db(tmp_path / "probe.duckdb")
    calls = []
    monkeypatch.setattr(kernel_probe, "measure_greedy_step", lambda *a, **k: calls.append(1) or v)
    first = kernel_probe.choose_greedy_step(target, tokenizer=tok, db=db, candidate=stand_in, model_id="m")
    again = kernel_probe.choose_greedy_step(target, tokenizer=tok, db=db, candidate=stand_in, model_id="m")
    assert calls == [1] and not first.reused and again.reused and again.use == v.use
    monkeypatch.setattr(cache_kernels, "SOURCE_DIGEST", "an-older-one")  # the step runs the cache writer too
    assert not kernel_probe.choose_greedy_step(target, tokenizer=tok, db=db, candidate=stand_in, model_id="m").reused
    db.dispose()


def test_the_cli_steps_plain_decoding_through_the_kernel_as_asked_or_probed(head_dim_32, tmp_path, monkeypatch):
    """`generate --mode baseline`: off CUDA --attention-kernel says the kernel needs CUDA and how to
    go on, and nothing is probed without it; on CUDA (the kernel stood in for) the probe runs once,
    says its verdict, a second run reads it from --db, and --attention-kernel decodes the plain
    step's tokens through compiled steps."""
    from typer.testing import CliRunner

    from dspark_lab.cli import app

    args = ["generate", "-m", str(head_dim_32), "--mode", "baseline", "-p", "hi", "-n", "6", "--no-chat-template",
            "--dtype", "bfloat16", "--db", str(tmp_path / "r.duckdb")]
    if not attention_kernel.cuda_available():
        plain = CliRunner().invoke(app, args)
        assert plain.exit_code == 0 and "--attention-kernel" not in plain.output, plain.output
        no_cuda = CliRunner().invoke(app, args + ["--attention-kernel"])
        assert no_cuda.exit_code != 0 and "CUDA" in no_cuda.output and "Leave --attention-kernel off" in no_cuda.output
    _probed_once_then_stored(args, monkeypatch)
    forced = CliRunner().invoke(app, args + ["--attention-kernel"])
    unforced = CliRunner().invoke(app, args + ["--no-attention-kernel"])
    assert forced.exit_code == 0 and unforced.exit_code == 0
    assert forced.stdout.splitlines()[0] == unforced.stdout.splitlines()[0]  # the same text decoded


def _numpy_tree_attention(q, k, v, offset, scale, ancestors):
    heads, rows, d = q.shape[1:]
    groups = heads // k.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for h in range(heads):
        for r in range(rows):
            seen = list(range(offset)) + [offset + j for j in range(rows) if ancestors[r, j]]
            keys, values = k[0, h // groups, seen], v[0, h // groups, seen]
            s = keys @ q[0, h, r] * scale
            p = np.exp(s - s.max())
            out[0, h, r] = (p / p.sum()) @ values
    return out


def test_the_tree_reference_lets_each_row_see_the_cache_and_its_ancestors_only():
    """A tree's rows (written at the offset): row r sees the positions before the offset and the
    rows `ancestors[r]` marks, never its siblings, cousins or the stale positions past the tree."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 4, 5, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, 32, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 32, 32)).astype(np.float32)
    k[:, :, 17:] = 1e3  # past the tree's rows: garbage
    parent = [-1, 0, 0, 1, 2]  # two branches
    ancestors = np.eye(5, dtype=bool)
    for r in range(5):
        p = parent[r]
        while p >= 0:
            ancestors[r, p], p = True, parent[p]
    got = attention_kernel.reference_rows_attention(mx.array(q), mx.array(k), mx.array(v), mx.array(12, dtype=mx.int32), 0.3,
                                                    ancestors=mx.array(ancestors))
    np.testing.assert_allclose(np.array(got), _numpy_tree_attention(q, k, v, 12, 0.3, ancestors), rtol=1e-5, atol=1e-5)
    chain = attention_kernel.reference_rows_attention(mx.array(q), mx.array(k), mx.array(v), mx.array(12, dtype=mx.int32), 0.3,
                                                      ancestors=mx.array(np.tril(np.ones((5, 5), dtype=bool))))
    plain = attention_kernel.reference_rows_attention(mx.array(q), mx.array(k), mx.array(v), mx.array(12, dtype=mx.int32), 0.3)
    assert mx.array_equal(chain, plain)  # a chain is the tree whose every row descends from the one before


class CountingTrees(Counting):
    """The reference standing in for the kernel, recording which calls came with a tree's ancestors."""

    def __init__(self):
        super().__init__()
        self.trees = 0

    def __call__(self, q, k, v, offset, scale, ancestors=None):
        self.shapes.append(tuple(q.shape))
        self.trees += ancestors is not None
        return attention_kernel.reference_rows_attention(q, k, v, offset, scale, ancestors=ancestors)


def test_a_routed_pipelined_tree_takes_the_kernel_with_its_ancestors_and_stays_lossless(head_dim_32, tmp_path):
    """The pipelined tree round's verify, its attention routed at its width: the kernel gets the
    tree's ancestors (not the mask: the kernel builds no mask) and the tokens stay the greedy ones."""
    from conftest import PROMPTS
    from dspark_lab import greedy_generate, load_target, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.tiny import build_tiny_dspark

    target, tok = load_target(head_dim_32, dtype="bfloat16")
    head = load_dspark(build_tiny_dspark(tmp_path / "h", head_dim_32, markov_rank=0), target)
    # The once-a-model checks compare the offset and tree forwards with plain ones, here the float32
    # stand-in against MLX's bfloat16 attention on the CPU (its rounding): checked before routing.
    target.check_offset_forward()
    target.check_tree_forward()
    kernel = CountingTrees()
    target.route_attention(kernel, policy=lambda rows: rows > 1)
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        want = greedy_generate(target, tok, ids, max_new_tokens=16).token_ids
        got = speculative_generate(target, tok, head, ids, max_new_tokens=16, max_draft_tokens=4, tree_nodes=8, pipeline=True)
        assert got.token_ids == want, prompt
    assert kernel.trees > 0 and all(s[2] > 1 for s in kernel.shapes)


# --- the launch kernels' probe (lab/kernel_probe.py) and --launch-kernels -------------------------

def _stand_ins():
    from dspark_lab.engine import cache_kernels

    return attention_kernel.reference_rows_attention, cache_kernels.written_by_operations, cache_kernels.moved_by_operations


def test_the_launch_kernels_probe_checks_the_stand_ins_then_lets_the_loop_decide(head_dim_32, tmp_path, monkeypatch):
    """Off CUDA the kernels are unavailable; the MLX stand-ins pass the check (attention of chains and
    trees against the reference, writes and moves bit for bit), the pipelined loop is timed both
    ways, the verdict is stored and reused, and the target is left as it was."""
    from dspark_lab import load_target
    from dspark_lab.db import open_db
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.lab import kernel_probe
    from dspark_lab.tiny import build_tiny_dspark

    target, tok = load_target(head_dim_32, dtype="bfloat16")
    head = load_dspark(build_tiny_dspark(tmp_path / "h", head_dim_32, markov_rank=0), target)
    if not attention_kernel.cuda_available():
        v = kernel_probe.measure_launch_kernels(target)
        assert not v.use and not v.available and "CUDA" in v.reason
    v = kernel_probe.measure_launch_kernels(target, _stand_ins(), loop=(head, tok), loop_tokens=16, loop_passes=1)
    assert v.exact and v.checked == 7 and "bit-equal" in v.reason
    assert v.loop_reference_ms > 0 and v.loop_kernel_ms > 0
    assert v.use == (v.loop_kernel_ms <= (1 - kernel_probe.MARGIN) * v.loop_reference_ms)
    assert target.attention_route is None and target.cache_writer is None and target.tree_path_mover is None
    db = open_db(tmp_path / "k.duckdb")
    try:
        first = kernel_probe.choose_launch_kernels(target, db=db, kernels=_stand_ins(), model_id="tiny")
        assert not first.reused and kernel_probe.choose_launch_kernels(target, db=db, kernels=_stand_ins(), model_id="tiny").reused
        for module in (attention_kernel, cache_kernels):  # a verdict measured on other kernel sources is measured again
            monkeypatch.setattr(module, "SOURCE_DIGEST", "an-older-one")
            assert not kernel_probe.choose_launch_kernels(target, db=db, kernels=_stand_ins(), model_id="tiny").reused
    finally:
        db.dispose()


def test_a_launch_kernel_that_differs_is_kept_out(head_dim_32):
    from dspark_lab import load_target
    from dspark_lab.lab import kernel_probe

    target, _ = load_target(head_dim_32, dtype="bfloat16")
    attention, writer, mover = _stand_ins()

    def shifted(arrays, offset, path):
        return mover(arrays, offset + 1, path)

    v = kernel_probe.measure_launch_kernels(target, (attention, writer, shifted))
    assert not v.use and not v.exact and v.reason.startswith("not exact") and "move" in v.reason


def test_the_cli_takes_launch_kernels_in_the_pipelined_modes_only(tiny_dirs, tmp_path):
    """`generate --launch-kernels` in another mode is refused with the modes it applies to; off CUDA,
    in dspark-pipe, it says the kernels need CUDA and how to go on."""
    from typer.testing import CliRunner

    from dspark_lab.cli import app
    from dspark_lab.tiny import build_tiny_dspark

    model = str(tiny_dirs["qwen3"])
    args = ["generate", "-m", model, "-p", "hi", "-n", "4", "--no-chat-template", "--launch-kernels"]
    r = CliRunner().invoke(app, args + ["--mode", "lookup"])
    assert r.exit_code != 0 and "dspark-pipe and dspark-tree-pipe" in r.output and "Leave it off" in r.output
    if attention_kernel.cuda_available():
        return
    head = str(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0))
    r = CliRunner().invoke(app, args + ["--mode", "dspark-pipe", "-d", head, "--drafter-bits", "16"])
    assert r.exit_code != 0 and "CUDA" in r.output and "Leave --launch-kernels off" in r.output


def test_the_heads_block_takes_the_targets_attention_route_as_rows_that_all_see_one_another(tmp_path, monkeypatch):
    """In the pipelined loops the head's block, drafted at an array position, attends through the
    target's route (the tree kernel with every ancestor set: every block row sees the context and
    the whole block) where the route takes its width, and the tokens stay the greedy ones; a head
    whose window could bind, or no route, keeps MLX's attention. The head's head dim (16) is not
    the kernel's, so the stand-in is let take it here."""
    from conftest import PROMPTS
    from dspark_lab import greedy_generate, load_target, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "qwen3", "qwen3", seed=5)
    target, tok = load_target(model)
    head = load_dspark(build_tiny_dspark(tmp_path / "h", model, markov_rank=0), target)
    target.check_offset_forward()
    target.check_tree_forward()
    monkeypatch.setattr(attention_kernel, "supports", lambda q, k, v: None)
    seen, ancestors_given = [], []

    def kernel(q, k, v, offset, scale, ancestors=None):
        seen.append((q.shape[1], q.shape[2], None if ancestors is None else ancestors.shape))
        ancestors_given.append(ancestors)
        return attention_kernel.reference_rows_attention(q, k, v, offset, scale, ancestors=ancestors)

    target.route_attention(kernel, policy=lambda rows: True)
    rows = head.config.block_size
    block = (head.config.num_attention_heads, rows, (rows, rows))
    for tree_nodes, compiled in ((0, False), (0, True), (6, True)):
        for prompt in PROMPTS[:2]:
            ids = tok.encode(prompt)
            want = greedy_generate(target, tok, ids, max_new_tokens=12).token_ids
            got = speculative_generate(target, tok, head, ids, max_new_tokens=12, max_draft_tokens=3, pipeline=True,
                                       tree_nodes=tree_nodes, compile_draft=compiled)
            assert got.token_ids == want, (tree_nodes, compiled, prompt)
        if not compiled:  # the uncompiled draft's block: real arrays, every ancestor set
            given = [a for s, a in zip(seen, ancestors_given) if s == block]
            assert given and all(mx.all(a).item() for a in given)
    assert block in seen and head.attention_route is target.attention_route
    seen.clear()
    head.window = 4  # shorter than the buffers: the window could hide early context, which the kernel would not
    speculative_generate(target, tok, head, tok.encode(PROMPTS[0]), max_new_tokens=8, max_draft_tokens=3, pipeline=True)
    assert block not in seen  # the uncompiled draft calls the route each round where it takes the block
    target.route_attention(None)
    seen.clear()
    head.window = 4096
    speculative_generate(target, tok, head, tok.encode(PROMPTS[0]), max_new_tokens=8, max_draft_tokens=3, pipeline=True)
    assert seen == [] and head.attention_route is None
