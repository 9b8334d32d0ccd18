"""The hidden-state tap: logits equal the model's own, taps are the residual stream, and a family
whose forward the tap cannot reproduce is refused by the load-time probe."""

import mlx.core as mx
import numpy as np
import pytest

from conftest import FAMILIES
from dspark_lab import LoadError, load_target
from dspark_lab.engine.target import Target


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_logits_and_taps(tiny_dirs, family):
    target, _ = load_target(tiny_dirs[family], taps=[0, 1])
    assert target.probed
    ids = mx.array([5, 9, 17, 33, 2, 11], dtype=mx.uint32)
    out = target.forward(ids, target.make_cache(), taps=(0, 1))
    ref = target.model(ids[None], cache=target.make_cache())[0]
    assert out.logits.shape == (6, target.vocab_size)
    np.testing.assert_allclose(np.array(out.logits), np.array(ref), atol=1e-4)
    # Layer 0's tap is what layer 1 consumes: re-running layer 1 on it gives layer 1's tap.
    h0 = out.taps[0][None]
    mask = "causal"
    h1 = target.layers[1](h0, mask, None)[0]
    np.testing.assert_allclose(np.array(h1), np.array(out.taps[1]), atol=1e-4)
    assert out.taps[0].shape == (6, target.hidden_size)


def test_incremental_forward_matches_full(qwen3):
    target, _ = qwen3
    ids = mx.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=mx.uint32)
    full = target.forward(ids, target.make_cache(), taps=(1,))
    cache = target.make_cache()
    a = target.forward(ids[:5], cache, taps=(1,))
    b = target.forward(ids[5:], cache, taps=(1,))
    np.testing.assert_allclose(np.array(full.logits[5:]), np.array(b.logits), atol=1e-4)
    np.testing.assert_allclose(np.array(full.taps[1][:5]), np.array(a.taps[1]), atol=1e-4)
    last = target.forward(ids, target.make_cache(), last_only=True)
    np.testing.assert_allclose(np.array(last.logits[0]), np.array(full.logits[-1]), atol=1e-4)


def test_trim_rewinds_the_cache(qwen3):
    target, _ = qwen3
    cache = target.make_cache()
    target.forward(mx.array([1, 2, 3, 4], dtype=mx.uint32), cache)
    before = target.forward(mx.array([7], dtype=mx.uint32), cache).logits
    target.trim(cache, 1)
    target.forward(mx.array([8, 9], dtype=mx.uint32), cache)  # a "rejected draft"
    target.trim(cache, 2)
    assert Target.cache_len(cache) == 4
    again = target.forward(mx.array([7], dtype=mx.uint32), cache).logits
    np.testing.assert_allclose(np.array(before), np.array(again), atol=1e-5)


def test_prefill_in_chunks_matches_one_pass(qwen3, monkeypatch):
    import dspark_lab.engine.target as tmod

    target, _ = qwen3
    ids = mx.array(list(range(1, 40)), dtype=mx.uint32)
    one = target.forward(ids, target.make_cache(), taps=(0,))
    monkeypatch.setattr(tmod, "PREFILL_CHUNK", 16)
    chunked = target.forward(ids, target.make_cache(), taps=(0,))
    np.testing.assert_allclose(np.array(one.logits), np.array(chunked.logits), atol=1e-4)
    np.testing.assert_allclose(np.array(one.taps[0]), np.array(chunked.taps[0]), atol=1e-4)


def test_probe_refuses_a_tap_that_does_not_reproduce_the_model(tiny_dirs):
    target, _ = load_target(tiny_dirs["qwen2"])
    original = target._head
    target._head = lambda h: original(h) * 1.5  # a head that is not the model's
    with pytest.raises(LoadError, match="does not reproduce model_type 'qwen2'"):
        target.probe()


def test_tap_out_of_range(tiny_dirs):
    with pytest.raises(LoadError, match=r"tap layers \[5\] are out of range"):
        load_target(tiny_dirs["llama"], taps=[0, 5])


@pytest.mark.parametrize("family", FAMILIES)
def test_launching_layers_early_changes_no_bit(tiny_dirs, family):
    """Target.launch_every hands the device finished layers while the host builds the rest; the
    same operations run, so logits, taps and whole speculative outputs are bit-identical."""
    from conftest import PROMPTS
    from dspark_lab import lookup_generate

    target, tok = load_target(tiny_dirs[family])
    ids = mx.array(tok.encode("def fibonacci(n): return n if n < 2 else"), dtype=mx.uint32)
    runs = {}
    for n in (0, 1, 3):
        target.launch_every = n
        out = target.forward(ids, target.make_cache(), taps=(0, target.num_layers - 1))
        spec = [lookup_generate(target, tok, p, max_new_tokens=24, max_draft_tokens=4).token_ids for p in PROMPTS[:4]]
        runs[n] = (np.array(out.logits), {t: np.array(v) for t, v in out.taps.items()}, spec)
    target.launch_every = 0
    for n in (1, 3):
        assert np.array_equal(runs[n][0], runs[0][0])
        assert all(np.array_equal(runs[n][1][t], runs[0][1][t]) for t in runs[0][1])
        assert runs[n][2] == runs[0][2]
    with pytest.raises(ValueError, match="launch_every"):
        target.launch_every = -1
