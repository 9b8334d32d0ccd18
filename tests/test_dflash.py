"""DFlash and DFlash 2 heads: lossless at every cap and the full block, exact sampling, a
context that never runs ahead of the target, stored quantized (quantize-head) and loaded as
stored, and every refusal by its message."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import PROMPTS, REPETITIVE, assert_same_token_distribution
from dspark_lab import LoadError, dflash_generate, greedy_generate, load_dflash_pair
from dspark_lab.engine.drafters.load import load_dflash, load_dspark, quantize_head_dir
from dspark_lab.engine.speculative import HeadSource
from dspark_lab.tiny import build_tiny_dflash, build_tiny_dspark



@pytest.fixture(scope="session")
def dflash_heads(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    return {v: build_tiny_dflash(root / f"v{v}", tiny_dirs["qwen3"], version=v) for v in (1, 2)}


@pytest.fixture(scope="session")
def greedy_refs(qwen3):
    target, tok = qwen3
    return {p: greedy_generate(target, tok, p, max_new_tokens=24).token_ids for p in PROMPTS}


@pytest.mark.parametrize("version", [1, 2])
def test_lossless_at_every_cap_and_the_full_block(qwen3, dflash_heads, greedy_refs, version):
    target, tok = qwen3
    drafter = load_dflash(dflash_heads[version], target)
    assert drafter.config.version == version and drafter.config.max_drafts == 4
    for cap in (1, 2, 3, None):  # None: the full block
        for p in PROMPTS:
            r = dflash_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=cap)
            assert r.token_ids == greedy_refs[p], (version, cap, p)
            assert max(r.draft_lengths) <= (cap or 4)


@pytest.mark.parametrize("version", [1, 2])
def test_lossless_with_lookup_rounds_and_a_small_window(qwen3, dflash_heads, greedy_refs, version):
    """Lookup rounds commit several tokens at once, so several rows enter the head's context;
    a window of 3 positions forces the windowing path. After every round the head's context
    must hold exactly the positions in the target's cache: never ahead of it."""
    target, tok = qwen3
    drafter = load_dflash(dflash_heads[version], target, window=3)
    seen = []
    orig_commit, orig_start = HeadSource.commit, HeadSource.start

    def start(self, prompt_ids, taps):
        self.expected = len(prompt_ids)
        orig_start(self, prompt_ids, taps)

    def commit(self, tokens, taps):
        orig_commit(self, tokens, taps)
        if taps:
            self.expected += len(tokens)
        seen.append(self.drafter.ctx_len == self.expected)

    HeadSource.commit, HeadSource.start = commit, start
    try:
        for p in PROMPTS:
            r = dflash_generate(target, tok, drafter, p, max_new_tokens=24, lookup_drafts=True)
            assert r.token_ids == greedy_refs[p]
    finally:
        HeadSource.commit, HeadSource.start = orig_commit, orig_start
    assert seen and all(seen)


@pytest.mark.parametrize("version", [1, 2])
def test_sampling_is_exact(qwen3, dflash_heads, version):
    target, tok = qwen3
    drafter = load_dflash(dflash_heads[version], target, bits=16)
    prompt, n = REPETITIVE[1], 250
    params = dict(max_new_tokens=3, temperature=1.0, top_k=3, apply_chat_template=False)
    plain = [greedy_generate(target, tok, prompt, seed=s, **params).token_ids for s in range(n)]
    spec = [dflash_generate(target, tok, drafter, prompt, seed=7000 + s, **params).token_ids for s in range(n)]
    assert_same_token_distribution(plain, spec, (1, 2))


def test_dflash2_draft_distribution_lives_on_the_candidates(qwen3, dflash_heads):
    target, _ = qwen3
    drafter = load_dflash(dflash_heads[2], target, bits=16)
    drafter.reset()
    out = target.forward(mx.array([5, 6, 7, 8], dtype=mx.uint32), target.make_cache(), taps=drafter.target_layer_ids)
    drafter.append_context(out.taps)
    from dspark_lab import SamplingParams

    block = drafter.draft(9, 4, SamplingParams(temperature=1.0))
    q = np.array(block.probs)
    assert q.shape == (4, target.vocab_size)
    assert np.allclose(q.sum(axis=1), 1.0, atol=1e-5) and ((q > 0).sum(axis=1) <= 4).all()
    toks = block.tokens.tolist()
    assert all(q[i, t] > 0 for i, t in enumerate(toks))  # each draft was drawn from its row


