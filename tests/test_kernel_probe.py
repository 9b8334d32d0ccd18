"""Custom kernels (engine/kernels.py) and their probe (lab/kernel_probe.py): off CUDA the
n-gram kernel is reported unavailable and refused with the reason; a stand-in that gives the
MLX operations' proposals passes the exactness check, one that differs or fails is kept out,
and verdicts are stored per machine and reused. Which kernel wins a timing is the machine's
business: the tests check the rule, never a time."""

import mlx.core as mx
import pytest

from dspark_lab import InputError, greedy_generate
from dspark_lab.db import open_db
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.pipeline import DeviceLookup
from dspark_lab.engine.speculative import speculative_generate
from dspark_lab.lab import kernel_probe
from dspark_lab.lab.kernel_probe import choose_lookup_kernel, measure_lookup_kernel

from conftest import REPETITIVE


def reference(tokens, at, k):
    """The contract a kernel meets, computed by the MLX operations themselves."""
    lookup = DeviceLookup([], kernel_probe.LOOKUP_NS)
    lookup.tokens = tokens
    return lookup.propose_ops(at, k)


def test_off_cuda_the_kernel_is_unavailable_and_refused():
    v = measure_lookup_kernel()
    assert not v.use and "not available" in v.reason and "CUDA" in v.reason
    assert not v.available and not v.exact and v.checked == 0
    assert "off" in v.describe()


def test_an_exact_stand_in_passes_and_is_used_only_when_faster():
    v = measure_lookup_kernel(reference, repeats=5)
    assert v.reason.startswith("exact on") and v.checked > 500
    assert v.available and v.exact
    assert v.reference_ms > 0 and v.kernel_ms > 0
    assert v.use == (v.kernel_ms <= (1 - kernel_probe.MARGIN) * v.reference_ms)


def test_a_kernel_that_differs_or_fails_is_kept_out():
    def off_by_one(tokens, at, k):
        out, usable = reference(tokens, at, k)
        return out + usable.astype(mx.uint32), usable

    def broken(tokens, at, k):
        raise RuntimeError("nvrtc: error")

    v = measure_lookup_kernel(off_by_one)
    assert not v.use and v.reason.startswith("not exact") and "position" in v.reason
    assert v.available and not v.exact
    v = measure_lookup_kernel(broken)
    assert not v.use and "failed to run" in v.reason and "nvrtc" in v.reason


def test_verdicts_are_stored_and_reused(tmp_path, monkeypatch):
    from dspark_lab.engine import kernels

    db = open_db(tmp_path / "k.duckdb")
    try:
        first = choose_lookup_kernel(db=db, candidate=reference)
        again = choose_lookup_kernel(db=db, candidate=reference)
        assert not first.reused and again.reused and again.to_dict() == first.to_dict()
        assert not choose_lookup_kernel(db=db, candidate=reference, reprobe=True).reused
        assert not choose_lookup_kernel(db=db).reused  # "not available" is not stored: it costs nothing
        monkeypatch.setattr(kernels, "SOURCE_DIGEST", "an-older-one")  # a verdict measured on other sources is measured again
        assert not choose_lookup_kernel(db=db, candidate=reference).reused
    finally:
        db.dispose()


def test_the_pipelined_loop_runs_a_kernel_it_is_handed(qwen3, heads):
    """DeviceLookup(kernel=...) proposes through the kernel; greedy ids stay greedy's."""
    from dspark_lab.engine.pipeline import pipelined_loop
    from dspark_lab.engine.sampling import SamplingParams
    from dspark_lab.engine.text import TextStream, encode_prompt

    target, tok = qwen3
    drafter = load_dspark(heads["qwen3"], target)
    calls = []

    def counting(tokens, at, k):
        calls.append(k)
        return reference(tokens, at, k)

    ids = encode_prompt(tok, REPETITIVE[0])
    r = pipelined_loop(target, ids, SamplingParams(), drafter, max_new_tokens=24, cap=3, stream=TextStream(tok, None, None),
                       mode="dspark-pipe", lookup_n=kernel_probe.LOOKUP_NS, lookup_kernel=counting)
    assert calls and set(calls) == {3}
    assert r.token_ids == greedy_generate(target, tok, REPETITIVE[0], max_new_tokens=24).token_ids


