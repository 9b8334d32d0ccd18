"""The cap controller on fake cost curves: cheap verify -> larger caps, expensive verify ->
smaller ones, very low acceptance -> parking at plain decoding, hysteresis, probing."""

import pytest

from dspark_lab.lab.controller import CapController, expected_tokens, rate, static_cap, survival
from dspark_lab.lab.curves import CostCurves, Point, fit_verify


def curves(verify_ms, drafter_ms=0.5, overhead_ms=0.2, slope=0.0):
    """CostCurves from a function of width and a per-draft-token drafter cost."""
    return CostCurves(
        verify={w: Point(verify_ms(w), 0.0, 5) for w in range(1, 10)},
        drafter={c: Point(drafter_ms * c, 0.0, 5) for c in range(1, 9)},
        overhead=Point(overhead_ms, 0.0, 5), depth_slope_ms=slope, short_ctx=128, long_ctx=1024,
    )


FLAT = curves(lambda w: 10.0)  # launch-bound GPU: verifying 9 rows costs what 1 does
STEEP = curves(lambda w: 10.0 * w)  # compute-bound: every row costs a full step


def test_expected_tokens():
    assert expected_tokens(0, 0.5) == 1.0
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert survival([0.9, 0.5], 3) == pytest.approx([0.9, 0.45, 0.225])  # short profile repeats its last value


def test_cheap_verify_gives_larger_caps_than_expensive():
    assert static_cap(FLAT, 0.8, max_cap=8) >= 6
    assert static_cap(STEEP, 0.8, max_cap=8) <= 1
    knee = curves(lambda w: 10.0 if w <= 4 else 10.0 + 6.0 * (w - 4))
    assert 2 <= static_cap(knee, 0.8, max_cap=8) <= 4


def test_low_acceptance_parks_at_plain_decoding():
    assert static_cap(curves(lambda w: 10.0 + 1.0 * w, drafter_ms=1.0), 0.02, max_cap=8) == 0
    assert rate(FLAT, 0, 0.5) == pytest.approx(1 / 10.0)


def test_timed_rounds_decide_over_the_parts_sum():
    """Where a cap's whole rounds were timed (the pipelined loop's calibration), the cap is chosen
    from them (and plain decoding from its timed tokens, cap 0): here the parts say cap 2 costs
    30.5 ms (plain 10), the loop's rounds 11, so it pays. Curves stored before rounds were timed
    load without them and still sum their parts."""
    parts = curves(lambda w: 10.0 * w, drafter_ms=0.25, overhead_ms=0.0)
    assert static_cap(parts, 0.8, max_cap=2) == 0
    timed = CostCurves(verify=parts.verify, drafter=parts.drafter, overhead=parts.overhead, depth_slope_ms=0.01, short_ctx=128,
                       long_ctx=1024, rounds={0: Point(10.8, 0.0, 5), 1: Point(10.5, 0.0, 24), 2: Point(11.0, 0.0, 36)})
    assert timed.round_ms(2) == 11.0 and timed.round_ms(2, depth=228) == pytest.approx(12.0)
    assert timed.plain_ms() == 10.8 and parts.plain_ms() == pytest.approx(10.0)  # cap 0: plain decoding as timed, else verify(1)
    assert static_cap(timed, 0.8, max_cap=2) == 2
    assert CostCurves.from_dict(timed.to_dict()).rounds == timed.rounds
    old = parts.to_dict()
    del old["rounds"]
    assert CostCurves.from_dict(old).round_ms(2) == parts.round_ms(2) == pytest.approx(30.5)


def test_fit_finds_the_knee_and_reports_error():
    fit = fit_verify({w: Point(10.0 if w <= 4 else 10.0 + 5 * (w - 4), 0, 5) for w in range(1, 10)})
    assert fit.knee == 4 and fit.max_rel_error < 1e-6
    assert fit(8) == pytest.approx(30.0)


def feed(ctrl, rounds, accept_rate, round_ms=None):
    """Simulate rounds where each draft position is accepted with the given conditional rate
    (deterministically: the expected number, rounded)."""
    for _ in range(rounds):
        cap = ctrl.cap()
        accepted = 0
        p = 1.0
        for _ in range(cap):
            p *= accept_rate
            if p >= 0.5:
                accepted += 1
        ms = round_ms(cap) if round_ms else ctrl.curves.round_ms(cap) if cap else ctrl.curves.plain_ms()
        ctrl.observe(cap, accepted + 1, ms / 1000.0)


def test_live_controller_follows_acceptance_down_to_parking_and_probes_again():
    ctrl = CapController(curves(lambda w: 10.0 + 0.5 * w, drafter_ms=1.5), max_cap=8, prior=0.8, probe_after=20)
    start = ctrl.cap()
    assert start >= 3
    feed(ctrl, 40, accept_rate=0.05)  # the text stopped being predictable
    first_park = ctrl.history.index(0)
    assert ctrl.history[first_park : first_park + 20] == [0] * 20  # parked at plain decoding
    assert ctrl.history[first_park + 20] == ctrl.probe_cap  # then probed
    feed(ctrl, 30, accept_rate=0.05)
    assert ctrl.history[-5:] == [0] * 5  # the probe found nothing: parked again
    feed(ctrl, 80, accept_rate=0.95)  # predictable again: the probe finds it and caps go up
    assert ctrl.cap() >= 3


def test_hysteresis_keeps_the_cap_when_gains_are_small():
    # Two caps predicted within 5% of each other: a small swing in acceptance must not flip.
    ctrl = CapController(FLAT, max_cap=8, prior=0.6, hysteresis=0.05)
    first = ctrl.cap()
    changes = 0
    last = first
    for i in range(40):
        feed(ctrl, 1, accept_rate=0.6 + (0.02 if i % 2 else -0.02))
        changes += ctrl.cap() != last
        last = ctrl.cap()
    assert changes <= 1


def test_observed_round_times_override_the_model():
    # Curves say verify is flat; the machine says cap 6+ rounds are slow: the controller learns it.
    ctrl = CapController(FLAT, max_cap=8, prior=0.7, every=2)
    slow = lambda cap: 10.0 + (60.0 if cap >= 4 else 1.0 * cap)  # noqa: E731
    for cap in range(1, 9):  # observe every cap a few times
        for _ in range(3):
            ctrl._probing = 0
            ctrl._current = cap
            ctrl.observe(cap, 2, slow(cap) / 1000.0)
    ctrl._evaluate(force=True)
    assert ctrl.cap() < 4