@pytest.mark.parametrize("version", [1, 2])
def test_a_head_stored_quantized_loads_as_stored_and_decodes_losslessly(qwen3, dflash_heads, greedy_refs, tmp_path, version):
    """quantize-head stores a DFlash head as loading would quantize it: the linear layers at 4 bits,
    DFlash 2's convolutions and selector in float. It loads with exactly the stored tensors (no
    second quantization; compared before its projections are stacked), and its drafts change nothing
    in the greedy ids."""
    target, tok = qwen3
    quantize_head_dir(dflash_heads[version], tmp_path / "q4", bits=4)
    assert json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 4}
    stored = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    drafter = load_dflash(tmp_path / "q4", target, bits=4, stack_projections=False)
    loaded = dict(tree_flatten(drafter.head.parameters()))
    assert loaded.keys() == stored.keys() and all(mx.array_equal(loaded[k], stored[k]).item() for k in stored)
    at_load = dict(tree_flatten(load_dflash(dflash_heads[version], target, bits=4, stack_projections=False).head.parameters()))
    assert at_load.keys() == stored.keys() and all(mx.array_equal(at_load[k], stored[k]).item() for k in stored)
    layer = drafter.head.layers[0]
    for linear in (drafter.head.fc, layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(linear, nn.QuantizedLinear) and linear.bits == 4
    if version == 2:
        assert type(layer.attention_conv.kernel_projection) is nn.Linear
        assert type(drafter.head.candidate_selector.hidden_projection) is nn.Linear
    drafter = load_dflash(tmp_path / "q4", target, bits=4)  # stacked, as it decodes
    for p in PROMPTS:
        r = dflash_generate(target, tok, drafter, p, max_new_tokens=24, temperature=0.0)
        assert r.token_ids == greedy_refs[p], p


def test_nested_block_size_and_pair_loader(tiny_dirs, tmp_path):
    head = build_tiny_dflash(tmp_path / "n", tiny_dirs["qwen3"], nested_block_size=True, block_size=6)
    target, tok, drafter, cfg = load_dflash_pair(tiny_dirs["qwen3"], head)
    assert drafter.config.block_size == 6 and cfg.max_draft_tokens == 5 and cfg.mode == "dflash"
    assert "auto_map" in drafter.config.ignored


def edit(head_dir, fn):
    cfg = json.loads((head_dir / "config.json").read_text())
    fn(cfg)
    (head_dir / "config.json").write_text(json.dumps(cfg))


def drop_tensors(head_dir, prefix):
    w = mx.load(str(head_dir / "model.safetensors"))
    mx.save_safetensors(str(head_dir / "model.safetensors"), {k: v for k, v in w.items() if not k.startswith(prefix)})


REFUSALS = [
    ("no-block-size", 1, lambda d: edit(d, lambda c: c.pop("block_size")), "this does not look like a DFlash checkpoint"),
    ("v2-as-v1", 2, lambda d: edit(d, lambda c: [c["dflash_config"].pop(k) for k in ("selector_rank", "selector_top_k", "conv_kernel_size")]),
     "will not run a DFlash 2 head as DFlash 1"),
    ("hybrid", 1, lambda d: edit(d, lambda c: c.update(markov_rank=16)), "carries a Markov head"),
    ("missing-fields", 1, lambda d: edit(d, lambda c: c["dflash_config"].pop("mask_token_id")), "missing required fields: mask_token_id"),
    ("no-window", 1, lambda d: edit(d, lambda c: c.pop("sliding_window")), "gives no sliding_window"),
    ("bad-layer-types", 1, lambda d: edit(d, lambda c: c.update(layer_types=["full_attention"])), "layer_types must list"),
    ("missing-tensor", 1, lambda d: drop_tensors(d, "layers.1.mlp"), r"missing: layers\.1\.mlp"),
    ("missing-selector", 2, lambda d: drop_tensors(d, "candidate_selector."), r"missing: candidate_selector"),
    ("backbone", 1, lambda d: edit(d, lambda c: c.update(model_type="mamba")), "unsupported DFlash backbone family 'mamba'"),
]


@pytest.mark.parametrize("name, version, mutate, match", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals(qwen3, tiny_dirs, tmp_path, name, version, mutate, match):
    target, _ = qwen3
    head = build_tiny_dflash(tmp_path / name, tiny_dirs["qwen3"], version=version)
    mutate(head)
    with pytest.raises(LoadError, match=match):
        load_dflash(head, target)


def test_dspark_head_offered_as_dflash_is_refused(qwen3, tiny_dirs, tmp_path):
    target, _ = qwen3
    with pytest.raises(LoadError, match="this is a DSpark head"):
        load_dflash(build_tiny_dspark(tmp_path / "d", tiny_dirs["qwen3"]), target)


@pytest.mark.parametrize("version, match", [(1, "DFlash block-diffusion head"), (2, "DFlash 2 block-diffusion head")])
def test_dflash_head_offered_as_dspark_is_refused(qwen3, dflash_heads, version, match):
    target, _ = qwen3
    with pytest.raises(LoadError, match=match):
        load_dspark(dflash_heads[version], target)


def test_cli_generate_dflash(tiny_dirs, dflash_heads):
    from typer.testing import CliRunner

    from dspark_lab.cli import app

    r = CliRunner().invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "-d", str(dflash_heads[2]), "--mode", "dflash", "-p", "hi", "-n", "8"])
    assert r.exit_code == 0, r.output
    assert "8 tokens" in r.output


def test_sweep_runs_each_head_in_the_mode_it_loads_as(tiny_dirs, dflash_heads, tmp_path):
    import duckdb

    from dspark_lab.lab.sweep import SweepConfig, run_sweep

    dspark_head = build_tiny_dspark(tmp_path / "ds", tiny_dirs["qwen3"], block_size=4)
    cfg = SweepConfig(models=[str(tiny_dirs["qwen3"])], drafters=[str(dspark_head), str(dflash_heads[1])],
                      modes=["baseline", "dspark", "dflash"], caps=["2"], prompt_sets=["code"], trials=1, max_new_tokens=8, prompt_limit=2)
    events = []
    run_sweep(cfg, tmp_path / "r.duckdb", progress=False, on_event=events.append)
    con = duckdb.connect(str(tmp_path / "r.duckdb"), read_only=True)
    got = con.sql("select mode, drafter_id, count(*), bool_and(coalesce(lossless, true)) from trials group by all order by all").fetchall()
    con.close()
    assert got == [("baseline", None, 2, True), ("dflash", str(dflash_heads[1]), 2, True), ("dspark", str(dspark_head), 2, True)]
    assert sum("skipping drafter" in e for e in events) == 2  # each head refused in the other mode
