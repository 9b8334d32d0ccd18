"""DSpark heads: every packaging loads 1:1, every incompatibility is refused by message, and
speculative decoding with a head is lossless (ids == greedy) and samples exactly."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import PROMPTS, REPETITIVE, assert_same_token_distribution
from dspark_lab import InputError, LoadError, SamplingParams, greedy_generate
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.speculative import load_pair, speculative_generate
from dspark_lab.tiny import DSPARK_LAYOUTS, build_tiny_dspark



@pytest.mark.parametrize("backbone", ["qwen3", "gemma4", "repeat"])
def test_lossless_at_every_cap(qwen3, heads, greedy_refs, backbone):
    """Both loops, plain and pipelined (engine/pipeline.py), give greedy's ids, and the same rounds."""
    target, tok = qwen3
    drafter = load_dspark(heads[backbone], target)
    for cap in range(1, drafter.config.block_size + 1):
        for p in PROMPTS:
            r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=cap, lookup_drafts=False)
            assert r.token_ids == greedy_refs[p], (backbone, cap, p)
            assert max(r.draft_lengths) <= cap
            piped = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=cap, pipeline=True)
            assert piped.token_ids == greedy_refs[p], (backbone, cap, p, "pipelined")
            assert piped.accept_lengths == r.accept_lengths and piped.host_reads == piped.num_rounds + 1
            # Near the length limit the plain loop drafts fewer (never past the limit); the
            # pipelined one drafts the cap and cuts the output to the limit instead.
            for i, (ours, theirs) in enumerate(zip(piped.draft_lengths, r.draft_lengths)):
                room = 24 - 1 - sum(r.accept_lengths[:i])
                assert ours == cap and theirs == min(cap, room - 1)


@pytest.mark.parametrize("backbone", ["qwen3", "repeat"])
def test_lossless_with_lookup_drafts_and_confidence(qwen3, heads, greedy_refs, backbone):
    target, tok = qwen3
    drafter = load_dspark(heads[backbone], target)
    for p in PROMPTS:
        for kwargs in (dict(lookup_drafts=True), dict(lookup_drafts=True, confidence_threshold=0.5), dict(lookup_drafts=False, confidence_threshold=0.3)):
            r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, **kwargs)
            assert r.token_ids == greedy_refs[p], (kwargs, p)


def test_drafts_are_really_accepted_and_recorded(qwen3, heads):
    target, tok = qwen3
    drafter = load_dspark(heads["repeat"], target)
    r = speculative_generate(target, tok, drafter, REPETITIVE[0], max_new_tokens=40, max_draft_tokens=4, lookup_drafts=False)
    assert r.mean_accept_len > 2.0
    d = r.per_position_acceptance()
    assert len(d) == 4 and d == sorted(d, reverse=True) and d[0] > 0.5
    assert len(r.accept_lengths) == len(r.draft_lengths) == r.num_rounds


def test_one_host_read_per_round(qwen3, heads):
    target, tok = qwen3
    drafter = load_dspark(heads["repeat"], target)
    r = speculative_generate(target, tok, drafter, PROMPTS[0], max_new_tokens=30, max_draft_tokens=5)
    assert r.host_reads == r.num_rounds + 1  # + the prefill's first token


def test_small_drafter_window_stays_lossless(qwen3, heads, greedy_refs):
    target, tok = qwen3
    drafter = load_dspark(heads["qwen3"], target, window=4)
    for p in PROMPTS[:8]:
        assert speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=3).token_ids == greedy_refs[p]
        plain = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=3, lookup_drafts=False)
        piped = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=3, pipeline=True)
        assert piped.token_ids == greedy_refs[p] and piped.accept_lengths == plain.accept_lengths  # the same windowed drafts


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_drafter_bits(qwen3, heads, greedy_refs, bits):
    target, tok = qwen3
    drafter = load_dspark(heads["repeat"], target, bits=bits)
    quantized = any(k.endswith("scales") for k, _ in tree_flatten(drafter.head.parameters()))
    assert quantized == (bits != 16)
    p = PROMPTS[0]
    assert speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=3).token_ids == greedy_refs[p]


