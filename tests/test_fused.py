"""Sibling projections stacked into one product (engine/fused.py): the same logits bit for bit
on MLX's kernels, fewer operations in a step's graph, the same tokens through every decoding
path, and groups that cannot stack left alone."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from conftest import PROMPTS
from dspark_lab import greedy_generate, load_target, speculative_generate
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.fused import FusedPart, fuse_projections, is_fused
from dspark_lab.engine.rows_kernel import every_width, reference_rows_matmul
from dspark_lab.lab.sweep import check_precision, load_variant, model_variant


def _count_ops(*outputs) -> int:
    import io
    import re

    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return len(re.findall(r'shape=rectangle', buf.getvalue()))


def _count_products(*outputs) -> int:
    """Matrix products in the outputs' graph (a stacked product's split parts are views on a GPU,
    but export_to_dot draws each as an operation, so operations in all would not show the saving)."""
    import io
    import re

    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return len(re.findall(r'label ="(?:Matmul|QuantizedMatmul|AddMM)"', buf.getvalue()))


def _logits_both_ways(plain, fused, ids):
    """Prefill, a one-row step and an 8-row verify through both copies, on their own caches."""
    caches = plain.make_cache(), fused.make_cache()
    out = []
    for rows in (ids, ids[-1:], ids[-8:]):
        out.append(tuple(t.forward(mx.array(rows), c).logits for t, c in zip((plain, fused), caches)))
    return out


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("bits", [None, 4])
def test_stacked_projections_give_the_same_logits_bit_for_bit(tiny_dirs, family, bits):
    plain, tok = load_target(tiny_dirs[family], quantize=bits, fuse_projections=False)
    fused, _ = load_target(tiny_dirs[family], quantize=bits)  # stacked: load_target's default
    layers = len(plain.layers)
    assert is_fused(fused.model) and not is_fused(plain.model)
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert all(isinstance(attn[n], FusedPart) for n in ("q_proj", "k_proj", "v_proj"))
    assert all(isinstance(mlp[n], FusedPart) for n in ("gate_proj", "up_proj"))
    assert type(attn["qkv_proj"]) is (nn.Linear if bits is None else nn.QuantizedLinear)
    # the same weights, held once: the siblings hold none of their own
    size = lambda t: sum(v.size for _, v in tree_flatten(t.model.parameters()))  # noqa: E731
    assert size(fused) == size(plain)
    assert fused.fuse_projections() == 0  # already stacked: nothing more to do
    for a, b in _logits_both_ways(plain, fused, tok.encode(PROMPTS[0] + " " + PROMPTS[5])):
        assert mx.array_equal(a, b).item()
    assert layers == len(fused.layers)


def test_a_step_builds_fewer_operations(tiny_dirs):
    """Qwen2's q, k and v carry biases: three products and three adds become one of each, and the
    MLP's gate and up one product: five fewer operations a layer in a one-row step."""
    plain, tok = load_target(tiny_dirs["qwen2"], quantize=4, fuse_projections=False)
    fused, _ = load_target(tiny_dirs["qwen2"], quantize=4)
    counts = []
    for t in (plain, fused):
        cache = t.make_cache()
        mx.eval(t.forward(mx.array(tok.encode(PROMPTS[0])), cache).logits)
        counts.append(_count_ops(t.forward(mx.array([1]), cache).logits))
    assert counts[0] - counts[1] >= 5 * len(plain.layers)


def test_a_sibling_called_alone_or_out_of_order_still_gets_its_own_columns(tiny_dirs):
    """No call order is assumed: each part is its own layer's product, whichever sibling asks
    first, twice, or on another input; and nothing is held once every sibling is served."""
    plain, _ = load_target(tiny_dirs["qwen2"], fuse_projections=False)
    fused, _ = load_target(tiny_dirs["qwen2"])
    a, b = plain.layers[1].self_attn, fused.layers[1].self_attn
    x, y = mx.random.normal((1, 3, plain.hidden_size)), mx.random.normal((1, 2, plain.hidden_size))
    assert mx.array_equal(b.v_proj(x), a.v_proj(x)).item()
    assert mx.array_equal(b.k_proj(y), a.k_proj(y)).item()  # another input: computed again
    assert mx.array_equal(b.k_proj(y), a.k_proj(y)).item()  # the same sibling twice
    for n in ("q_proj", "k_proj", "v_proj"):
        assert mx.array_equal(b[n](x), a[n](x)).item()
    assert b.q_proj._stacked.input is None and b.q_proj._stacked.parts == []


