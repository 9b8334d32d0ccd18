"""Draft-model mode: a small LM with the target's tokenizer drafts, the target verifies.

Greedy output is token-identical to plain decoding with a random drafter (rejects almost
everywhere), a noisy copy of the target (partial accepts) and the target itself (accepts
everything), on plain and hybrid/recurrent families; at temperature > 0 the output is an exact
sample of the target; a drafter with another tokenizer is refused; sweeps and the CLI run it."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import PROMPTS, REPETITIVE, assert_same_token_distribution
from dspark_lab import InputError, LoadError, draft_model_generate, greedy_generate, load_draft_pair, load_target
from dspark_lab.cli import app
from dspark_lab.engine.speculative import check_same_tokenizer
from dspark_lab.tiny import build_tiny_model
from rollback import rejected_rounds

runner = CliRunner()


def noisy_copy(src, dst, scale: float, seed: int = 0):
    """A drafter that is the model at `src` with Gaussian noise (`scale` x each matrix's std)
    on every weight matrix: same tokenizer, agrees with the target often but not always."""
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    key = mx.random.key(seed)
    for name, w in weights.items():
        if w.ndim == 2:
            key, sub = mx.random.split(key)
            weights[name] = w + scale * w.std() * mx.random.normal(w.shape, key=sub).astype(w.dtype)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


@pytest.fixture(scope="module")
def draft_dirs(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = tiny_dirs["qwen3"]
    return {
        # Smaller and unrelated to the target: its drafts are mostly rejected.
        "random": build_tiny_model(root / "random", "qwen3", num_layers=1, seed=11, tokenizer_from=target, hidden_size=32,
                                   intermediate_size=64, num_attention_heads=2, num_key_value_heads=1),
        "noisy": noisy_copy(target, root / "noisy", 0.5),
    }


@pytest.fixture(scope="module")
def drafters(qwen3, draft_dirs):
    out = {name: load_target(path)[0] for name, path in draft_dirs.items()}
    out["self"] = qwen3[0]  # the target drafting for itself: every draft is accepted
    return out


@pytest.fixture(scope="module")
def greedy16(qwen3):
    target, tok = qwen3
    return {p: greedy_generate(target, tok, p, max_new_tokens=16).token_ids for p in PROMPTS[:20]}


@pytest.mark.parametrize("name", ["random", "noisy", "self"])
def test_greedy_is_lossless_at_every_cap(qwen3, drafters, greedy16, name):
    target, tok = qwen3
    rejected = partial = 0
    for p, ref in greedy16.items():
        for cap in range(1, 8):
            r = draft_model_generate(target, tok, drafters[name], p, max_new_tokens=16, max_draft_tokens=cap)
            assert r.token_ids == ref, (name, cap, p)
            assert r.mode == "draft" and max(r.draft_lengths) <= cap
            assert r.host_reads == r.num_rounds + 1  # drafting costs no host read of its own
            if name == "self":  # drafts are the target's own greedy tokens: all accepted
                assert all(a == d + 1 for a, d in zip(r.accept_lengths, r.draft_lengths)), (cap, p)
                assert all(d == cap for d in r.draft_lengths[:-1])  # only the last round is cut by the length
            rejected += rejected_rounds(r)
            partial += sum(1 for a, d in zip(r.accept_lengths, r.draft_lengths) if 1 < a < d + 1)
    if name != "self":
        assert rejected > 50  # the drafter rollback really ran
    if name == "noisy":
        assert partial > 10  # ... also keeping some drafted rows


@pytest.mark.parametrize("name", ["random", "noisy", "self"])
def test_pipelined_greedy_is_lossless_at_every_cap(qwen3, drafters, greedy16, name):
    """draft-pipe: the draft model's cache is written at the round's array offset and never
    rolled back; a wrong row (a rejected draft's, or the accepted draft it never fed) would show
    as a lost accept for the target drafting for itself, and a wrong target row as other tokens."""
    target, tok = qwen3
    rejected = 0
    for p, ref in greedy16.items():
        for cap in (1, 2, 3, 5, 7):
            r = draft_model_generate(target, tok, drafters[name], p, max_new_tokens=16, max_draft_tokens=cap, pipeline=True)
            assert r.token_ids == ref, (name, cap, p)
            assert r.mode == "draft-pipe" and max(r.draft_lengths) <= cap
            if name == "self":
                assert all(a == d + 1 for a, d in zip(r.accept_lengths[:-1], r.draft_lengths)), (cap, p)
            rejected += rejected_rounds(r)
    if name != "self":
        assert rejected > 30  # the stale rows past the offset really were there to hide


class CapSequence:
    """A controller that asks for the given caps in turn, zeros included (a round of no drafts,
    after which the draft model must still see the token that round committed)."""

    def __init__(self, caps):
        self.caps, self.i = caps, 0

    def cap(self):
        self.i += 1
        return self.caps[(self.i - 1) % len(self.caps)]

    def observe(self, drafted, committed, seconds):
        pass


def test_pipelined_rounds_of_no_drafts_keep_the_draft_model_current(qwen3, greedy16):
    target, tok = qwen3
    for p, ref in list(greedy16.items())[:6]:
        r = draft_model_generate(target, tok, target, p, max_new_tokens=16, max_draft_tokens=4, pipeline=True,
                                 cap_controller=CapSequence([0, 0, 3, 0, 4, 1]))
        assert r.token_ids == ref and 0 in r.draft_lengths
        # The target drafting for itself after two rounds of cap 0: every draft still accepted.
        assert all(a == d + 1 for a, d in zip(r.accept_lengths[:-1], r.draft_lengths)), (p, r.accept_lengths, r.draft_lengths)


def test_pipelined_draft_mode_refuses_a_model_it_cannot_rewind(qwen3, tmp_path):
    target, tok = qwen3
    hybrid, _ = load_target(build_tiny_model(tmp_path / "h", "lfm2", num_layers=2))
    with pytest.raises(InputError, match="pipeline needs plain KV caches"):
        draft_model_generate(target, tok, hybrid, "hi", max_new_tokens=4, pipeline=True)


def test_noisy_drafter_is_accepted_often(qwen3, drafters):
    target, tok = qwen3
    results = [draft_model_generate(target, tok, drafters["noisy"], p, max_new_tokens=32, max_draft_tokens=4) for p in REPETITIVE]
    mean = sum(sum(r.accept_lengths) for r in results) / sum(len(r.accept_lengths) for r in results)
    assert mean > 1.5, mean
    assert sum(r.target_forwards for r in results) < sum(r.num_tokens for r in results)


def test_cap_controller_and_stop_strings(qwen3, drafters, greedy16):
    from dspark_lab.lab.calibrate import FixedCap

    target, tok = qwen3
    p = PROMPTS[0]
    ctrl = FixedCap(3)
    r = draft_model_generate(target, tok, drafters["noisy"], p, max_new_tokens=16, max_draft_tokens=5, cap_controller=ctrl)
    assert r.token_ids == greedy16[p] and [k for k, _, _ in ctrl.rounds][:-1] == [3] * (len(ctrl.rounds) - 1)
    full = greedy_generate(target, tok, p, max_new_tokens=16)
    stop = full.text[3:6]
    chunks = []
    r = draft_model_generate(target, tok, drafters["noisy"], p, max_new_tokens=16, stop=[stop], on_text=chunks.append)
    assert r.finish_reason == "stop" and r.text == full.text[: full.text.index(stop)] == "".join(chunks)


def test_bad_max_draft_tokens(qwen3, drafters):
    target, tok = qwen3
    with pytest.raises(InputError, match="max_draft_tokens must be >= 1"):
        draft_model_generate(target, tok, drafters["random"], "hi", max_draft_tokens=0)


# --- hybrid / recurrent families ---------------------------------------------------------------

# family -> (layers, drafter noise): noise that leaves a mix of full, partial and no accepts.
HYBRIDS = {"qwen3_next": (4, 0.1), "lfm2": (2, 0.3)}


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_hybrid_target_and_drafter_roll_back_exactly(family, tmp_path):
    """Target and drafter both of a family whose caches cannot trim: both restore their state
    and replay the kept rows after a rejection."""
    layers, noise = HYBRIDS[family]
    path = build_tiny_model(tmp_path / "t", family, num_layers=layers)
    target, tok = load_target(path)
    drafter, _ = load_target(noisy_copy(path, tmp_path / "d", noise))
    assert target.checkpoint(target.make_cache()) is not None  # really not trim-only
    rejected = partial = 0
    for p in PROMPTS[:8]:
        ref = greedy_generate(target, tok, p, max_new_tokens=12).token_ids
        for cap in range(1, 8):
            r = draft_model_generate(target, tok, drafter, p, max_new_tokens=12, max_draft_tokens=cap)
            assert r.token_ids == ref, (family, cap, p)
            rejected += rejected_rounds(r)
            partial += sum(1 for a, d in zip(r.accept_lengths, r.draft_lengths) if 1 < a < d + 1)
    assert rejected > 10 and partial > 2, (rejected, partial)


# --- temperature > 0 ---------------------------------------------------------------------------

def test_sampling_with_a_draft_model_is_exact(qwen3, drafters):
    """Tokens 2-4 sampled through draft-model rounds (drafts sampled from the drafter, its
    distribution handed to verify) follow the same distribution as plain sampling from the
    target (chi-square homogeneity at ALPHA), with top_k and top_p applied to both."""
    target, tok = qwen3
    prompt, n = REPETITIVE[1], 300
    params = dict(max_new_tokens=4, temperature=1.0, top_k=4, top_p=0.95, apply_chat_template=False)
    plain = [greedy_generate(target, tok, prompt, seed=s, **params).token_ids for s in range(n)]
    runs = [draft_model_generate(target, tok, drafters["noisy"], prompt, seed=7000 + s, max_draft_tokens=3, **params) for s in range(n)]
    accepted = sum(sum(a - 1 for a in r.accept_lengths) for r in runs)
    rejected = sum(rejected_rounds(r) for r in runs)
    assert accepted > n // 2 and rejected > n // 10  # both branches of the sampling rule ran
    spec = [r.token_ids for r in runs]
    assert_same_token_distribution(plain, spec, (1, 2, 3))


def test_pipelined_sampling_with_a_draft_model_is_exact(qwen3, drafters):
    """The same check through the pipelined loop: drafts sampled lazily on the device, their
    distributions handed to verify without a host read."""
    target, tok = qwen3
    prompt, n = REPETITIVE[1], 300
    params = dict(max_new_tokens=4, temperature=1.0, top_k=4, top_p=0.95, apply_chat_template=False)
    plain = [greedy_generate(target, tok, prompt, seed=s, **params).token_ids for s in range(n)]
    runs = [draft_model_generate(target, tok, drafters["noisy"], prompt, seed=9000 + s, max_draft_tokens=3, pipeline=True, **params)
            for s in range(n)]
    accepted = sum(sum(a - 1 for a in r.accept_lengths) for r in runs)
    rejected = sum(rejected_rounds(r) for r in runs)
    assert accepted > n // 2 and rejected > n // 10
    assert_same_token_distribution(plain, [r.token_ids for r in runs], (1, 2, 3))


def test_drafter_distribution_is_the_processed_one(qwen3, drafters):
    """Draft.probs rows are distributions over the target's vocabulary, restricted by top_k."""
    from dspark_lab.engine.drafters.draft_model import DraftModelSource
    from dspark_lab.engine.sampling import SamplingParams

    target, tok = qwen3
    source = DraftModelSource(drafters["noisy"], target.vocab_size)
    source.start(tok.encode("def fibonacci(n):"), {})
    source.commit([5], {})
    d = source.propose(5, 3, SamplingParams(temperature=0.8, top_k=2))
    probs = np.array(d.probs)
    assert probs.shape == (3, target.vocab_size)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    assert ((probs > 0).sum(axis=1) <= 2).all()
    tokens = np.array(d.tokens)
    assert (probs[np.arange(3), tokens] > 0).all()  # each draft was sampled from its own row


# --- loading -------------------------------------------------------------------------------------

def test_load_draft_pair(tiny_dirs, draft_dirs):
    target, tok, drafter, pair = load_draft_pair(tiny_dirs["qwen3"], draft_dirs["random"])
    assert pair.mode == "draft" and pair.max_draft_tokens == 4 and pair.drafter == str(draft_dirs["random"])
    assert drafter.hidden_size == 32 and target.hidden_size == 64  # a different, smaller model is fine


def test_a_drafter_with_another_tokenizer_is_refused(tiny_dirs, tmp_path):
    other = build_tiny_model(tmp_path / "other", "qwen3", num_layers=1, tokenizer_vocab=320)
    with pytest.raises(LoadError, match=r"tokenizer of \d+ tokens but .* has 384: the drafter must use the target's tokenizer"):
        load_draft_pair(tiny_dirs["qwen3"], other)


def test_a_tokenizer_of_the_same_size_that_encodes_differently_is_refused(qwen3):
    target, tok = qwen3

    class Shifted:  # same size, other ids: what two unrelated vocabularies of one size look like
        _tokenizer = tok._tokenizer

        def encode(self, text):
            return [(t + 1) % 384 for t in tok.encode(text)]

    with pytest.raises(LoadError, match="tokenizes .* differently .* Pick a draft model from the target's family"):
        check_same_tokenizer(tok, Shifted(), target)
    check_same_tokenizer(tok, tok, target)  # its own tokenizer passes


# --- lab and CLI ---------------------------------------------------------------------------------

def test_sweep_runs_draft_mode(tiny_dirs, draft_dirs, tmp_path):
    import duckdb

    from dspark_lab.lab.sweep import SweepConfig, run_sweep

    db = tmp_path / "r.duckdb"
    cfg = SweepConfig(models=[str(tiny_dirs["qwen3"])], draft_models=[str(draft_dirs["noisy"])], modes=["baseline", "draft"],
                      caps=["3", "auto"], prompt_sets=["code"], trials=1, max_new_tokens=10, prompt_limit=2)
    run_sweep(cfg, db, progress=False)
    con = duckdb.connect(str(db), read_only=True)
    try:
        # arms: baseline + draft x 2 caps; cells: 2 prompts x 1 trial
        assert con.sql("select count(*) from trials").fetchall()[0][0] == 6
        assert con.sql("select count(*) from trials where mode = 'draft' and lossless and drafter_id is not null").fetchall()[0][0] == 4
        assert con.sql("select count(*) from trials where cap = 'auto' and caps_chosen is null").fetchall()[0][0] == 0
        assert con.sql("select count(*) from calibration where mode = 'draft'").fetchall()[0][0] == 1
    finally:
        con.close()


def test_sweep_runs_draft_pipe_mode_beside_draft_mode(tiny_dirs, draft_dirs, tmp_path):
    import duckdb

    from dspark_lab.lab.sweep import SweepConfig, run_sweep

    db = tmp_path / "r.duckdb"
    cfg = SweepConfig(models=[str(tiny_dirs["qwen3"])], draft_models=[str(draft_dirs["noisy"])], modes=["baseline", "draft", "draft-pipe"],
                      caps=["3", "auto"], prompt_sets=["code"], trials=1, max_new_tokens=10, prompt_limit=2)
    run_sweep(cfg, db, progress=False)
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.sql("select mode, cap, lossless, drafter_id from trials where mode like 'draft%' order by mode, cap").fetchall()
        assert [(m, c) for m, c, _, _ in rows] == [("draft", "3"), ("draft", "3"), ("draft", "auto"), ("draft", "auto"),
                                                   ("draft-pipe", "3"), ("draft-pipe", "3"), ("draft-pipe", "auto"), ("draft-pipe", "auto")]
        assert all(lossless and d == str(draft_dirs["noisy"]) for _, _, lossless, d in rows)
        # Both modes start from the draft model's one set of curves (the pipelined one then learns its own round times).
        assert con.sql("select count(*) from calibration where mode = 'draft'").fetchall()[0][0] == 1
    finally:
        con.close()


def test_sweep_skips_draft_pipe_for_a_draft_model_it_cannot_rewind(tiny_dirs, tmp_path):
    from dspark_lab.lab.sweep import SweepConfig, run_sweep

    hybrid = build_tiny_model(tmp_path / "h", "lfm2", num_layers=2, tokenizer_from=tiny_dirs["qwen3"])
    said = []
    cfg = SweepConfig(models=[str(tiny_dirs["qwen3"])], draft_models=[str(hybrid)], modes=["baseline", "draft-pipe"],
                      caps=["2"], prompt_sets=["code"], trials=1, max_new_tokens=6, prompt_limit=1, warmup=False)
    run_sweep(cfg, tmp_path / "r.duckdb", progress=False, on_event=said.append)
    assert any("skipping mode draft-pipe" in m and "plain KV caches" in m for m in said), said


def test_sweep_draft_mode_needs_a_draft_model(tiny_dirs):
    from dspark_lab.lab.sweep import SweepConfig

    with pytest.raises(InputError, match="mode draft needs at least one --draft-model"):
        SweepConfig(models=[str(tiny_dirs["qwen3"])], modes=["baseline", "draft"])
    # Grids without draft models keep the key they had before draft mode existed (resume finds them).
    from labdb import legacy_grid_key

    cfg = SweepConfig(models=["m"], modes=["baseline", "lookup"])
    assert cfg.key() == legacy_grid_key(cfg)
    assert SweepConfig(models=["m"], modes=["baseline", "lookup"], draft_models=["d"]).key() != cfg.key()


def test_cli_generate_draft_mode(tiny_dirs, draft_dirs):
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "--mode", "draft", "--draft-model", str(draft_dirs["noisy"]),
                            "-p", "a b c a b c a b c", "-n", "12", "--max-draft", "3"])
    assert r.exit_code == 0, r.output
    assert "12 tokens (length)" in r.output and "mean accept length" in r.output