@pytest.mark.parametrize("pipeline", [False, True, "pipeline+lookup"])
def test_speculative_sampling_is_exact(qwen3, heads, pipeline):
    """Tokens 2-4 sampled through DSpark drafts (with the drafter's own distribution), by the
    plain or the pipelined loop, follow the same distribution as plain sampling from the target
    (chi-square homogeneity, ALPHA)."""
    target, tok = qwen3
    drafter = load_dspark(heads["repeat"], target, bits=16)
    prompt, n = REPETITIVE[1], 300
    params = dict(max_new_tokens=4, temperature=1.0, top_k=3, apply_chat_template=False)
    plain = [greedy_generate(target, tok, prompt, seed=s, **params).token_ids for s in range(n)]
    lookup = pipeline == "pipeline+lookup"  # device-side lookup drafts: one-hot proposals over the head's
    runs = [speculative_generate(target, tok, drafter, prompt, seed=5000 + s, max_draft_tokens=3, lookup_drafts=lookup,
                                 pipeline=bool(pipeline), **params) for s in range(n)]
    assert sum(sum(a - 1 for a in r.accept_lengths) for r in runs) > n // 2  # drafts were accepted
    spec = [r.token_ids for r in runs]
    assert_same_token_distribution(plain, spec, (1, 2, 3))


# --- packagings -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", DSPARK_LAYOUTS)
def test_every_packaging_loads_and_is_lossless(qwen3, tmp_path, tiny_dirs, greedy_refs, layout):
    target, tok = qwen3
    head = build_tiny_dspark(tmp_path / layout, tiny_dirs["qwen3"], layout=layout)
    drafter = load_dspark(head, target)
    assert drafter.config.packaging == layout
    for p in PROMPTS[:5]:
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=3, lookup_drafts=False)
        assert r.token_ids == greedy_refs[p]


def test_layout_specific_fields(qwen3, tmp_path, tiny_dirs):
    target, _ = qwen3
    t = tiny_dirs["qwen3"]
    native = load_dspark(build_tiny_dspark(tmp_path / "n", t), target).config
    assert "auto_map" in native.ignored and "sliding_window" in native.ignored and not native.causal
    causal = load_dspark(build_tiny_dspark(tmp_path / "c", t, layout="dflash-causal"), target).config
    assert causal.causal and causal.sliding_window == 8 and causal.attention_sink and not causal.has_lm_head
    spec = load_dspark(build_tiny_dspark(tmp_path / "s", t, layout="speculators", draft_vocab=100), target).config
    assert spec.draft_vocab_size == 100 and spec.logits_start == 0
    lfm = load_dspark(build_tiny_dspark(tmp_path / "l", t, layout="lfm2"), target).config
    assert lfm.rope_interleaved and not lfm.has_embed_tokens
    sf = load_dspark(build_tiny_dspark(tmp_path / "f", t, layout="specforge"), target).config
    assert sf.markov_rank == 16 and sf.enable_confidence_head  # hoisted out of dflash_config


def test_reduced_draft_vocab_is_lossless(qwen3, tmp_path, tiny_dirs, greedy_refs):
    target, tok = qwen3
    drafter = load_dspark(build_tiny_dspark(tmp_path / "dv", tiny_dirs["qwen3"], layout="speculators", draft_vocab=150), target)
    for p in PROMPTS[:6]:
        assert speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, lookup_drafts=False).token_ids == greedy_refs[p]
    out = drafter.draft(5, 4, SamplingParams())
    assert all(0 <= t < 150 for t in out.tokens.tolist())  # mapped through d2t (zero offsets)


