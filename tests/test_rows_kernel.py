"""The rows kernel's routing (engine/rows_kernel.py): which products it takes, the model's layers
sent through it and back, and decoding through a routed target still lossless. The CUDA kernel
itself cannot run here; its float32 stand-in (reference_rows_matmul, the product the kernel
computes up to its summation order) takes its place, and benchmarks/rows_kernel.py checks the
kernel against it on the GPU."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import PROMPTS
from dspark_lab import greedy_generate, load_target, speculative_generate
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.kernels import cuda_available
from dspark_lab.engine.rows_kernel import (LAYOUT_VARIABLE, LAYOUTS, MAX_ROWS, columns_per_block, default_layout,
                                           dequantize_float32, every_width, k_split, quantized_rows_matmul,
                                           reference_rows_matmul, route_quantized_rows, supports, unroute_quantized_rows,
                                           wide_k_split, worth_routing)
from dspark_lab.db import open_db
from dspark_lab.lab import kernel_probe
from dspark_lab.lab.kernel_probe import choose_rows_kernel, measure_rows_kernel
from dspark_lab.tiny import build_tiny_dspark


def _quantized_linear(k=128, n=64, bits=4, bias=True, seed=0):
    mx.random.seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    lin.set_dtype(mx.bfloat16)
    return nn.QuantizedLinear.from_linear(lin, group_size=64, bits=bits)


class Counting:
    """The stand-in product, recording the row shapes it was handed."""

    def __init__(self):
        self.shapes = []

    def __call__(self, x, *args, **kwargs):
        self.shapes.append(tuple(x.shape))
        return reference_rows_matmul(x, *args, **kwargs)


def test_it_takes_decode_and_verify_widths_of_affine_bfloat16_layers_only():
    q = _quantized_linear()
    ok = dict(group_size=64, bits=4)
    x = mx.zeros((1, 8, 128), dtype=mx.bfloat16)
    assert supports(x, q.weight, q.scales, q.biases, **ok) is None
    assert supports(mx.zeros((MAX_ROWS, 128), dtype=mx.bfloat16), q.weight, q.scales, q.biases, **ok) is None
    assert "33 rows" in supports(mx.zeros((33, 128), dtype=mx.bfloat16), q.weight, q.scales, q.biases, **ok)
    assert "float32" in supports(x.astype(mx.float32), q.weight, q.scales, q.biases, **ok)
    assert "mode 'mxfp4'" in supports(x, q.weight, q.scales, q.biases, group_size=32, bits=4, mode="mxfp4")
    assert "3-bit" in supports(x, q.weight, q.scales, q.biases, group_size=64, bits=3)
    assert "not the layout" in supports(mx.zeros((1, 64), dtype=mx.bfloat16), q.weight, q.scales, q.biases, **ok)


def test_launch_shape_depends_on_k_alone_where_it_changes_the_sums():
    """The warps splitting K set the summation order: they follow K, never the row count (so a row
    sums alike at every width); columns a block only share loads."""
    assert [k_split(896, 4), k_split(1536, 4), k_split(4864, 4), k_split(64, 4)] == [1, 3, 8, 1]
    assert [columns_per_block(r) for r in (1, 8, 9, 16, 17, 32)] == [4, 4, 4, 4, 2, 2]
    assert all(columns_per_block(r) * r <= 64 for r in range(1, MAX_ROWS + 1))
    # The wide layout: a lane loads 16 bytes (4 packed words), so the warps follow K's chunks, still K alone.
    assert [wide_k_split(896, 4), wide_k_split(1536, 4), wide_k_split(4864, 4), wide_k_split(8960, 4),
            wide_k_split(896, 8)] == [1, 2, 5, 8, 2]
    # The mma layout: 16 columns a block at every width, warps over K's 64-weight slices (K alone);
    # it takes 4-bit weights in groups of a multiple of 64, and leaves the rest to the words layout.
    mma = LAYOUTS["mma"]
    assert [mma.k_split(k, 4) for k in (64, 896, 1536, 4864, 8960)] == [1, 7, 8, 8, 8]
    assert {mma.columns(r) for r in range(1, MAX_ROWS + 1)} == {16}
    assert [mma.takes(1536, 4, 64), mma.takes(1536, 4, 128), mma.takes(1536, 4, 32), mma.takes(1536, 8, 64)] == [
        True, True, False, False]


def test_the_layout_can_be_named_in_the_environment_and_a_wrong_name_is_refused(monkeypatch):
    """DSPARK_LAB_ROWS_LAYOUT picks the layout the engine builds (a sweep measuring another layout); a
    name that is none says which there are, before anything needs CUDA."""
    monkeypatch.delenv(LAYOUT_VARIABLE, raising=False)
    assert default_layout() == "mma"  # the default since the forty-seventh round
    monkeypatch.setenv(LAYOUT_VARIABLE, "words")
    assert default_layout() == "words"
    monkeypatch.setenv(LAYOUT_VARIABLE, "tiles")
    with pytest.raises(ValueError, match=r"'tiles' \(from the environment variable DSPARK_LAB_ROWS_LAYOUT\): choose one of words, wide, mma"):
        quantized_rows_matmul()
    with pytest.raises(ValueError, match=r"layout 'tiles': choose one of"):
        quantized_rows_matmul("tiles")


def test_before_ampere_the_mma_layout_gives_way_to_the_words_layout(monkeypatch):
    """The mma layout's bfloat16 m16n8k16 step needs compute capability 8.0: on an older device the
    engine builds the words layout (and so routes no tree verify), on a newer one the mma layout; a
    device that reports no capability is taken as able."""
    import dspark_lab.engine.rows_kernel as rk

    monkeypatch.delenv(LAYOUT_VARIABLE, raising=False)
    monkeypatch.setattr(rk, "cuda_available", lambda: True)
    monkeypatch.setattr(rk, "_kernel", lambda layout: None)  # nothing compiled here
    for reported, layout in (({"compute_capability_major": 7}, "words"), ({"compute_capability_major": 9}, "mma"),
                             ({"architecture": "cpu"}, "mma")):
        monkeypatch.setattr(mx, "device_info", lambda reported=reported: reported, raising=False)
        assert rk.tensor_cores_available() == (layout == "mma")
        assert quantized_rows_matmul().layout == layout
    assert quantized_rows_matmul("wide").layout == "wide"  # only a tensor-core layout gives way


def test_the_stand_in_is_the_float32_product_rounded_once():
    """Nibble k of a word is element k (lowest bits first), each weight scale * q + bias in float32."""
    q = _quantized_linear(bias=False)
    x = mx.random.normal((5, 128)).astype(mx.bfloat16)
    got = reference_rows_matmul(x, q.weight, q.scales, q.biases, group_size=64, bits=4)
    w = np.array(q.weight)
    nibbles = np.stack([(w >> (4 * j)) & 15 for j in range(8)], axis=-1).reshape(64, 128).astype(np.float32)
    scales, biases = (np.repeat(np.array(a.astype(mx.float32)), 64, axis=1) for a in (q.scales, q.biases))
    weights = nibbles * scales + biases
    assert np.abs(np.array(dequantize_float32(q.weight, q.scales, q.biases, group_size=64, bits=4)) - weights).max() < 1e-6
    want = np.array(x.astype(mx.float32)) @ weights.T
    assert got.dtype == mx.bfloat16
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= np.abs(want).max() * 2 ** -8  # one bfloat16 rounding
    # the same layer at 8 bits: four weights a word
    q8 = _quantized_linear(bits=8, bias=False)
    w8 = mx.dequantize(q8.weight, q8.scales, q8.biases, group_size=64, bits=8).astype(mx.float32)
    assert mx.allclose(dequantize_float32(q8.weight, q8.scales, q8.biases, group_size=64, bits=8), w8, atol=1e-2).item()


def test_routed_layers_use_it_where_the_policy_says_and_go_back():
    q = _quantized_linear()
    model = nn.Sequential(q, nn.ReLU(), _quantized_linear(64, 64, seed=1))
    product = Counting()
    assert route_quantized_rows(model, product, policy=every_width) == 2
    assert route_quantized_rows(model, product, policy=every_width) == 2  # again: no class of a class
    assert type(q).__mro__[1] is nn.QuantizedLinear
    x = mx.random.normal((2, 3, 128)).astype(mx.bfloat16)
    y = q(x)
    assert product.shapes == [(2, 3, 128)]
    assert mx.array_equal(y, reference_rows_matmul(x, q.weight, q.scales, q.biases, group_size=64, bits=4) + q.bias).item()
    q(x[:1, :1])  # one row: every width is routed under this policy
    q(mx.zeros((MAX_ROWS + 1, 128), dtype=mx.bfloat16))  # a prefill: never
    q(x.astype(mx.float32))  # not bfloat16: never
    assert product.shapes == [(2, 3, 128), (1, 1, 128)]
    # The engine's policy takes a layer this small at a chain verify's widths only (8-16 rows).
    assert route_quantized_rows(model, product) == 2 and q._dspark_widths == frozenset(range(8, 17))
    q(x)  # 6 rows: MLX's product
    assert len(product.shapes) == 2
    # A policy that takes a layer at no width gives it its own class back (an uncompiled step then
    # pays no detour through the routed class's Python).
    never = lambda rows, weights, tensor_cores: False  # noqa: E731
    assert route_quantized_rows(model, product, policy=never) == 0 and type(q) is nn.QuantizedLinear and not hasattr(q, "_dspark_rows")
    asked = []

    def at_three_rows(rows, weights, tensor_cores):
        asked.append(rows)
        return rows == 3

    assert route_quantized_rows(model, product, policy=at_three_rows) == 2
    assert "_dspark_decisions" not in q and "_dspark_decisions" not in q.parameters()  # state, not a child module
    assert sorted(set(asked)) == list(range(1, MAX_ROWS + 1))  # asked at routing, for every width, once per layer
    asked.clear()
    for _ in range(3):
        q(x[:1, :1]), q(x[:1])
    assert asked == []  # ...never while decoding: its answers are kept with the layer
    assert product.shapes[2:] == [(1, 3, 128)] * 3  # 3 rows routed every time, 1 row never
    assert unroute_quantized_rows(model) == 2 and type(q) is nn.QuantizedLinear and not hasattr(q, "_dspark_rows")


def test_the_engine_routes_where_mlx_reads_the_weights_again_for_every_row_and_a_chains_verify():
    """Measured on the H100 (thirty-eighth round): below 8 rows the vocabulary projection from 2
    rows, an MLP matrix from 4, a small attention matrix never. Measured on the H200 (forty-fifth
    round): a compiled forward of 8-16 rows, a chain's verify, faster with every product routed. A
    one-row step and a tree's verify of 17 rows and more keep MLX's kernels."""
    vocab, mlp, attention = 151936 * 896, 4864 * 896, 896 * 896
    assert [worth_routing(r, vocab) for r in (1, 2, 7, 8, 16, 17)] == [False, True, True, True, True, False]
    assert [worth_routing(r, mlp) for r in (2, 3, 4, 7, 8)] == [False, True, True, True, True]
    assert [r for r in range(1, MAX_ROWS + 1) if worth_routing(r, attention)] == list(range(8, 17))


@pytest.fixture(scope="module")
def routed(tiny_dirs):
    """The tiny qwen3 (tied embeddings) at 4 bits with bfloat16 scales, routed through the stand-in."""
    target, tok = load_target(tiny_dirs["qwen3"], dtype="bfloat16", quantize=4)
    product = Counting()
    changed = target.route_quantized_rows(product, policy=every_width)  # one-row steps too: greedy computes what the verify does
    return target, tok, product, changed


def test_a_target_routes_every_quantized_layer_and_its_tied_projection(routed, tiny_dirs):
    target, tok, product, changed = routed
    quantized = [m for _, m in target.model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert changed == len(quantized) and target.rows_routed
    product.shapes.clear()
    cache = target.make_cache()
    target.forward(mx.array(list(range(40)), dtype=mx.uint32), cache)  # a prefill: not routed
    assert product.shapes == []
    target.forward(mx.array([3, 4], dtype=mx.uint32), cache)
    assert len(product.shapes) == len(quantized)  # every layer, the vocabulary projection included
    assert (1, 2, target.vocab_size) not in product.shapes and (1, 2, 64) in product.shapes


def test_decoding_through_a_routed_target_is_lossless(routed, tiny_dirs, tmp_path):
    """Greedy and speculative decoding both go through the routed product: the chain, the pipelined
    chain and the pipelined trees give exactly the greedy tokens."""
    target, tok, _, _ = routed
    head = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0), target)
    for prompt in PROMPTS[:4]:
        ids = tok.encode(prompt)
        want = greedy_generate(target, tok, ids, max_new_tokens=24).token_ids
        for kw in ({}, {"pipeline": True, "compile_draft": True}, {"pipeline": True, "tree_nodes": 6}):
            got = speculative_generate(target, tok, head, ids, max_new_tokens=24, max_draft_tokens=4, **kw)
            assert got.token_ids == want, (prompt, kw)


def test_routing_back_restores_mlx_products(tiny_dirs):
    target, tok = load_target(tiny_dirs["qwen3"], dtype="bfloat16", quantize=4)
    ids = tok.encode(PROMPTS[0])
    want = greedy_generate(target, tok, ids, max_new_tokens=12).token_ids
    product = Counting()
    target.route_quantized_rows(product)
    target.route_quantized_rows(None)
    assert not target.rows_routed and greedy_generate(target, tok, ids, max_new_tokens=12).token_ids == want
    assert product.shapes == []


def test_the_pipelines_position_check_runs_on_mlx_products_and_leaves_the_routing(tiny_dirs):
    """check_offset_forward compares a 4-row plain forward with two 2-row offset forwards: routed
    by width (as worth_routing routes), the two sides would multiply differently (on the H100 a
    relative difference of 1.2e-2 stopped the pipelined loop). It checks the position handling
    on MLX's own products and puts the routing back."""
    target, _ = load_target(tiny_dirs["qwen3"], dtype="bfloat16", quantize=4)

    def off_at_two_rows(x, *args, **kwargs):  # a product unlike MLX's where it is routed
        return reference_rows_matmul(x, *args, **kwargs) + 0.5

    changed = target.route_quantized_rows(off_at_two_rows, policy=lambda rows, weights, tensor_cores: rows == 2)
    assert target.check_offset_forward() <= 1e-3
    assert target.rows_routed and target._routing[0] is off_at_two_rows
    routed = [m for _, m in target.model.named_modules() if hasattr(m, "_dspark_rows")]
    assert len(routed) == changed and all(m._dspark_rows is off_at_two_rows for m in routed)