def test_cli_generate_draft_pipe_mode(tiny_dirs, draft_dirs):
    common = ["generate", "-m", str(tiny_dirs["qwen3"]), "-p", "a b c a b c a b c", "-n", "12", "--no-chat-template"]
    plain = runner.invoke(app, common)
    piped = runner.invoke(app, [*common, "--mode", "draft-pipe", "--draft-model", str(draft_dirs["noisy"]), "--max-draft", "3"])
    assert plain.exit_code == 0 and piped.exit_code == 0, piped.output
    assert "12 tokens (length)" in piped.output and "mean accept length" in piped.output
    assert piped.stdout == plain.stdout  # the same text as plain decoding


def test_cli_draft_mode_needs_a_draft_model(tiny_dirs):
    r = runner.invoke(app, ["generate", "-m", str(tiny_dirs["qwen3"]), "--mode", "draft", "-p", "hello"])
    assert r.exit_code == 2 and "--mode draft needs --draft-model" in r.output and "Traceback" not in r.output


def test_cli_calibrate_draft_mode(tiny_dirs, draft_dirs, tmp_path):
    r = runner.invoke(app, ["calibrate", "-m", str(tiny_dirs["qwen3"]), "--mode", "draft", "--draft-model", str(draft_dirs["random"]),
                            "--db", str(tmp_path / "r.duckdb"), "--repeats", "1", "--max-draft", "3"])
    assert r.exit_code == 0, r.output
    assert "cost curves" in r.output and "static cap" in r.output


def test_a_registry_entry_in_draft_mode_points_at_draft_mode(tiny_dirs, draft_dirs, tmp_path):
    """A draft model is not a head: load_pair must not hand it to the head loaders."""
    import json

    from dspark_lab import load_pair

    reg = tmp_path / "registry.json"
    reg.write_text(json.dumps({"pairs": [{"target": str(tiny_dirs["qwen3"]), "drafter": str(draft_dirs["noisy"]), "mode": "draft",
                                          "cap": 4, "speedup": 1.5}]}))
    with pytest.raises(LoadError, match="use --mode draft --draft-model"):
        load_pair(tiny_dirs["qwen3"], registry=reg)
