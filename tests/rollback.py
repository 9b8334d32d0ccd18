"""Checks shared by the per-family tests of targets that roll back after a rejected round
(test_hybrid for mlx-lm families, test_vlm for mlx-vlm ones, test_draft_model)."""

import mlx.core as mx
import numpy as np

from conftest import PROMPTS
from dspark_lab import greedy_generate, lookup_generate


def rejected_rounds(r) -> int:
    """Rounds of a GenResult that drafted something and did not accept all of it."""
    return sum(1 for a, d in zip(r.accept_lengths, r.draft_lengths) if d and a - 1 < d)


def assert_lookup_lossless_at_every_cap(name, target, tok) -> None:
    """Lookup over 20 prompts at caps 1..7 gives the greedy ids, and the rollback path really ran."""
    rejected = 0
    for p in PROMPTS[:20]:
        ref = greedy_generate(target, tok, p, max_new_tokens=16).token_ids
        for cap in range(1, 8):
            # min_n=1 drafts on any repeated token: most rounds reject at some (often every) position.
            r = lookup_generate(target, tok, p, max_new_tokens=16, max_draft_tokens=cap, min_n=1, max_n=2)
            assert r.token_ids == ref, (name, cap, p)
            rejected += rejected_rounds(r)
    assert rejected > 20


def assert_rollback_equals_plain_decoding(target, flat_state) -> None:
    """A verify round of 6 rows that accepts 2 drafts and rolls back leaves the state of plain
    decoding of the same tokens (`flat_state(cache)`: the arrays to compare), and the next ten
    steps give equal logits (which also covers what flat_state leaves out, and a window's wrap)."""
    prompt = mx.array([(13 * i + 5) % target.vocab_size for i in range(12)], dtype=mx.uint32)
    kept = [7, 11, 3]  # pending + 2 accepted drafts
    # Plain decoding of the same tokens, one at a time.
    plain = target.make_cache()
    target.forward(prompt, plain)
    for t in kept:
        target.forward(mx.array([t], dtype=mx.uint32), plain)
    spec = target.make_cache()
    target.forward(prompt, spec)
    fed = mx.array(kept + [19, 23, 29], dtype=mx.uint32)
    snap = target.checkpoint(spec)
    assert snap is not None  # this family needs more than a trim
    target.forward(fed, spec)
    target.rewind(spec, snap, fed, len(kept))
    a, b = flat_state(plain), flat_state(spec)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-4)
    for t in range(31, 41):
        nxt = mx.array([t], dtype=mx.uint32)
        np.testing.assert_allclose(np.array(target.forward(nxt, plain).logits), np.array(target.forward(nxt, spec).logits), atol=1e-4)