@pytest.mark.skipif(cuda_available(), reason="off CUDA only")
def test_the_kernel_says_it_needs_cuda():
    with pytest.raises(RuntimeError, match="no CUDA backend"):
        quantized_rows_matmul()
    with pytest.raises(RuntimeError, match="no CUDA backend"):
        quantized_rows_matmul("wide")


# --- the probe (lab/kernel_probe.py) ---------------------------------------------------------------

def row_by_row(x, *args, **kwargs):
    """The stand-in computed one row at a time: width-independent by construction."""
    flat = x.reshape(-1, x.shape[-1])
    out = mx.concatenate([reference_rows_matmul(flat[i:i + 1], *args, **kwargs) for i in range(flat.shape[0])])
    return out.reshape(*x.shape[:-1], -1)


@pytest.fixture(scope="module")
def quantized(tiny_dirs):
    return load_target(tiny_dirs["qwen3"], dtype="bfloat16", quantize=4)


def test_the_probe_passes_a_width_independent_product_and_times_the_loop(quantized, tiny_dirs, tmp_path):
    target, tok = quantized
    head = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0), target)
    v = measure_rows_kernel(target, row_by_row, loop=(head, tok), loop_tokens=16, loop_passes=1)
    assert v.available and v.exact and v.checked >= 4 * len(kernel_probe.ROWS_CHECKED), v.reason
    assert v.loop_reference_ms > 0 and v.loop_kernel_ms > 0
    assert v.use == (v.loop_kernel_ms <= (1 - kernel_probe.MARGIN) * v.loop_reference_ms)
    assert not target.rows_routed  # left as found


