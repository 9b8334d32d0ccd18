"""At temperature > 0 speculative verification must give an exact sample of the target.

Each test compares observed counts with the distribution they must follow using a chi-square
test at significance ALPHA: a correct implementation fails a given test with probability ALPHA
(seeds are fixed, so a run is reproducible). A wrong acceptance rule (e.g. accepting a draft
whenever it is the argmax, or resampling from p instead of the residual) shifts the counts by
far more than that, and fails at any of these seeds.
"""

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from conftest import ALPHA, REPETITIVE, assert_same_token_distribution
from dspark_lab import InputError, SamplingParams, greedy_generate, lookup_generate
from dspark_lab.engine.sampling import target_probs, verify



def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed counts against expected probabilities, pooling cells with expected
    count < 5 (the chi-square approximation needs that)."""
    probs = np.asarray(probs, dtype=np.float64)
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()
    return stats.chisquare(obs[keep], exp).pvalue


def run_verify(logits, drafts, params, q, n, seed):
    mx.random.seed(seed)
    return np.array([verify(logits, drafts, params, q).tolist() for _ in range(n)])


@pytest.mark.parametrize("use_q", [False, True], ids=["one-hot-draft", "drafter-distribution"])
def test_first_tokens_are_an_exact_sample(use_q):
    vocab, k, n = 6, 3, 6000
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(k + 1, vocab)) * 1.5, dtype=mx.float32)
    params = SamplingParams(temperature=1.0)
    p = np.array(target_probs(logits, params))
    mx.random.seed(1)
    if use_q:
        # The theorem needs drafts sampled from the drafter's own distribution q.
        q_np = rng.dirichlet(np.ones(vocab), size=k).astype(np.float32)
        q = mx.array(q_np)
        d = np.array([[rng.choice(vocab, p=row / row.sum()) for row in q_np] for _ in range(n)])
        res = np.array([verify(logits, mx.array(row, dtype=mx.uint32), params, q).tolist() for row in d])
    else:
        fixed = [int(np.argmax(p[0])), 1, 2]
        d = np.tile(fixed, (n, 1))
        res = run_verify(logits, mx.array(fixed, dtype=mx.uint32), params, None, n, seed=1)
    first = np.where(res[:, 0] >= 1, d[:, 0], res[:, 1])
    assert chi_square_p(np.bincount(first, minlength=vocab), p[0]) > ALPHA
    # Given the first draft was accepted, the second token follows row 1 exactly.
    acc = res[:, 0] >= 1
    second = np.where(res[acc, 0] >= 2, d[acc, 1], res[acc, 1])
    assert chi_square_p(np.bincount(second, minlength=vocab), p[1]) > ALPHA


def test_acceptance_rate_equals_overlap():
    # With one-hot drafts, the first draft is accepted with probability p(draft).
    vocab = 5
    logits = mx.array(np.random.default_rng(2).normal(size=(2, vocab)), dtype=mx.float32)
    params = SamplingParams(temperature=0.7)
    p = np.array(target_probs(logits, params))
    res = run_verify(logits, mx.array([3], dtype=mx.uint32), params, None, 4000, seed=3)
    accepted = int((res[:, 0] == 1).sum())
    assert stats.binomtest(accepted, 4000, p[0, 3]).pvalue > ALPHA


def test_top_k_and_top_p_restrict_the_distribution():
    logits = mx.array([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = np.array(target_probs(logits, SamplingParams(temperature=1.0, top_k=2)))[0]
    assert p[2:].sum() == 0 and p[:2].sum() == pytest.approx(1.0)
    full = np.array(target_probs(logits, SamplingParams(temperature=1.0)))[0]
    p = np.array(target_probs(logits, SamplingParams(temperature=1.0, top_p=0.9)))[0]
    kept = np.flatnonzero(p)
    assert full[kept[:-1]].sum() < 0.9 <= full[kept].sum()  # smallest nucleus holding 0.9
    assert p.sum() == pytest.approx(1.0)


def test_lookup_generation_samples_like_plain_sampling(qwen3):
    """End to end: the third generated token of lookup decoding (which went through verify
    with real drafts) has the same distribution as with plain sampling from the target."""
    target, tok = qwen3
    prompt = REPETITIVE[1]
    params = dict(max_new_tokens=4, temperature=1.0, top_k=3, apply_chat_template=False)
    n = 300
    plain = [greedy_generate(target, tok, prompt, seed=s, **params).token_ids for s in range(n)]
    spec_runs = [lookup_generate(target, tok, prompt, seed=10_000 + s, min_n=1, max_n=2, **params) for s in range(n)]
    assert sum(sum(r.draft_lengths) for r in spec_runs) > n // 2  # drafts were really verified
    spec = [r.token_ids for r in spec_runs]
    assert_same_token_distribution(plain, spec, (1, 2, 3))


def test_seed_makes_sampling_reproducible(qwen3):
    target, tok = qwen3
    a = lookup_generate(target, tok, REPETITIVE[0], max_new_tokens=12, temperature=0.8, seed=7)
    b = lookup_generate(target, tok, REPETITIVE[0], max_new_tokens=12, temperature=0.8, seed=7)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be >= 0"),
])
def test_bad_sampling_parameters(qwen3, kwargs, match):
    target, tok = qwen3
    for fn in (greedy_generate, lookup_generate):
        with pytest.raises(InputError, match=match):
            fn(target, tok, "hi", max_new_tokens=4, **kwargs)
