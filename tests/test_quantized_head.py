"""A head stored quantized (`dspark-lab quantize-head`): a fraction of the float head's bytes, it
loads as stored, to the same weights a float head gets from being quantized at load, decodes
losslessly, dequantizes when asked for 16 bits, and refuses checkpoints that do not say how they
are quantized."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from conftest import PROMPTS
from dspark_lab import LoadError, greedy_generate, load_pair, speculative_generate
from dspark_lab.cli import app
from dspark_lab.engine.drafters.load import load_dspark, quantize_head_dir
from dspark_lab.tiny import build_tiny_dspark


@pytest.fixture(scope="module")
def heads(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("qhead")
    float_head = build_tiny_dspark(root / "float", tiny_dirs["qwen3"], block_size=4, seed=3)
    (float_head / "README.md").write_text("model card")
    (float_head / "data.jsonl").write_text("{}\n")  # what else a distill folder holds
    (float_head / "checkpoint").mkdir()
    sizes = {bits: quantize_head_dir(float_head, root / f"q{bits}", bits) for bits in (4, 8)}
    return float_head, root / "q4", root / "q8", sizes


def _params(drafter):
    return dict(tree_flatten(drafter.head.parameters()))


def test_a_stored_head_is_smaller_and_says_how_it_is_quantized(heads):
    float_head, q4, q8, sizes = heads
    (before4, after4), (before8, after8) = sizes[4], sizes[8]
    assert before4 == before8 and after4 < after8 < before4
    assert json.loads((q4 / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 4}
    card = (q4 / "README.md").read_text()  # the card travels with the weights and says how they are stored
    assert card.startswith("model card\n") and "Stored quantized by `dspark-lab quantize-head`: 4 bits, group size 64" in card
    assert sorted(p.name for p in q4.iterdir()) == ["README.md", "config.json", "model.safetensors"]  # no data, log or checkpoint
    assert any(k.endswith(".scales") for k in mx.load(str(q4 / "model.safetensors")))


@pytest.mark.parametrize("bits", [4, 8])
def test_it_loads_as_stored_to_the_weights_quantizing_at_load_gives(tiny_dirs, heads, qwen3, bits):
    float_head, q4, q8, _ = heads
    target, _ = qwen3
    stored = load_dspark(q4 if bits == 4 else q8, target, bits=bits)
    at_load = load_dspark(float_head, target, bits=bits)
    a, b = _params(stored), _params(at_load)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert isinstance(stored.head.fc, nn.QuantizedLinear) and stored.head.fc.bits == bits


def test_a_stored_head_decodes_losslessly_with_the_same_drafts(tiny_dirs, heads):
    float_head, q4, _, _ = heads
    target, tok, stored, _ = load_pair(tiny_dirs["qwen3"], q4, max_draft_tokens=3)
    _, _, at_load, _ = load_pair(tiny_dirs["qwen3"], float_head, max_draft_tokens=3)
    for p in PROMPTS[:4]:
        ref = greedy_generate(target, tok, p, max_new_tokens=24).token_ids
        a = speculative_generate(target, tok, stored, p, max_new_tokens=24, max_draft_tokens=3, lookup_drafts=False)
        b = speculative_generate(target, tok, at_load, p, max_new_tokens=24, max_draft_tokens=3, lookup_drafts=False)
        assert a.token_ids == ref == b.token_ids and a.accept_lengths == b.accept_lengths


def test_other_bits_start_from_the_stored_values(heads, qwen3):
    _, q4, _, _ = heads
    target, _ = qwen3
    stored = load_dspark(q4, target, bits=4)
    as_float = load_dspark(q4, target, bits=16)
    fc = stored.head.fc
    assert type(as_float.head.fc) is nn.Linear
    expected = mx.dequantize(fc.weight, fc.scales, fc.biases, fc.group_size, fc.bits)
    assert mx.array_equal(as_float.head.fc.weight, expected).item()
    at8 = load_dspark(q4, target, bits=8)  # more bits than stored: the stored values, as stored
    assert at8.head.fc.bits == 4 and mx.array_equal(at8.head.fc.weight, fc.weight).item()


def test_fewer_bits_than_stored_quantize_the_stored_values_again(heads, qwen3):
    _, _, q8, _ = heads
    target, _ = qwen3
    fc8 = load_dspark(q8, target, bits=8).head.fc
    at4 = load_dspark(q8, target, bits=4).head.fc
    assert (fc8.bits, at4.bits) == (8, 4)
    again = nn.QuantizedLinear.from_linear(_as_linear(fc8), group_size=64, bits=4)
    assert mx.array_equal(at4.weight, again.weight).item() and mx.array_equal(at4.scales, again.scales).item()


def _as_linear(q: nn.QuantizedLinear) -> nn.Linear:
    lin = nn.Linear(q.weight.shape[1] * 32 // q.bits, q.weight.shape[0], bias=False)
    lin.weight = mx.dequantize(q.weight, q.scales, q.biases, q.group_size, q.bits)
    return lin


def test_a_head_stored_at_3_bits_is_smaller_and_loads_as_stored(tiny_dirs, heads, qwen3, tmp_path):
    """Where 4 bits are too many for a committed head (a 1.5B head with a 3,072-wide MLP: 26 MB),
    3 bits take fewer bytes (in groups of 128, where they divide the widths: a Qwen 1.5B head's
    do, this tiny head's 64 does not, which is refused rather than left float); the default
    --drafter-bits 4 keeps them as stored, and decoding stays lossless."""
    float_head, _, _, sizes = heads
    before, after = quantize_head_dir(float_head, tmp_path / "q3", bits=3, group_size=64)
    assert before == sizes[4][0] and after < sizes[4][1]
    q3 = tmp_path / "q3"
    assert json.loads((q3 / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 3}
    assert "3 bits, group size 64" in (q3 / "README.md").read_text()
    with pytest.raises(LoadError, match=r"groups of 128 weights do not divide the input width of \S+ \(64\), which would stay float"):
        quantize_head_dir(float_head, tmp_path / "q3-128", bits=3, group_size=128)
    target, tok, drafter, _ = load_pair(tiny_dirs["qwen3"], q3, max_draft_tokens=3)
    fc = drafter.head.fc
    assert (fc.bits, fc.group_size) == (3, 64)
    for p in PROMPTS[:3]:
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=20, max_draft_tokens=3, lookup_drafts=False)
        assert r.token_ids == greedy_generate(target, tok, p, max_new_tokens=20).token_ids


def test_checkpoints_that_do_not_say_how_they_are_quantized_are_refused(heads, qwen3, tmp_path):
    float_head, q4, _, _ = heads
    target, _ = qwen3
    unsaid = tmp_path / "unsaid"
    shutil.copytree(q4, unsaid)
    cfg = json.loads((unsaid / "config.json").read_text())
    (unsaid / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization"}))
    with pytest.raises(LoadError, match=r'quantized \(\*\.scales\) but its config.json has no "quantization" entry'):
        load_dspark(unsaid, target)
    (unsaid / "config.json").write_text(json.dumps({**cfg, "quantization": {"group_size": 64, "bits": 7}}))
    with pytest.raises(LoadError, match='unusable "quantization" entry'):
        load_dspark(unsaid, target)
    said_but_float = tmp_path / "said-but-float"  # a config that says quantized over float tensors
    shutil.copytree(float_head, said_but_float)
    cfg = json.loads((said_but_float / "config.json").read_text())
    (said_but_float / "config.json").write_text(json.dumps({**cfg, "quantization": {"group_size": 64, "bits": 4}}))
    assert load_dspark(said_but_float, target, bits=4).head.fc.bits == 4  # quantized at load, not left float
    with pytest.raises(LoadError, match="stored quantized already"):
        quantize_head_dir(q4, tmp_path / "again")
    with pytest.raises(LoadError, match="another directory"):
        quantize_head_dir(float_head, float_head)
    with pytest.raises(LoadError, match="one of 2, 3, 4, 5, 6, 8 bits in groups of one of 32, 64, 128 weights, got 7 bits"):
        quantize_head_dir(float_head, tmp_path / "x", bits=7)
    with pytest.raises(LoadError, match="got 4 bits in groups of 100"):
        quantize_head_dir(float_head, tmp_path / "x", bits=4, group_size=100)


def test_quantize_head_cli(heads, tmp_path):
    float_head, _, _, _ = heads
    r = CliRunner().invoke(app, ["quantize-head", str(float_head), "--out", str(tmp_path / "q"), "--bits", "8"])
    assert r.exit_code == 0, r.output
    assert "MB at 8 bits, groups of 64" in r.output and (tmp_path / "q" / "model.safetensors").exists()
    r = CliRunner().invoke(app, ["quantize-head", str(tmp_path / "q"), "--out", str(tmp_path / "q2")])
    assert r.exit_code != 0 and "stored quantized already" in r.output