def test_the_probe_keeps_out_a_product_that_is_off_or_depends_on_the_width(quantized):
    target, _ = quantized

    def off(x, *args, **kwargs):
        return row_by_row(x, *args, **kwargs) * 1.05

    def by_width(x, *args, **kwargs):  # one bfloat16 step up on every output when more than one row came
        out = row_by_row(x, *args, **kwargs)
        return (out.view(mx.uint16) + 1).view(mx.bfloat16) if x.shape[0] > 1 else out

    v = measure_rows_kernel(target, off)
    assert not v.use and not v.exact and "off the float32 product" in v.reason
    v = measure_rows_kernel(target, by_width)
    assert not v.use and "differs from the same row computed alone" in v.reason
    v = measure_rows_kernel(target, row_by_row)  # no loop: checked, never used untimed
    assert v.exact and not v.use and "not timed" in v.reason


def test_rows_verdicts_are_stored_per_pair_and_policy_and_reused(quantized, tmp_path, monkeypatch):
    from dspark_lab.engine import rows_kernel

    target, _ = quantized
    db = open_db(tmp_path / "k.duckdb")
    try:
        first = choose_rows_kernel(target, db=db, candidate=row_by_row, model_id="tiny")
        again = choose_rows_kernel(target, db=db, candidate=row_by_row, model_id="tiny")
        other = choose_rows_kernel(target, db=db, candidate=row_by_row, model_id="another")
        # Where the words layout is in force (a GPU before Ampere), no tree verify is routed: another key.
        monkeypatch.setattr(rows_kernel, "tensor_cores_available", lambda: False)
        on_words = choose_rows_kernel(target, db=db, candidate=row_by_row, model_id="tiny")
        monkeypatch.setattr(rows_kernel, "tensor_cores_available", lambda: True)
        # A verdict timed under another routing policy is not reused: the policy's widths are in its key.
        monkeypatch.setattr(rows_kernel, "CHAIN_VERIFY_ROWS", range(0))
        under_the_old_policy = choose_rows_kernel(target, db=db, candidate=row_by_row, model_id="tiny")
        monkeypatch.undo()
        # Nor one measured on other kernel sources (an older kernel).
        monkeypatch.setattr(rows_kernel, "SOURCE_DIGEST", "an-older-one")
        on_older_sources = choose_rows_kernel(target, db=db, candidate=row_by_row, model_id="tiny")
        monkeypatch.undo()
        still = choose_rows_kernel(target, db=db, candidate=row_by_row, model_id="tiny")
    finally:
        db.dispose()
    assert not first.reused and again.reused and not other.reused and not on_words.reused and not under_the_old_policy.reused
    assert not on_older_sources.reused and still.reused
    assert again.to_dict() == first.to_dict()