def edit(head_dir, **changes):
    cfg = json.loads((head_dir / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (head_dir / "config.json").write_text(json.dumps(cfg))
    return head_dir


def edit_tensors(head_dir, drop=(), add=None):
    w = mx.load(str(head_dir / "model.safetensors"))
    for k in drop:
        w.pop(k)
    w.update(add or {})
    mx.save_safetensors(str(head_dir / "model.safetensors"), w)
    return head_dir


REFUSALS = [
    ("other-algorithm", lambda d: edit(d, speculators_config={"algorithm": "eagle3"}), "layout=speculators",
     "speculators checkpoint of algorithm 'eagle3'"),
    ("full-model", lambda d: edit(d, architectures=["Qwen3ForCausalLM"]), "", "looks like a full model"),
    ("full-model-tensors", lambda d: edit_tensors(d, add={"model.layers.0.mlp.up_proj.weight": mx.zeros((2, 2))}), "", "looks like a full model"),
    ("backbone", lambda d: edit(d, model_type="mamba"), "", "unsupported DSpark backbone family 'mamba'"),
    ("missing-fields", lambda d: edit(d, block_size=None, mask_token_id=None), "", "missing required fields: block_size, mask_token_id"),
    ("vocab-without-d2t", lambda d: edit_tensors(d, drop=["d2t"]), "layout=speculators,draft_vocab=100", "no d2t table"),
    ("d2t-without-vocab", lambda d: edit(d, draft_vocab_size=None), "layout=speculators,draft_vocab=100", "d2t table but the config declares no draft_vocab_size"),
    ("dflash-head", lambda d: edit_tensors(edit(d, architectures=["DFlashDraftModel"], markov_rank=None, dflash_config={"mask_token_id": 1}),
                                           drop=["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]), "", "DFlash block-diffusion head"),
    ("dflash2-head", lambda d: edit_tensors(edit(d, architectures=["DFlashDraftModel"], markov_rank=None, selector_rank=8),
                                            drop=["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]), "", "DFlash 2 block-diffusion head"),
    ("missing-tensor", lambda d: edit_tensors(d, drop=["layers.0.mlp.up_proj.weight"]), "", r"missing: layers\.0\.mlp\.up_proj\.weight"),
    ("unexpected-tensor", lambda d: edit_tensors(d, add={"layers.0.extra.weight": mx.zeros((2,))}), "", r"unexpected: layers\.0\.extra\.weight"),
    ("wrong-shape", lambda d: edit_tensors(d, add={"fc.weight": mx.zeros((64, 64))}), "", r"wrong shape: fc\.weight"),
    ("markov-type", lambda d: edit(d, markov_head_type="rnn"), "", "Markov head type 'rnn' is not supported"),
    ("vocab-mismatch", lambda d: edit(d, vocab_size=999), "", "differs from the target's"),
    ("tap-range", lambda d: edit(d, target_layer_ids=[0, 7]), "", r"tap layers \[7\] are out of range"),
]


@pytest.mark.parametrize("name, mutate, opts, match", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_name_the_reason(qwen3, tmp_path, tiny_dirs, name, mutate, opts, match):
    target, _ = qwen3
    kwargs = {}
    for item in filter(None, opts.split(",")):
        k, v = item.split("=")
        kwargs[k] = int(v) if v.isdigit() else v
    head = build_tiny_dspark(tmp_path / name, tiny_dirs["qwen3"], **kwargs)
    mutate(head)
    with pytest.raises(LoadError, match=match):
        load_dspark(head, target)


def test_bad_drafter_options(qwen3, heads):
    target, tok = qwen3
    with pytest.raises(LoadError, match="drafter bits must be one of 4, 8, 16"):
        load_dspark(heads["qwen3"], target, bits=3)
    drafter = load_dspark(heads["qwen3"], target)
    with pytest.raises(InputError, match=r"max_draft_tokens must be in 1\.\.5"):
        speculative_generate(target, tok, drafter, "hi", max_draft_tokens=6)
    with pytest.raises(InputError, match="confidence_threshold must be in"):
        speculative_generate(target, tok, drafter, "hi", confidence_threshold=1.5)


# --- load_pair and the registry ---------------------------------------------------------------

def test_load_pair_with_drafter(tiny_dirs, heads):
    target, tok, drafter, cfg = load_pair(tiny_dirs["qwen3"], heads["qwen3"], max_draft_tokens=3)
    assert cfg.source == "user" and cfg.max_draft_tokens == 3 and cfg.mode == "dspark"
    assert speculative_generate(target, tok, drafter, "hi", max_new_tokens=5).num_tokens == 5


def test_load_pair_without_registry_entry(tiny_dirs):
    with pytest.raises(LoadError, match="no measured drafter for .* Pass drafter=.*lookup"):
        load_pair(tiny_dirs["qwen3"])


def test_load_pair_resolves_from_registry(tiny_dirs, heads, tmp_path):
    reg = tmp_path / "registry.json"
    reg.write_text(json.dumps({"pairs": [{"target": str(tiny_dirs["qwen3"]), "drafter": str(heads["repeat"]), "cap": 4,
                                          "speedup": 2.5, "trials": 9, "device": "test", "run_ids": ["r1"]}]}))
    _, _, drafter, cfg = load_pair(tiny_dirs["qwen3"], registry=reg)
    assert cfg.source == "registry" and cfg.max_draft_tokens == 4 and cfg.evidence["speedup"] == 2.5


def test_a_registry_entry_measured_pipelined_says_so(qwen3, tiny_dirs, heads, greedy_refs, tmp_path):
    reg = tmp_path / "registry.json"
    reg.write_text(json.dumps({"pairs": [{"target": str(tiny_dirs["qwen3"]), "drafter": str(heads["repeat"]), "mode": "dspark-pipe",
                                          "cap": 3, "speedup": 1.1, "trials": 9, "device": "test", "run_ids": ["r1"]}]}))
    target, tok, drafter, cfg = load_pair(tiny_dirs["qwen3"], registry=reg)
    assert cfg.mode == "dspark-pipe" and drafter.kind == "dspark" and cfg.max_draft_tokens == 3
    r = speculative_generate(target, tok, drafter, PROMPTS[0], max_new_tokens=24, max_draft_tokens=cfg.max_draft_tokens, pipeline=True)
    assert r.token_ids == greedy_refs[PROMPTS[0]] and r.mode == "dspark-pipe"


@pytest.mark.parametrize("draft_vocab", [0, 150])
def test_a_greedy_block_without_a_markov_term_takes_one_argmax(qwen3, tmp_path, tiny_dirs, draft_vocab):
    """Without a Markov term no slot depends on the token before it: the greedy drafts are one
    argmax over the block's rows, the tokens slot by slot would give (mapped through d2t too)."""
    import io

    target, tok = qwen3
    layout = "speculators" if draft_vocab else "native"
    drafter = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], layout=layout, markov_rank=0,
                                            draft_vocab=draft_vocab or None), target)
    drafter.reset()
    drafter.append_context(target.forward(mx.array(tok.encode(PROMPTS[0])), target.make_cache(),
                                          taps=drafter.target_layer_ids).taps)
    c = drafter.config
    for cap in (1, 3, c.max_drafts):
        out = drafter.draft(7, cap, SamplingParams())
        logits = drafter.vocab_logits(drafter.hidden(7, c.block_size)[c.logits_start:c.logits_start + cap])
        want = [drafter._to_target_ids(mx.argmax(logits[k], keepdims=True).astype(mx.uint32)).item() for k in range(cap)]
        assert out.tokens.tolist() == want and out.probs is None
    buf = io.StringIO()
    mx.export_to_dot(buf, drafter.draft(7, c.max_drafts, SamplingParams()).tokens)
    assert buf.getvalue().count('label ="ArgReduce"') == 1