def test_lookup_kernel_refusals_say_what_to_change(qwen3, heads):
    target, tok = qwen3
    drafter = load_dspark(heads["qwen3"], target)
    with pytest.raises(InputError, match="cannot run here: no CUDA backend"):
        speculative_generate(target, tok, drafter, "hi", pipeline=True, lookup_drafts=True, lookup_kernel=True)
    with pytest.raises(InputError, match="lookup_drafts=True"):
        speculative_generate(target, tok, drafter, "hi", pipeline=True, lookup_kernel=True)
    with pytest.raises(InputError, match="pipeline=True"):
        speculative_generate(target, tok, drafter, "hi", lookup_kernel=True)


def called_from_the_loop() -> bool:
    import inspect

    return any(f.function == "pipelined_loop" for f in inspect.stack(0))


def test_in_the_loop_the_loop_time_decides(qwen3, heads):
    """With a pair, the probe also times the pipelined loop through the candidate and through the
    operations; the loop's time, not the match's, decides, and both loops must give the same
    tokens. A candidate that is exact alone but slow in the loop (here: it waits) is kept out."""
    import time

    target, tok = qwen3
    drafter = load_dspark(heads["qwen3"], target)
    v = measure_lookup_kernel(reference, repeats=5, loop=(target, drafter, tok), loop_tokens=16, loop_passes=1)
    assert v.exact and v.loop_reference_ms > 0 and v.loop_kernel_ms > 0
    assert v.use == (v.loop_kernel_ms <= (1 - kernel_probe.MARGIN) * v.loop_reference_ms)
    assert "the loop" in v.reason and "the loop" in v.describe()

    in_loop = []

    def slow_in_the_loop(tokens, at, k):  # as fast as the operations alone, 20 ms a call in a generation
        if called_from_the_loop():
            in_loop.append(k)
            time.sleep(0.02)
        return reference(tokens, at, k)

    v = measure_lookup_kernel(slow_in_the_loop, repeats=5, loop=(target, drafter, tok), loop_tokens=16, loop_passes=1)
    assert in_loop and v.exact and not v.use and v.reason.endswith("the loop not faster")
    assert v.loop_kernel_ms > v.loop_reference_ms


def test_a_kernel_that_fails_in_the_loop_is_kept_out(qwen3, heads):
    target, tok = qwen3
    drafter = load_dspark(heads["qwen3"], target)

    def fails_in_the_loop(tokens, at, k):
        if called_from_the_loop():
            raise RuntimeError("launch failed")
        return reference(tokens, at, k)

    v = measure_lookup_kernel(fails_in_the_loop, repeats=5, loop=(target, drafter, tok), loop_tokens=16, loop_passes=1)
    assert not v.use and "failed in the loop" in v.reason and "launch failed" in v.reason


def test_loop_verdicts_are_kept_apart_from_match_verdicts(tmp_path, qwen3, heads):
    target, tok = qwen3
    drafter = load_dspark(heads["qwen3"], target)
    db = open_db(tmp_path / "k.duckdb")
    try:
        match = choose_lookup_kernel(db=db, candidate=reference)
        pair = dict(candidate=reference, loop=(target, drafter, tok), model_id="tiny-qwen3|head")
        first = choose_lookup_kernel(db=db, **pair)
        assert not first.reused and first.loop_kernel_ms is not None and match.loop_kernel_ms is None
        again = choose_lookup_kernel(db=db, **pair)
        assert again.reused and again.to_dict() == first.to_dict()
        assert not choose_lookup_kernel(db=db, **{**pair, "model_id": "other|head"}).reused
    finally:
        db.dispose()