@pytest.mark.skipif(cuda_available(), reason="off CUDA only")
def test_off_cuda_the_probe_reports_the_kernel_unavailable(quantized):
    v = measure_rows_kernel(quantized[0])
    assert not v.available and not v.use and "CUDA" in v.reason


def test_the_cli_asks_for_cuda_when_told_to_route_and_stays_quiet_otherwise(tiny_dirs):
    """Off CUDA `--rows-kernel` is refused with the fix named; left unset nothing is probed."""
    from typer.testing import CliRunner

    from dspark_lab.cli import app

    args = ["generate", "-m", str(tiny_dirs["qwen3"]), "-p", "hi", "-n", "4", "--no-chat-template"]
    refused = CliRunner().invoke(app, args + ["--rows-kernel"])
    assert refused.exit_code != 0 and "CUDA" in refused.output and "Leave --rows-kernel off" in refused.output
    quiet = CliRunner().invoke(app, args)
    assert quiet.exit_code == 0 and "rows-kernel" not in quiet.output


def test_a_sweep_names_the_kernel_as_a_precision_and_needs_cuda_for_it(tiny_dirs):
    """--precisions rows-kernel: trials of MODEL@rows-kernel, their own baseline beside as-loaded;
    off CUDA loading it is refused with the fix named."""
    from dspark_lab.engine.names import split_variant, target_key
    from dspark_lab.errors import InputError
    from dspark_lab.lab.sweep import check_precision, load_variant, model_variant

    assert check_precision("Rows-Kernel") == "rows-kernel"
    mid = model_variant("/m/qwen2.5-coder-0.5b-q4-bfloat16", "rows-kernel")
    assert mid == "/m/qwen2.5-coder-0.5b-q4-bfloat16@rows-kernel"
    assert split_variant(mid) == ("/m/qwen2.5-coder-0.5b-q4-bfloat16", "rows-kernel")
    assert target_key(mid) == "qwen2.5-coder-0.5b@rows-kernel"
    if not cuda_available():
        with pytest.raises(InputError, match="drop it from --precisions"):
            load_variant(model_variant(str(tiny_dirs["qwen3"]), "rows-kernel"))


