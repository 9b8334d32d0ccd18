"""engine/topk.top_k_indices: the k largest entries of each row through two small partitions
(the chunk maxima, then the k best chunks' entries), checked against a direct partition."""

import mlx.core as mx
import numpy as np
import pytest

from dspark_lab.engine.topk import top_k_indices


def direct(x: mx.array, k: int) -> mx.array:
    return mx.argpartition(x, kth=x.shape[-1] - k, axis=-1)[..., x.shape[-1] - k :]


def as_sets(idx: mx.array) -> list[set[int]]:
    rows = np.array(idx).reshape(-1, idx.shape[-1])
    return [set(r.tolist()) for r in rows]


@pytest.mark.parametrize("vocab", [1000, 1024])  # a last chunk padded, and none
@pytest.mark.parametrize("k", [1, 3, 7, 15])
def test_the_same_set_as_a_direct_partition(vocab, k):
    x = mx.random.normal((4, 6, vocab), key=mx.random.key(vocab + k))  # float32: no ties
    got = top_k_indices(x, k, chunk=16)
    assert got.shape == (4, 6, k)
    assert as_sets(got) == as_sets(direct(x, k))


def test_rows_whose_top_entries_crowd_one_chunk_or_sit_in_the_padded_one():
    vocab, k, chunk = 1000, 5, 16
    x = np.random.default_rng(0).normal(size=(3, vocab)).astype(np.float32)
    x[0, 32:37] = 10 + np.arange(5)  # all five in chunk 2
    x[1, [3, 200, 401, 777, 999]] = 10 + np.arange(5)  # one per chunk, the last in the padded chunk
    x[2, 992:1000] = 10 + np.arange(8)  # the padded chunk holds the top eight
    got = as_sets(top_k_indices(mx.array(x), k, chunk))
    assert got == [set(range(32, 37)), {3, 200, 401, 777, 999}, set(range(995, 1000))]


def test_ties_give_a_valid_top_k_in_bfloat16():
    """bfloat16 logits tie often; any k entries none smaller than the k-th largest value will do."""
    x = (mx.random.normal((8, 4096), key=mx.random.key(1)) * 3).astype(mx.bfloat16)
    k = 32
    got = np.array(top_k_indices(x, k))
    vals = np.array(x.astype(mx.float32))
    kth = np.sort(vals, axis=-1)[:, -k]
    for row, idx, t in zip(vals, got, kth):
        assert len(set(idx.tolist())) == k and (row[idx] >= t).all()


def test_few_chunks_partition_directly_and_bad_k_is_refused():
    x = mx.random.normal((2, 40), key=mx.random.key(2))
    assert as_sets(top_k_indices(x, 9, chunk=16)) == as_sets(direct(x, 9))
    for k in (0, 41):
        with pytest.raises(ValueError, match="between 1 and the vocabulary size"):
            top_k_indices(x, k)