def test_layers_that_cannot_stack_are_left_alone():
    """Different packing (bits) or a class the stacking does not know: the group stays as it is."""
    class Attn(nn.Module):
        def __init__(self, k_bits):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.QuantizedLinear(64, 64, bits=b) for b in (4, k_bits, 4))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(64, 128), nn.Embedding(64, 128)

    mixed = nn.Sequential(Attn(8), Mlp())
    assert fuse_projections(mixed) == 0 and not is_fused(mixed)
    assert fuse_projections(nn.Sequential(Attn(4))) == 1


def test_every_decoding_path_through_the_stacked_target_decodes_its_greedy_tokens(tiny_dirs, heads):
    """Greedy (plain and compiled step), the DSpark loop and the pipelined loop, with the rows
    kernel's stand-in routed over the stacked layers too: the plain target's greedy tokens."""
    plain, tok = load_target(tiny_dirs["qwen3"], quantize=4, fuse_projections=False)
    fused, _ = load_target(tiny_dirs["qwen3"], quantize=4)
    head = load_dspark(heads["qwen3"], fused)
    for prompt in PROMPTS[:4] + PROMPTS[14:16]:
        want = greedy_generate(plain, tok, prompt, max_new_tokens=24).token_ids
        assert greedy_generate(fused, tok, prompt, max_new_tokens=24).token_ids == want
        assert greedy_generate(fused, tok, prompt, max_new_tokens=24, compiled_step=True).token_ids == want
        assert speculative_generate(fused, tok, head, prompt, max_new_tokens=24, max_draft_tokens=4).token_ids == want
        assert speculative_generate(fused, tok, head, prompt, max_new_tokens=24, max_draft_tokens=4, pipeline=True).token_ids == want
    assert fused.route_quantized_rows(reference_rows_matmul, policy=every_width) > 0
    assert isinstance(fused.layers[0].self_attn.q_proj, FusedPart)  # routing keeps the parts, routes the stacked layer
    head = load_dspark(heads["qwen3"], fused)
    prompt = PROMPTS[0]
    want = greedy_generate(plain, tok, prompt, max_new_tokens=24).token_ids
    assert speculative_generate(fused, tok, head, prompt, max_new_tokens=24, max_draft_tokens=4, pipeline=True).token_ids == want


def test_a_routed_target_stacked_afterwards_keeps_its_route(tiny_dirs):
    target, tok = load_target(tiny_dirs["qwen2"], quantize=4, fuse_projections=False)
    target.route_quantized_rows(reference_rows_matmul, policy=every_width)
    assert target.fuse_projections() == 2 * len(target.layers)
    assert target.rows_routed
    assert type(target.layers[0].self_attn["qkv_proj"]).__name__ == "QuantizedLinear"  # the routed subclass keeps the name
    assert type(target.layers[0].self_attn["qkv_proj"]) is not nn.QuantizedLinear


def test_the_sweep_runs_the_unfused_model_beside_as_loaded(tiny_dirs):
    assert check_precision("Unfused") == "unfused"
    model_id = model_variant(str(tiny_dirs["qwen2"]), "unfused")
    assert model_id.endswith("@unfused")
    assert not is_fused(load_variant(model_id)[0].model)
    assert is_fused(load_variant(str(tiny_dirs["qwen2"]))[0].model)
    assert is_fused(load_variant(model_variant(str(tiny_dirs["qwen2"]), "8"))[0].model)  # stored another way, then stacked