def test_the_device_benchmarks_run_here_through_the_stand_in(tmp_path, monkeypatch):
    """benchmarks/rows_kernel.py --reference and benchmarks/forward_parts.py on a tiny 4-bit model:
    every section runs and reports (the numbers mean nothing on a CPU)."""
    import json
    import sys

    from scripts import load_script

    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    head = build_tiny_dspark(tmp_path / "h", model, markov_rank=0)
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["rows_kernel.py", "--model", str(model), "--head", str(head), "--reference",
                                      "--dtype", "bfloat16", "--rows", "1,9", "--widths", "1,8", "--repeats", "1",
                                      "--prompts", "1", "--max-new-tokens", "8", "--tree-pipe", "4,3@2+lk", "--caps", "4",
                                      "--every-width", "--json", str(out)])
    load_script("rows_kernel").main()
    report = json.loads(out.read_text())
    assert report["layers"] and all(e[str(r)][f"{layout}_error"] == 0.0 and e[str(r)][f"{layout}_rows_alone_equal"]
                                    for e in report["layers"].values() for r in (1, 9) for layout in ("words", "wide"))
    assert set(report["forward"]) == {"1", "8"}
    arms = {r["arm"] for r in report["decode"]}
    # A tree named by its nodes alone is as deep as the first cap; NODES@DEPTH+lk names both and the lookup chain.
    assert arms == {f"{a}-{c}" for a in ("greedy", "pipe4", "tree4-pipe", "tree3d2lk-pipe") for c in ("mlx", "kernel")}
    assert all(r["equals_own_greedy"] for r in report["decode"])  # routed at every width: the kernel's own arithmetic
    # Random layers of given shapes, products only: no model to ship to time a model's shapes.
    out = tmp_path / "shapes.json"
    monkeypatch.setattr(sys, "argv", ["rows_kernel.py", "--shapes", "64x128,96x256", "--reference", "--rows", "1,3",
                                      "--repeats", "1", "--json", str(out)])
    load_script("rows_kernel").main()
    report = json.loads(out.read_text())
    assert set(report["layers"]) == {"random N=64 K=128 4b g64", "random N=96 K=256 4b g64"}
    assert all(e[str(r)][f"{layout}_error"] == 0.0 and e[str(r)]["weight_bytes"] > 0
               for e in report["layers"].values() for r in (1, 3) for layout in ("words", "wide"))
    # A shape it cannot read, or neither (or both) of --model and --shapes: an error saying how to write it.
    for argv, says in ((["--shapes", "64by128"], "write each shape as NxK"), ([], "give --model DIR"),
                       (["--shapes", "64x128", "--model", str(model)], "give --model DIR")):
        monkeypatch.setattr(sys, "argv", ["rows_kernel.py", *argv, "--reference"])
        with pytest.raises(SystemExit, match=says):
            load_script("rows_kernel").main()
    # One routed copy per policy and layout, each its own arms and forward column, MLX's beside them.
    out = tmp_path / "policies.json"
    monkeypatch.setattr(sys, "argv", ["rows_kernel.py", "--model", str(model), "--head", str(head), "--reference",
                                      "--dtype", "bfloat16", "--rows", "", "--widths", "9", "--repeats", "1",
                                      "--prompts", "1", "--max-new-tokens", "8", "--tree-pipe", "", "--caps", "3,4",
                                      "--copies", "worth_routing,multi_row:wide", "--json", str(out)])
    load_script("rows_kernel").main()
    report = json.loads(out.read_text())
    assert set(report["forward"]["9"]) == {"mlx_ms", "worthrouting_ms", "multirowwide_ms", "argmax_equal"}
    assert {r["arm"] for r in report["decode"]} == {f"{a}-{c}" for a in ("greedy", "pipe3", "pipe4")
                                                    for c in ("mlx", "worthrouting", "multirowwide")}
    # A cap the head cannot draft stops the run before any timing, naming the head's limit.
    out = tmp_path / "too_far.json"
    argv = ["rows_kernel.py", "--model", str(model), "--head", str(head), "--reference", "--rows", "1", "--widths", "1",
            "--repeats", "1", "--caps", "3,99", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match=r"--caps / --tree-pipe depths 99: the head at .* drafts 1\.\.\d+ tokens a round"):
        load_script("rows_kernel").main()
    assert not out.exists()
    # So does a tree deeper than the head drafts (NODES@DEPTH), whatever the caps.
    monkeypatch.setattr(sys, "argv", argv[:-4] + ["--caps", "3", "--tree-pipe", "4@99+lk", "--json", str(out)])
    with pytest.raises(SystemExit, match=r"depths 99: the head"):
        load_script("rows_kernel").main()
    assert not out.exists()
    out = tmp_path / "parts.json"
    monkeypatch.setattr(sys, "argv", ["forward_parts.py", "--model", str(model), "--widths", "1,4", "--prefill", "24",
                                      "--repeats", "1", "--json", str(out)])
    load_script("forward_parts").main()
    widths = json.loads(out.read_text())["widths"]
    assert set(widths) == {"1", "4"} and all(p["forward"] > 0 and p["products"] > 0 for p in widths.values())
    assert all(p[part] > 0 for p in widths.values() for part in ("norms", "rope", "cache writes", "elementwise"))
    # The additive mask is the boolean one in another form: the same logits.
    assert all(p["largest logit difference (additive mask)"] == 0.0 for p in widths.values())
    assert all(p["largest difference (matmuls)"] < 1e-2 for p in widths.values())  # the same attention, written out


def test_the_trees_session_script_runs_the_kernel_precision_and_check(tmp_path):
    """benchmarks/h200_trees.sh with python3 stubbed: PRECISIONS=stored,kernel repeats the parts and
    the evaluation with --rows-kernel into *_kernel files, ROWS_CHECK=1 runs rows_kernel.py first,
    and an unknown precision stops with the choices."""
    import os
    import subprocess

    from scripts import BENCHMARKS

    bin_dir, heads = tmp_path / "bin", tmp_path / "heads"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/usr/bin/env bash\necho "$*" >> "$CALLS"\n')
    (bin_dir / "python3").chmod(0o755)
    (heads / "qwen05").mkdir(parents=True)
    (heads / "qwen05" / "config.json").write_text("{}")
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "HEADS": str(heads),
           "OUT": str(tmp_path / "out"), "PARTS": "1", "ROWS_CHECK": "1", "SWEEP": "0", "PRECISIONS": "stored,kernel"}
    run = subprocess.run(["bash", str(BENCHMARKS / "h200_trees.sh"), "qwen05"], env=env, capture_output=True, text=True,
                         cwd=BENCHMARKS.parent)
    assert run.returncode == 0, run.stderr
    lines = calls.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["benchmarks/tree_check.py", "benchmarks/rows_kernel.py",
                                                  "benchmarks/tree_round_parts.py", "benchmarks/lossless_check.py",
                                                  "benchmarks/tree_round_parts.py", "benchmarks/lossless_check.py"]
    assert "rows_kernel.json" in lines[1]
    assert "--rows-kernel" not in lines[2] + lines[3]
    assert "--rows-kernel" in lines[4] and "parts_kernel.json" in lines[4]
    assert "--rows-kernel" in lines[5] and "eval_trees_kernel.json" in lines[5]
    env["PRECISIONS"] = "fp8"
    bad = subprocess.run(["bash", str(BENCHMARKS / "h200_trees.sh"), "qwen05"], env=env, capture_output=True, text=True,
                         cwd=BENCHMARKS.parent)
    assert bad.returncode == 2 and "unknown precision fp8 (stored, dequantized, kernel)" in bad.stdout