def test_the_mlx_lm_reference_runs_the_layers_as_stored_and_the_engine_gets_them_stacked_back(tiny_dirs):
    """mlx-lm's decoding stands for mlx-lm as its users load the model: within as_stored each
    projection is its own layer again (views of the stacked weights), outside it stacked."""
    from dspark_lab.engine import mlx_lm_generate
    from dspark_lab.engine.fused import as_stored

    fused, tok = load_target(tiny_dirs["qwen2"], quantize=4)
    plain, _ = load_target(tiny_dirs["qwen2"], quantize=4, fuse_projections=False)
    attn = fused.layers[0].self_attn
    seen = {}
    with as_stored(fused.model):
        seen["inside"] = type(attn["q_proj"]), "qkv_proj" in attn
        assert mx.array_equal(attn["k_proj"].weight, plain.layers[0].self_attn.k_proj.weight).item()
    assert seen["inside"] == (nn.QuantizedLinear, False)
    assert isinstance(attn["q_proj"], FusedPart) and "qkv_proj" in attn
    want = greedy_generate(plain, tok, PROMPTS[0], max_new_tokens=16).token_ids
    assert mlx_lm_generate(fused, tok, PROMPTS[0], max_new_tokens=16).token_ids == want
    assert greedy_generate(fused, tok, PROMPTS[0], max_new_tokens=16).token_ids == want


def _head_outputs(drafter, target_hidden: int) -> list[mx.array]:
    """A drafter's context append on fixed random taps, then a block pass: the context keys and
    values it wrote, and (DSpark) the block's final hidden rows or (DFlash) its greedy drafts."""
    from dspark_lab.engine.sampling import SamplingParams

    mx.random.seed(3)
    taps = {t: mx.random.normal((5, target_hidden)) for t in drafter.target_layer_ids}
    drafter.reset()
    drafter.append_context(taps)
    written = [c.keys for c in drafter.caches] + [c.values for c in drafter.caches]
    if hasattr(drafter, "hidden"):
        return written + [drafter.hidden(7, drafter.config.block_size)]
    return written + [drafter.draft(7, 4, SamplingParams()).tokens]


@pytest.mark.parametrize("bits", [16, 4])
def test_a_heads_stacked_projections_draft_the_same_rows_bit_for_bit_with_fewer_operations(tiny_dirs, heads, bits):
    """A head's layers stack their q/k/v and gate/up products too (load_dspark's default): the same
    hidden rows and context keys bit for bit on MLX's kernels, the same tokens decoded, and a
    draft that launches fewer products (each layer's context append one fewer, its block pass three)."""
    target, tok = load_target(tiny_dirs["qwen3"], quantize=4)
    plain = load_dspark(heads["qwen3"], target, bits=bits, stack_projections=False)
    stacked = load_dspark(heads["qwen3"], target, bits=bits)
    assert not is_fused(plain.head) and is_fused(stacked.head)
    assert isinstance(stacked.head.layers[0].self_attn.k_proj, FusedPart)
    for a, b in zip(_head_outputs(plain, target.hidden_size), _head_outputs(stacked, target.hidden_size)):
        assert mx.array_equal(a, b).item()
    products = [_count_products(*_head_outputs(d, target.hidden_size)) for d in (plain, stacked)]
    assert products[0] - products[1] == 4 * len(plain.head.layers)
    for d in (plain, stacked):
        out = speculative_generate(target, tok, d, PROMPTS[0], max_new_tokens=16, max_draft_tokens=4, pipeline=True)
        assert out.token_ids == greedy_generate(target, tok, PROMPTS[0], max_new_tokens=16).token_ids


def test_a_dflash_heads_projections_stack_as_well(tiny_dirs, tmp_path):
    from dspark_lab.engine.drafters.load import load_dflash
    from dspark_lab.tiny import build_tiny_dflash

    target, _ = load_target(tiny_dirs["qwen3"], quantize=4)
    head_dir = build_tiny_dflash(tmp_path / "dflash", tiny_dirs["qwen3"])
    plain = load_dflash(head_dir, target, stack_projections=False)
    stacked = load_dflash(head_dir, target)
    assert is_fused(stacked.head) and not is_fused(plain.head)
    for a, b in zip(_head_outputs(plain, target.hidden_size), _head_outputs(stacked, target.hidden_size)):
        assert mx.array_equal(a, b).item()