def test_with_verifies_routes_the_draft_projection_and_every_verify_width():
    """The candidate policy: worth_routing's products (a large layer at 2-7 rows, every layer at a
    chain verify's 8-16), and every product of 17 to MAX_ROWS rows too (a tree's verify); never a
    one-row step or a prefill."""
    from dspark_lab.engine.rows_kernel import MAX_ROWS, with_verifies, worth_routing

    big, small = 151_936 * 896, 896 * 896
    assert with_verifies(7, big) and worth_routing(7, big)
    assert not with_verifies(4, small) and not with_verifies(1, big) and not with_verifies(MAX_ROWS + 1, small)
    assert all(with_verifies(r, small) for r in (8, 16, 17, MAX_ROWS)) and worth_routing(8, small)
    assert not worth_routing(17, small) and not worth_routing(MAX_ROWS, small)


def test_a_trees_verify_is_routed_where_the_tensor_cores_take_the_layer():
    """The mma layout's cost barely grows with the rows, so the engine's policy routes a tree's
    verify (17-32 rows) through it, every layer; where a layer's product falls back to the words
    layout (8 bits, groups of 32) a tree's verify keeps MLX's kernels, as before."""
    attention = 896 * 896
    assert [r for r in range(1, MAX_ROWS + 1) if worth_routing(r, attention, tensor_cores=True)] == list(range(8, MAX_ROWS + 1))
    assert not worth_routing(1, attention, tensor_cores=True) and not worth_routing(MAX_ROWS + 1, attention, tensor_cores=True)

    def layer(bits, group, seed):
        lin = nn.Linear(128, 64, bias=False)
        lin.set_dtype(mx.bfloat16)
        return nn.QuantizedLinear.from_linear(lin, group_size=group, bits=bits)

    four, eight, small_groups = layer(4, 64, 0), layer(8, 64, 1), layer(4, 32, 2)
    model = nn.Sequential(four, eight, small_groups)
    mma, words = Counting(), Counting()
    mma.layout, words.layout = "mma", "words"
    assert route_quantized_rows(model, mma) == 3
    assert four._dspark_widths == frozenset(range(8, MAX_ROWS + 1))
    assert eight._dspark_widths == small_groups._dspark_widths == frozenset(range(8, 17))
    route_quantized_rows(model, words)  # the words layout: a chain's verify only
    assert four._dspark_widths == frozenset(range(8, 17))


def test_cuda_graphs_reads_mlx_graph_files_and_runs_here(tmp_path, monkeypatch):
    """benchmarks/cuda_graphs.py: a graph file as CUDA prints it (kernels as octagons labelled
    with their mangled symbols, a child graph as a rectangle naming it) is counted by kind and
    kernel name; on a CPU the script times its arms and records no graphs."""
    import json
    import sys

    from scripts import load_script

    from dspark_lab.tiny import build_tiny_model

    graphs = load_script("cuda_graphs")
    dot = """digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="bold" shape="octagon" label="0
_ZN3mlx4core2cu10qmv_kernelILi8ELi16ELi64ELb1ELb1EN7cutlass10bfloat16_tEEEvPKT_
"];

"graph_1_node_1"[style="bold" shape="octagon" label="1
_ZN3mlx4core2cu10qmv_kernelILi8ELi16ELi64ELb1ELb1EN7cutlass10bfloat16_tEEEvPKT_
"];

"graph_1_node_2"[style="solid" shape="rectangle" label="2
graph_2
"];

"graph_1_node_3"[style="bold" shape="octagon" label="3
nvjet_sm90_tst_64x8_64x16_1x1_h_bz_ptrBatch_NNT
"];
"graph_1_node_0" -> "graph_1_node_2";
}
}"""
    summary = graphs.summarize_dot(dot)
    assert summary == {"nodes": {"KERNEL": 3, "GRAPH": 1},
                       "kernels": {"qmv_kernel": 2, "nvjet_sm90_tst_64x8_64x16_1x1_h_bz_ptrBatch_NNT": 1}}
    assert graphs.kernel_name("_ZN3mlx4core2cu14rms_norm_smallI13__nv_bfloat16EEvPKT_") == "rms_norm_small"
    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    out = tmp_path / "graphs.json"
    monkeypatch.setattr(sys, "argv", ["cuda_graphs.py", "--model", str(model), "--widths", "1,3", "--prefill", "12",
                                      "--repeats", "1", "--dtype", "float32", "--json", str(out)])
    graphs.main()
    widths = json.loads(out.read_text())["widths"]
    assert set(widths) == {"1", "3"} and all(arm["ms"] > 0 for w in widths.values() for arm in w.values())


def test_the_mma_session_script_sweeps_with_the_layout_its_bench_found_faster(tmp_path):
    """benchmarks/h200_mma.sh with python3 stubbed (pick_layout.py runs for real): the bench step
    times the words copy beside the mma copies, then sweeps with DSPARK_LAB_ROWS_LAYOUT set to the
    layout whose chain at cap 7 decoded faster; without a report the sweep keeps the default;
    an unknown model or step stops with the choices."""
    import json
    import os
    import subprocess
    import sys

    from scripts import BENCHMARKS

    bin_dir, keep, out = tmp_path / "bin", tmp_path / "keep", tmp_path / "out"
    for d in (bin_dir, keep, out):
        d.mkdir()
    real = sys.executable
    # The stub writes the report the bench would (mma's chain faster) and records every call with its layout.
    report = json.dumps({"decode": [{"arm": "pipe7-worthrouting", "over_mlx_greedy": 1.8},
                                    {"arm": "pipe7-withverifiesmma", "over_mlx_greedy": 2.1}]})
    (bin_dir / "python3").write_text(
        '#!/usr/bin/env bash\n'
        f'if [ "$1" = benchmarks/pick_layout.py ]; then exec {real} "$@"; fi\n'
        'echo "${DSPARK_LAB_ROWS_LAYOUT:-none} $*" >> "$CALLS"\n'
        'for a in "$@"; do case $prev in --json) echo \'' + report + '\' > "$a";; esac; prev=$a; done\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls.txt"),
           "OUT": str(out), "KEEP": str(keep), "HEADS": str(tmp_path / "heads")}

    def script(*args):
        return subprocess.run(["bash", str(BENCHMARKS / "h200_mma.sh"), *args], env=env, capture_output=True, text=True,
                              cwd=BENCHMARKS.parent)

    from dspark_lab.engine.rows_kernel import DEFAULT_LAYOUT

    assert script("sweep", "qwen05").returncode == 0  # no bench report yet: the default layout
    run = script("bench", "qwen15")
    assert run.returncode == 0, run.stderr
    assert script("sweep", "qwen15", "--resume").returncode == 0
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[0].startswith(f"{DEFAULT_LAYOUT} -m dspark_lab sweep -m /root/ship/qwen05/") and "--precisions as-loaded,rows-kernel" in calls[0]
    assert calls[1].startswith("none benchmarks/rows_kernel.py --model /root/ship/qwen15/")
    assert "--copies worth_routing,with_verifies:mma,multi_row:mma,every_width:mma" in calls[1]
    assert calls[2].startswith("mma -m dspark_lab sweep") and calls[3].startswith("mma -m dspark_lab sweep")
    assert calls[3].endswith("--resume") and (keep / "qwen15.json").is_file()
    assert "chain at cap 7: words 1.80x, mma 2.10x" in run.stderr
    bad = script("bench", "llama")
    assert bad.returncode == 2 and "unknown model llama (qwen15, qwen05)" in bad.stderr
    assert script("tune").returncode == 2 and "unknown step tune" in script("tune").stdout
    # The choice itself: the words layout where its chain was as fast or faster, or an arm is missing.
    from scripts import load_script

    faster_layout = load_script("pick_layout").faster_layout
    tie = {"decode": [{"arm": "pipe7-worthrouting", "over_mlx_greedy": 2.0}, {"arm": "pipe7-withverifiesmma", "over_mlx_greedy": 2.0}]}
    assert faster_layout(tie)[0] == "words" and faster_layout(tie, cap=3) == (DEFAULT_LAYOUT, "no arm pipe3-worthrouting in the report: the default layout")
