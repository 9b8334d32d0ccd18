"""Distill a DSpark head for a model that has none, against the model's own outputs.

1. Data: the target's own greedy continuations of a prompt corpus (chat template applied),
   and optionally whole conversations it only reads (`--corpus`, lab/corpus.py: one forward
   per sequence instead of a decode step per token), stored as token ids with their provenance
   (set, prompt id, set version, generation settings) in `OUT/data.jsonl`; a few prompts per
   set are held out for evaluation.
2. Training (MLX, any backend): the target runs once per batch of sequences with the tap; the
   head learns to predict the next block from anchor positions exactly as inference uses it:
   the fused context of the rows before the anchor, the block `[anchor] + masks` attending to
   that context and bidirectionally to itself, slot k predicting the token k+1 after the anchor
   (by default the target's own greedy prediction there, from the same forward), the Markov
   term fed the token before it (at inference, the previous draft).
   Checkpoints (head, optimizer, step) make it resumable; `OUT/train_log.jsonl` logs loss and
   acceptance. A quantized target generates the data and runs the training forward as a
   dequantized copy (the same weights as plain matmuls, much faster at these batch sizes;
   `--target-weights`), while the held-out evaluation decodes with the target as loaded.
3. Output: DeepSpec-native `config.json` + `model.safetensors` (the head binds the target's
   embeddings and lm_head, so it stays small), and a model card with the command and data.
   Acceptance is measured through the real `speculative_generate` on held-out prompts.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import math
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from ..engine.drafters.dspark import DSparkDrafter, DSparkHead
from ..engine.drafters.dspark_config import DSparkConfig
from ..engine.drafters.load import load_into, stored_quantization
from ..engine.generate import greedy_generate
from ..engine.sampling import SamplingParams
from ..engine.speculative import speculative_generate
from ..engine.target import Target
from ..engine.text import encode_prompt
from ..errors import InputError, SlowDtypeWarning


PAD_TO = 64  # training sequences are padded to a multiple of this many tokens
TARGET_WEIGHTS = ("auto", "dequantized", "as-loaded")
# --target-weights auto dequantizes a quantized target only where the copy takes at most this
# share of the device's memory: the training step's activations need the rest (25 GB at 8 x 2,048
# anchors for Qwen2.5-Coder-0.5B on the H200).
DENSE_SHARE = 0.25


@dataclass
class DistillConfig:
    model: str
    out: str
    block: int = 7
    layers: int = 1
    markov_rank: int = 256
    # The head's MLP width; 0: the target's. A narrower MLP makes a head small enough to commit
    # (a 2-layer head for Qwen2.5-Coder-1.5B, no Markov term, is 56.6 MB at 4 bits with the target's
    # 8,960, 20.8 MB at 2,048, 18.2 MB at 1,536).
    intermediate_size: int = 0
    prompts: str = "code,math,chat"
    tokens: int = 20_000  # continuation tokens to generate as training data
    max_new_tokens: int = 192  # per continuation
    steps: int = 1000
    lr: float = 5e-4
    anchors: int = 16  # anchor positions per training step, anchors // seqs in each sequence (up to every position of it)
    seqs: int = 1  # sequences per training step (one batched target forward)
    held_out: int = 2  # prompts per set kept for evaluation
    # > 0: the first this-many of the target's own generated rows are kept out of training and
    # measured at every evaluation with the teacher-forced accept length (lab/block_accept.py):
    # thousands of anchors where the decoding evaluation above has a few prompts.
    held_rows: int = 0
    eval_every: int = 200
    checkpoint_every: int = 500
    batch: int = 32  # prompts generated together for the data (1: one at a time)
    max_len: int = 512  # training sequences are cut to this many tokens (few shapes to compile)
    minutes: float = 0.0  # > 0: stop training after this long (then save as at the last step)
    data_minutes: float = 0.0  # > 0: stop generating data after this long (training uses what was made)
    warmup: int = 100  # steps of linear learning-rate warmup
    corpus: str = ""  # conversations to read instead of generate (sharegpt:PATH), see lab/corpus.py
    corpus_tokens: int = 0  # answer tokens to take from the corpus
    labels: str = "target"  # "target": the target's own greedy prediction at every position; "data": the stored next token
    # > 0 (with --labels target): each slot learns the target's whole next-token distribution over
    # its this-many most likely tokens (renormalized) instead of its one greedy token: the
    # cross-entropy against soft labels, as EAGLE-style heads are trained (see block_loss_terms).
    soft_labels: int = 0
    data_only: bool = False  # stop once data.jsonl is made (prepare on one machine, train on another)
    init: str = ""  # a head directory (a distill output) whose weights training starts from, with a fresh optimizer
    save_dtype: str = "bfloat16"  # dtype of the saved head (float32 doubles its size)
    slot_decay: float = 0.8  # weight of block slot k in the loss is slot_decay**k (early slots decide acceptance)
    cache_gb: float = 0.0  # > 0: cap MLX's cache of freed buffers (GB), so runs sharing one GPU do not run it out of memory
    memory_gb: float = 0.0  # > 0: MLX's memory limit (GB); two runs on one H200 needed both caps (4 and 60 GB, docs/performance.md)
    chain_slots: bool = True  # with --labels target: slot k trains only where the text after the anchor is the target's own greedy tokens up to it
    target_weights: str = "auto"  # the target's weights for data and training: auto, dequantized or as-loaded (see training_target)
    compute_dtype: str = "float32"  # the head's forward and backward: float32, or bfloat16 on copies of float32 weights (see head_loss_and_grad)
    taps: list[int] | None = None
    mask_token_id: int | None = None
    seed: int = 0
    # How often each row is drawn, by its prompt set: "PATTERN=WEIGHT,..." (see parse_mix); "":
    # every row equally often. Leans training toward what the head lags on without new data.
    mix: str = ""
    command: str = ""  # the command line, for the model card

    def __post_init__(self) -> None:
        for name in ("block", "layers", "steps", "anchors", "max_new_tokens", "seqs", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        if self.tokens < 0 or self.corpus_tokens < 0:
            raise InputError("--tokens and --corpus-tokens must be >= 0.")
        if self.tokens == 0 and not (self.corpus and self.corpus_tokens):
            raise InputError("no training data asked for: give --tokens (generated) or --corpus with --corpus-tokens (read).")
        if self.labels not in ("target", "data"):
            raise InputError(f"--labels must be target or data, got {self.labels!r}.")
        if self.soft_labels < 0 or (self.soft_labels and self.labels != "target"):
            raise InputError(f"--soft-labels must be >= 0 (0: the greedy token alone) and needs --labels target (the target's "
                             f"own distribution at every position), got --soft-labels {self.soft_labels} with --labels {self.labels}.")
        if self.block < 2:
            raise InputError("--block must be >= 2 (an anchor and at least one mask slot).")
        if self.anchors < self.seqs:
            raise InputError(f"--anchors ({self.anchors}) must be at least --seqs ({self.seqs}): every sequence needs an anchor.")
        if self.batch < 1 or self.max_len < 2 * PAD_TO or min(self.minutes, self.data_minutes, self.warmup, self.cache_gb, self.memory_gb) < 0:
            raise InputError(f"--batch must be >= 1, --max-len >= {2 * PAD_TO}, and --minutes, --data-minutes, --warmup, --cache-gb, --memory-gb >= 0.")
        if not 0 < self.slot_decay <= 1:
            raise InputError(f"--slot-decay must be in (0, 1], got {self.slot_decay}.")
        if self.save_dtype not in ("bfloat16", "float16", "float32"):
            raise InputError(f"--save-dtype must be bfloat16, float16 or float32, got {self.save_dtype!r}.")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise InputError(f"--compute-dtype must be float32 or bfloat16, got {self.compute_dtype!r}.")
        if self.target_weights not in TARGET_WEIGHTS:
            raise InputError(f"--target-weights must be one of {', '.join(TARGET_WEIGHTS)}, got {self.target_weights!r}.")
        if self.markov_rank < 0 or self.lr <= 0:
            raise InputError("--markov-rank must be >= 0 and the learning rate > 0.")
        if self.held_rows < 0:
            raise InputError(f"--held-rows must be >= 0 (0: none kept out), got {self.held_rows}.")
        if self.intermediate_size < 0:
            raise InputError(f"--intermediate-size must be >= 0 (0: the target's MLP width), got {self.intermediate_size}.")
        parse_mix(self.mix)  # a malformed --mix fails here, before any data is made or read


def parse_mix(mix: str) -> list[tuple[str, float]]:
    """'self_code*=2,code_*=2,corpus:*=0.5' -> [(pattern, weight), ...]: shell-style patterns on a
    row's prompt set (its "set" field: code_synth2, self_code_s1, corpus:sharegpt, ...)."""
    pairs = []
    for item in filter(None, (x.strip() for x in mix.split(","))):
        pattern, eq, weight = item.rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not eq or not pattern or not value >= 0 or value == float("inf"):
            raise InputError(f"--mix takes PATTERN=WEIGHT pairs with a weight >= 0, e.g. 'self_code*=2,corpus:*=0.5'; "
                             f"got {item!r}.")
        pairs.append((pattern, value))
    return pairs


def draw_weights(data: list[dict], mix: str) -> tuple[list[float] | None, list[str]]:
    """Each row's weight in the training draws under --mix (the first pattern its prompt set matches;
    1 where none does), and a line per pattern saying what share of the draws it gets instead of
    its share of the rows. (None, []) without --mix: every row equally often, as always."""
    pairs = parse_mix(mix)
    if not pairs:
        return None, []
    sets = [row.get("set", "") for row in data]
    matched = [next((i for i, (pattern, _) in enumerate(pairs) if fnmatch.fnmatchcase(s, pattern)), None) for s in sets]
    weights = [1.0 if m is None else pairs[m][1] for m in matched]
    total = sum(weights)
    unused = [pattern for i, (pattern, _) in enumerate(pairs) if i not in matched]
    if unused:
        names = ", ".join(sorted(set(sets)))
        raise InputError(f"--mix pattern(s) {', '.join(map(repr, unused))} match no row's prompt set (the data has: {names}); "
                         "fix the pattern or leave it out.")
    if total == 0:
        raise InputError("--mix gives every row weight 0: nothing would be drawn; give some set a weight above 0.")
    lines = []
    for i, (pattern, weight) in [*enumerate(pairs), (None, (None, 1.0))]:
        rows = [k for k, m in enumerate(matched) if m == i]
        if rows:
            label = f"{pattern}={weight:g}" if pattern else "the rest (=1)"
            lines.append(f"mix {label}: {len(rows)} rows, {len(rows) / len(data):.0%} of the rows, "
                         f"{sum(weights[k] for k in rows) / total:.0%} of the draws")
    return weights, lines


def default_taps(num_layers: int) -> list[int]:
    """Early, middle and late layers (never the last: its output is what the target's own
    head reads, which the drafter gets through the bound lm_head anyway)."""
    last = max(num_layers - 2, 0)
    return sorted({min(1, last), num_layers // 2 if num_layers > 2 else 0, last})


def head_config(target: Target, cfg: DistillConfig) -> DSparkConfig:
    tcfg = target.config
    return DSparkConfig(
        hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_hidden_layers=cfg.layers,
        intermediate_size=cfg.intermediate_size or int(tcfg.get("intermediate_size") or 4 * target.hidden_size),
        num_attention_heads=int(tcfg.get("num_attention_heads", 8)), num_key_value_heads=tcfg.get("num_key_value_heads"),
        head_dim=target.head_dim, rms_norm_eps=float(tcfg.get("rms_norm_eps", 1e-6)), rope_theta=float(tcfg.get("rope_theta", 1e6)),
        block_size=cfg.block, mask_token_id=cfg.mask_token_id if cfg.mask_token_id is not None else target.vocab_size - 1,
        target_layer_ids=cfg.taps or default_taps(target.num_layers), markov_rank=cfg.markov_rank,
        enable_confidence_head=False, has_embed_tokens=False, has_lm_head=False,
    )


# --- the target's weights for training ----------------------------------------------------------

def dense_extra_bytes(model: nn.Module) -> int:
    """Bytes a dequantized copy of `model`'s quantized layers takes (0: none is quantized)."""
    total = 0
    for _, m in model.named_modules():
        if "scales" in m and hasattr(m, "bits"):  # QuantizedLinear, QuantizedEmbedding, mlx-lm's switch layers
            total += m.weight.size * 32 // m.bits * m.scales.dtype.size
    return total


def training_target(target: Target, setting: str, memory: int | None) -> tuple[bool, str]:
    """Whether distill generates its data and runs its training forward on a dequantized copy of
    `target` (True) or on the target as loaded, and why. The copy holds the same weights as plain
    matrices; only the summation order differs, so its greedy labels are the target's up to
    near-ties (which cost the head nothing: every draft is still verified by the target as
    loaded). What it buys: on the H200, Qwen2.5-Coder-0.5B at 4 bits ran its 8 x 1,024-token
    training forward in 22 ms instead of 67, and a 256-row generation step in 5 ms instead of 56
    (benchmarks/qmm_vs_dense.py, docs/performance.md); decoding one token stays faster quantized."""
    extra = dense_extra_bytes(target.model)
    if setting == "as-loaded":
        return False, "the target as loaded (--target-weights as-loaded)"
    if not extra:
        return False, "the target as loaded (it has no quantized layers)"
    size = f"{extra / 2**30:.2f} GiB"
    if setting == "auto" and memory and extra > DENSE_SHARE * memory:
        return False, (f"the target as loaded: a dequantized copy ({size}) would take more than {DENSE_SHARE:.0%} of this "
                       f"device's {memory / 2**30:.0f} GiB; --target-weights dequantized uses one anyway")
    return True, f"a dequantized copy of the target ({size} more; the same weights as plain matmuls, faster at batch sizes above one)"


def load_target_as_is(model: str, **kwargs):
    """load_target without the advice to cast a half-precision model on the CPU: the head learns
    the target as its user will run it, and a float32 copy would label near-ties its own way."""
    from ..engine.loading import load_target

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowDtypeWarning)
        return load_target(model, **kwargs)


def training_copy(model: str, target: Target, setting: str, taps=None) -> tuple[Target, bool, str]:
    """The Target that makes distill's data and runs its training forward, as `training_target`
    decides: `target` itself, or a dequantized copy loaded from `model` (probed on `taps`, as the
    target was); then whether it is the copy, and why."""
    from .device import device_memory

    dense, why = training_target(target, setting, device_memory())
    if not dense:
        return target, False, why
    copy, _ = load_target_as_is(model, dequantize=True, taps=taps)
    return copy, True, why


# --- data -------------------------------------------------------------------------------------

def prepare_data(target: Target, tokenizer, cfg: DistillConfig, say: Callable[[str], None],
                 weights: str = "as-loaded") -> tuple[list[dict], list]:
    """Training sequences (cached in OUT/data.jsonl) and the held-out prompts. `weights` names
    the target's weights that generate them ("as-loaded" or "dequantized"), for the provenance."""
    from .prompts import load_prompt_sets

    sets = load_prompt_sets(cfg.prompts)
    train_prompts, held = [], []
    for s in sets:
        held += s.prompts[: cfg.held_out]
        train_prompts += [(s, p) for p in s.prompts[cfg.held_out :]]
    # Interleave the sets (seeded) so a --tokens budget spends itself on all of them, not the first.
    __import__("random").Random(cfg.seed).shuffle(train_prompts)
    if not train_prompts:
        raise InputError(f"no training prompts left after holding out {cfg.held_out} per set; add prompts or lower --held-out.")
    path = Path(cfg.out) / "data.jsonl"
    writer = writer_name(cfg.model)
    data = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if cfg.corpus:
        data = _read_corpus(tokenizer, cfg, path, data, say)
    generated = [d for d in data if d.get("generation") != "corpus"]
    # Only this model's own rows count towards --tokens and mark a prompt as answered: another
    # model's answer to a prompt is text this target reads, and its own answer to the same prompt
    # is the one whose every block slot lies on its path.
    own = [d for d in generated if d.get("model", writer) == writer]
    made = answer_tokens(own)
    if generated:
        say(f"reusing {len(generated)} generated sequences ({answer_tokens(generated)} continuation tokens) from {path}")
        foreign = [d["model"] for d in generated if d.get("model", writer) != writer]
        if foreign:  # allowed: every position is labelled by this target's own prediction (--labels target)
            say(f"{len(foreign)} of them were written by another model ({', '.join(sorted(set(foreign)))}), not {writer}: "
                "read as text, they are on this target's path only where it agrees; its own answers to their prompts may follow")
        if made >= cfg.tokens:
            return data, held
        # Top up a smaller earlier run with the prompts this model has not continued yet.
        seen = {(d["set"], d["prompt_id"]) for d in own}
        train_prompts = [(s, p) for s, p in train_prompts if (s.name, p.id) not in seen]
    with path.open("a") as f:
        def keep(s, p, ids, out, how):
            nonlocal made
            row = {"ids": ids + out, "prompt_len": len(ids), "set": s.name, "set_version": s.version,
                   "prompt_id": p.id, "generation": how, "max_new_tokens": cfg.max_new_tokens, "model": writer,
                   "target_weights": weights}
            f.write(json.dumps(row) + "\n")
            f.flush()
            data.append(row)
            made += len(out)

        # Each prompt once: greedy continuations of the same prompt are identical, so going
        # round again would only duplicate data.
        t0, made0 = time.perf_counter(), made
        exhausted = True  # every prompt continued (no budget ended the loop)
        for start in range(0, len(train_prompts), cfg.batch):
            if made >= cfg.tokens:
                exhausted = False
                break
            if cfg.data_minutes and time.perf_counter() - t0 > 60 * cfg.data_minutes:
                say(f"data time budget of {cfg.data_minutes} min reached: {made} of the {cfg.tokens} tokens asked for")
                exhausted = False
                break
            chunk = train_prompts[start : start + cfg.batch]
            encoded = [encode_prompt(tokenizer, p.as_input()) for _, p in chunk]
            if cfg.batch == 1:
                r = greedy_generate(target, tokenizer, encoded[0], max_new_tokens=cfg.max_new_tokens)
                outs, how = [r.token_ids], "greedy"
            else:
                outs, how = _batch_greedy(target, tokenizer, encoded, cfg.max_new_tokens), "greedy-batched"
            for (s, p), ids, out in zip(chunk, encoded, outs):
                keep(s, p, ids, out, how)
            spent = time.perf_counter() - t0
            say(f"data: {made}/{cfg.tokens} continuation tokens in {len(data)} sequences ({spent:.0f} s, {(made - made0) / spent:.0f} tokens/s)")
        if made == 0 and cfg.tokens:
            raise InputError("the target produced no continuation tokens for any prompt.")
        if made < cfg.tokens and exhausted:
            say(f"every prompt is continued once: {made} of the {cfg.tokens} tokens asked for; add prompts for more")
    say(f"generated {made} continuation tokens; {len(data)} sequences in all")
    return data, held


def answer_tokens(rows: list[dict]) -> int:
    """Tokens after the prompt (what the head learns to draft) over data rows."""
    return sum(len(r["ids"]) - r["prompt_len"] for r in rows)


def _read_corpus(tokenizer, cfg: DistillConfig, path: Path, data: list[dict], say) -> list[dict]:
    """Add corpus rows (lab/corpus.py) to the data until each corpus has given --corpus-tokens
    answer tokens (or ended)."""
    from .corpus import corpus_rows, corpus_specs

    seen = {(d["set"], d["prompt_id"]) for d in data}
    added = []
    for kind, src in corpus_specs(cfg.corpus):
        have = answer_tokens([d for d in data + added if d.get("generation") == "corpus" and d["set"] == f"corpus:{kind}"])
        if have >= cfg.corpus_tokens:
            continue
        new = []
        with path.open("a") as f:
            for row in corpus_rows(tokenizer, kind, src, cfg.corpus_tokens - have, cfg.max_len, seen):
                f.write(json.dumps(row) + "\n")
                new.append(row)
        added += new
        say(f"corpus:{kind}: {len(new)} conversations read, {have + answer_tokens(new)} answer tokens in all")
    return data + added


def _batch_greedy(target: Target, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of many prompts at once through mlx-lm's batched generator (the
    target's own model, argmax sampling). Padding inside the batch can move a near-tie logit by
    a rounding step, so these are "greedy-batched" in the provenance: training data, never a
    reference for losslessness."""
    from mlx_lm.generate import batch_generate

    # All prompts decode together (mlx-lm would otherwise cap the decode batch at 32).
    r = batch_generate(target.model, tokenizer, prompts, max_tokens=max_new_tokens, return_token_ids=True,
                       completion_batch_size=len(prompts), prefill_batch_size=min(len(prompts), 16))
    return [list(ids) for ids in r.token_ids]


# --- training ---------------------------------------------------------------------------------

def _block_forward(head: DSparkHead, c: DSparkConfig, embed, ctx: mx.array, tokens: mx.array, anchors: mx.array) -> mx.array:
    """Final-norm hidden states (B, A, block, H) of one block per anchor, as inference computes
    them: block rows see the context rows before their anchor and their whole block.

    ctx (B, L, H) and tokens (B, L) hold B sequences; anchors (B, A) are positions in them.
    Attention is taken in two parts that share one softmax: every block row against the
    sequence's context keys (projected once, masked to the rows before its anchor), and against
    its own block's keys only. The cost grows with A * block * L, not (A * block)^2 as one query
    matrix over every block's keys would, so a step can train every position of its sequences as
    an anchor; each row's output is exactly that of its block alone."""
    B, A = anchors.shape
    bs, L = c.block_size, ctx.shape[1]
    nH, nKV = c.num_attention_heads, c.kv_heads
    g = nH // nKV  # query heads per key/value head
    first = mx.take_along_axis(tokens, anchors, axis=1)  # (B, A)
    ids = mx.concatenate([first[..., None], mx.full((B, A, bs - 1), c.mask_token_id, dtype=tokens.dtype)], axis=2)
    h = embed(ids.reshape(B * A, bs))  # (B*A, bs, H): rope wants one offset per row group
    flat_anchors = anchors.reshape(-1)
    sees_ctx = (mx.arange(L)[None, None] < anchors[:, :, None])[:, None, :, None, :]  # (B, 1, A, 1, L)

    for layer in head.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn._rope(attn.q_norm(attn.q_proj(x).reshape(B * A, bs, nH, -1)).transpose(0, 2, 1, 3), flat_anchors)
        kb, vb = attn.kv(x, flat_anchors)  # (B*A, kv_heads, bs, d): the block's keys and values, as inference projects them
        kc, vc = attn.kv(ctx, 0)  # (B, kv_heads, L, d)
        d = q.shape[-1]
        # Query rows grouped by the key/value head they read: (B, kv_heads, A, g*bs, d).
        qg = q.reshape(B, A, nKV, g * bs, d).transpose(0, 2, 1, 3, 4)
        kb, vb = (t.reshape(B, A, nKV, bs, d).transpose(0, 2, 1, 3, 4) for t in (kb, vb))  # (B, kv_heads, A, bs, d)
        s_ctx = (qg.reshape(B, nKV, A * g * bs, d) @ kc.swapaxes(-1, -2)).reshape(B, nKV, A, g * bs, L) * attn.scale
        s_ctx = mx.where(sees_ctx, s_ctx, mx.array(-mx.inf, dtype=s_ctx.dtype))
        s_blk = (qg @ kb.swapaxes(-1, -2)) * attn.scale  # (B, kv_heads, A, g*bs, bs)
        p = mx.softmax(mx.concatenate([s_ctx, s_blk], axis=-1), axis=-1, precise=True)
        out = (p[..., :L].reshape(B, nKV, A * g * bs, L) @ vc).reshape(B, nKV, A, g * bs, d) + p[..., L:] @ vb
        out = out.reshape(B, nKV, A, g, bs, d).transpose(0, 2, 4, 1, 3, 5).reshape(B * A, bs, nH * d)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return head.norm(h).reshape(B, A, bs, -1)


def slot_targets(c: DSparkConfig, tokens, anchors, length=None, slot_decay: float = 1.0, labels=None, chain: bool = False):
    """(targets, prev, weight), each (B, A, block): every block slot's label, the token the
    Markov term is fed before it, and the slot's weight in the loss (0 where it has no label).
    Data only (tokens, labels, anchors): no head involved, so a step can know its labelled slots
    before the head runs. The rules are `block_loss_terms`'s."""
    L, bs = tokens.shape[1], c.block_size
    pos = anchors[..., None] + mx.arange(bs)  # (B, A, bs): position of each slot's previous token
    limit = L if length is None else length[:, None, None]
    if labels is None:
        valid = (pos + 1) < limit
        targets, prev = _at_positions(tokens, pos + 1), _at_positions(tokens, pos)
    else:
        valid = pos < limit  # a label exists after every real position, the last one too
        targets = _at_positions(labels, pos)
        prev = mx.concatenate([_at_positions(tokens, pos[..., :1]), _at_positions(labels, pos[..., :-1])], axis=-1)
    if labels is not None and chain:
        follows = mx.cumprod((_at_positions(tokens, pos + 1) == targets).astype(mx.float32), axis=-1)  # slots 0..k on the target's path
        valid = valid * mx.concatenate([mx.ones_like(follows[..., :1]), follows[..., :-1]], axis=-1)
    return targets, prev, valid * (slot_decay ** mx.arange(bs, dtype=mx.float32))


def slot_soft(c: DSparkConfig, soft, anchors):
    """The soft labels of every block slot: (top ids, probabilities), each (B, A, block, k),
    gathered from the target's (B, L, k) at the positions `slot_targets` takes slot labels from."""
    pos = anchors[..., None] + mx.arange(c.block_size)
    return _at_positions(soft[0], pos), _at_positions(soft[1], pos)


def _at_positions(src: mx.array, pos: mx.array) -> mx.array:
    """src (B, L) or (B, L, k) taken at positions pos (B, A, block), a position past the end
    reading the last one (its slot carries no weight): (B, A, block) or (B, A, block, k)."""
    B, L = src.shape[:2]
    flat = mx.minimum(pos, L - 1).reshape(B, -1)
    if src.ndim == 3:
        flat = mx.broadcast_to(flat[..., None], (*flat.shape, src.shape[-1]))
    return mx.take_along_axis(src, flat, axis=1).reshape(*pos.shape, *src.shape[2:])


def labelled_rows(weight: mx.array, multiple: int = 256) -> tuple[mx.array, mx.array]:
    """The flat indices of the block slots that carry weight, padded to a multiple of `multiple`
    (few distinct shapes: on CUDA each new shape compiles its kernels first), and a 0/1 mask
    that is 0 on the padding. With chained slots most late slots of read text have no label;
    the vocabulary projection, the costliest part of the head's step, then runs only on these."""
    import numpy as np

    flat = np.flatnonzero(np.array(weight.reshape(-1)) > 0)
    n = max(len(flat), 1)
    width = min(n + (-n % multiple), weight.size)
    rows = np.zeros(width, dtype=np.int32)
    rows[: len(flat)] = flat
    keep = (np.arange(width) < len(flat)).astype(np.float32)
    return mx.array(rows), mx.array(keep)


def step_inputs(target: Target, c: DSparkConfig, cfg: DistillConfig, ids, anchors, lengths, gather: bool = True):
    """The target's side of a training step, evaluated: (taps_cat, labels, rows, soft). labels
    are the target's greedy predictions (None with --labels data); rows the step's labelled slots
    (`labelled_rows`), known only once the target's forward has run, or None with gather=False
    (every slot projected; benchmarks/distill_step.py compares the two); soft, with
    --soft-labels k, the target's k most likely tokens and their probabilities at every
    position (None without)."""
    soft = None
    if cfg.labels == "target" and cfg.soft_labels:
        taps, labels, top, probs = target.taps_predictions_and_top(ids, c.target_layer_ids, cfg.soft_labels)
        soft = (top, probs)
    elif cfg.labels == "target":
        taps, labels = target.taps_and_predictions(ids, c.target_layer_ids)
    else:
        taps, labels = target.taps_batch(ids, c.target_layer_ids), None
    taps_cat = mx.stop_gradient(mx.concatenate([taps[t] for t in c.target_layer_ids], axis=-1))
    if not gather:
        mx.eval([a for a in (taps_cat, labels, soft) if a is not None])
        return taps_cat, labels, None, soft
    weight = slot_targets(c, ids, anchors, lengths, cfg.slot_decay, labels, cfg.chain_slots)[2]
    mx.eval([a for a in (taps_cat, weight, soft) if a is not None])
    return taps_cat, labels, labelled_rows(weight), soft


def head_loss_and_grad(head: DSparkHead, c: DSparkConfig, target: Target, lm_head, cfg: DistillConfig):
    """The head's training loss and its gradient, as a function of
    (head, taps_cat, ids, anchors, lengths, labels, rows, soft).

    With cfg.compute_dtype "bfloat16" the forward and backward run on bfloat16 copies of the
    head's float32 weights (mixed precision: the gradient comes back through the cast as float32,
    and the optimizer updates the float32 weights, so small updates are not rounded away). The
    head then multiplies at bfloat16 speed and moves half the bytes; the cross-entropy is still
    taken in float32. The taps and the vocabulary projection are bfloat16 either way."""
    def loss(h, t, x, a, n, y, r, s=None):
        return block_loss(h, c, target.embed, lm_head, t, x, a, n, cfg.slot_decay, y, cfg.chain_slots, r, s)

    if cfg.compute_dtype == "float32":
        return nn.value_and_grad(head, loss)
    dtype = getattr(mx, cfg.compute_dtype)

    def cast_loss(params, *args):
        head.update(tree_map(lambda w: w.astype(dtype), params))
        return loss(head, *args)

    value_and_grad = mx.value_and_grad(cast_loss)

    def run(_head, *args):  # called as nn.value_and_grad's function is: (head, inputs...)
        master = head.trainable_parameters()
        try:
            return value_and_grad(master, *args)
        finally:
            head.update(master)  # the float32 weights back in place, for the optimizer and the evaluation

    return run


def block_loss_terms(head: DSparkHead, c: DSparkConfig, embed, lm_head, taps_cat, tokens, anchors, length=None,
                     slot_decay: float = 1.0, labels=None, chain: bool = False, rows=None, soft=None) -> tuple[mx.array, mx.array]:
    """(sum of weighted cross-entropies, sum of weights) of every block slot's prediction,
    slot k weighted by slot_decay**k: a draft is accepted only up to its first miss, so the
    early slots are worth more than the late ones.

    Slot k's label is the token k+1 after the anchor: from `tokens` (the stored sequence), or,
    given `labels` (the target's own greedy prediction after every position, same shape as
    tokens), labels[anchor + k], with the Markov term fed labels[anchor + k - 1] (the draft
    before it, if that was right) as inference feeds it the previous draft. On the target's own
    greedy output both are the same; on text the target only reads, labels are what makes the
    head predict the target rather than the text.

    `chain` (with labels): slot k counts only where the stored tokens after the anchor are the
    target's own predictions for slots 0..k-1. At inference slot k is verified only after those
    slots were accepted, that is, after the target's greedy tokens; on text the target merely
    reads, the token after the anchor is the target's greedy choice only about as often as the
    target predicts the text, and where it is not, labels[anchor + k] answers a prefix
    inference never meets (the head sees only masks there, so it cannot tell). Slot 0 always
    counts; on the target's own greedy output every slot does.

    `soft` (with labels: the target's top-k tokens and their renormalized probabilities at every
    position, (B, L, k) each, from `Target.taps_predictions_and_top`): slot k's loss is the
    cross-entropy against that distribution, logsumexp(logits) - sum_j p_j * logits[token_j],
    instead of against labels[anchor + k] alone. The weights and the Markov term's inputs stay
    the greedy labels' (which slots inference verifies does not change). At k = 1 this is the
    hard loss; it is linear in the probabilities (tests/test_distill.py checks both).

    `rows` (from `labelled_rows`: flat slot indices and their 0/1 padding mask): project only
    those slots to the vocabulary. Slots without weight add nothing to the loss or its gradient,
    so the result is the same (up to summation order) at a fraction of the cost.

    One sequence: taps_cat (L, T*H), tokens (L,), anchors (A,), length an int. A batch:
    taps_cat (B, L, T*H), tokens (B, L), anchors (B, A), length (B,). Tokens may be padded past
    their length: padding is never a target, and no anchor's context reaches it (context rows
    are those before the anchor)."""
    if tokens.ndim == 1:
        tokens, taps_cat, anchors = tokens[None], taps_cat[None], anchors[None]
        labels = None if labels is None else labels[None]
        soft = None if soft is None else (soft[0][None], soft[1][None])
        length = None if length is None else mx.array([length])
    if soft is not None and labels is None:
        raise ValueError("soft labels come with the greedy labels (labels=) they were taken beside")
    ctx = head.hidden_norm(head.fc(taps_cat))
    hidden = _block_forward(head, c, embed, ctx, tokens, anchors)  # (B, A, bs, H)
    targets, prev, weight = slot_targets(c, tokens, anchors, length, slot_decay, labels, chain)
    if soft is not None:
        soft = slot_soft(c, soft, anchors)
    if rows is not None:
        index, keep = rows
        hidden = hidden.reshape(-1, hidden.shape[-1])[index]
        targets, prev, weight = targets.reshape(-1)[index], prev.reshape(-1)[index], weight.reshape(-1)[index] * keep
        if soft is not None:
            soft = tuple(x.reshape(-1, x.shape[-1])[index] for x in soft)
    logits = lm_head(hidden).astype(mx.float32)  # (B, A, bs, V), or (rows, V)
    if c.markov_rank:
        logits = logits + head.markov_head.markov_w2(head.markov_head.markov_w1(prev))
    if soft is None:
        ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    else:
        top, probs = soft
        picked = mx.take_along_axis(logits, top.astype(mx.int32), axis=-1)
        ce = mx.logsumexp(logits, axis=-1) - (probs * picked).sum(axis=-1)
    return (ce * weight).sum(), weight.sum()


def block_loss(head: DSparkHead, c: DSparkConfig, embed, lm_head, taps_cat, tokens, anchors, length=None, slot_decay: float = 1.0,
               labels=None, chain: bool = False, rows=None, soft=None):
    """Weighted mean cross-entropy of the block predictions (see `block_loss_terms`)."""
    total, weight = block_loss_terms(head, c, embed, lm_head, taps_cat, tokens, anchors, length, slot_decay, labels, chain, rows, soft)
    return total / mx.maximum(weight, 1e-6)


def dense_lm_head(target: Target):
    """The target's vocabulary projection as one dense matrix, for training. A quantized head
    (4-bit tied embeddings) backpropagates through a transposed quantized matmul, slow where a
    batch has thousands of rows; its dequantized weights give the same logits from one plain
    matmul. Read generically, by projecting the identity (and zero, for a bias)."""
    H = target.hidden_size
    eye = mx.eye(H, dtype=target.embed(mx.array([0])).dtype)
    bias = target.head_logits(mx.zeros((1, H), dtype=eye.dtype))
    w = target.head_logits(eye) - bias  # (H, V)
    mx.eval(w, bias)
    if not mx.any(bias).item():
        return lambda x: x.astype(w.dtype) @ w
    return lambda x: x.astype(w.dtype) @ w + bias[0]


def _training_batch(data: list[dict], rng, cfg: DistillConfig, cum_weights: list[float] | None = None):
    """One step's batch: cfg.seqs sequences (cut to cfg.max_len, right-padded together to a
    multiple of PAD_TO: few distinct shapes, and on CUDA every new shape compiles its kernels
    first) and cfg.anchors // cfg.seqs anchors in each -> (ids (B, L), lengths (B,), anchors
    (B, A)), or None when a drawn sequence has no continuation to learn from. The rows are drawn
    uniformly, or by `cum_weights` (--mix, cumulated)."""
    if cum_weights is None:
        rows = [data[rng.randrange(len(data))] for _ in range(cfg.seqs)]
    else:
        rows = rng.choices(data, cum_weights=cum_weights, k=cfg.seqs)
    seqs, ranges = [], []
    for row in rows:
        ids = row["ids"][-cfg.max_len :]  # keep the continuation; cut the prompt's start
        prompt_len = max(1, row["prompt_len"] - (len(row["ids"]) - len(ids)))
        lo, hi = max(1, prompt_len - 1), len(ids) - 2
        if hi <= lo:
            return None
        seqs.append(ids)
        ranges.append((lo, hi))
    width = max(len(x) for x in seqs) + 1  # one row past every sequence: where padding anchors sit
    width += -width % PAD_TO
    # The same anchor count in every sequence (one fixed shape). A sequence with fewer positions
    # than that trains each of them once; the rest of its anchors sit at its end, where no slot
    # has a label (block_loss_terms weighs them 0), instead of training some positions twice.
    k = cfg.anchors // cfg.seqs
    anchors = [sorted(rng.sample(range(lo, hi), k)) if hi - lo >= k else list(range(lo, hi)) + [len(x)] * (k - (hi - lo))
               for x, (lo, hi) in zip(seqs, ranges)]
    ids = mx.array([x + [x[-1]] * (width - len(x)) for x in seqs], dtype=mx.uint32)
    return ids, mx.array([len(x) for x in seqs], dtype=mx.int32), mx.array(anchors, dtype=mx.int32)


def learning_rate(cfg: DistillConfig, step: int, seconds: float) -> float:
    """Linear warmup over cfg.warmup steps, then a cosine from cfg.lr down to a tenth of it over
    the run's progress: the step count, or the time budget where that ends first (so a run
    stopped by --minutes still ends at the low rate instead of being cut at the peak)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = step / cfg.steps
    if cfg.minutes:
        progress = max(progress, seconds / (60 * cfg.minutes))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _save_checkpoint(head: DSparkHead, optimizer, ckpt: Path, step: int) -> None:
    """What --resume continues from: the head (float32), the optimizer state and the step."""
    _save_head(head, ckpt / "head.safetensors")
    mx.save_safetensors(str(ckpt / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (ckpt / "state.json").write_text(json.dumps({"step": step}))


def _init_from(head: DSparkHead, c: DSparkConfig, src: Path) -> str:
    """Load a trained head's weights into the fresh head: same architecture and taps, or an
    error naming what differs (the weights would not mean the same thing otherwise). The one
    difference allowed is a wider MLP (`--intermediate-size` above the trained head's): the head is
    widened without changing what it computes (below), so training goes on from where it was."""
    cfg_file, weights = src / "config.json", src / "model.safetensors"
    if not cfg_file.exists() or not weights.exists():
        raise InputError(f"--init {str(src)!r} is not a head directory (needs config.json and model.safetensors, as distill writes).")
    theirs = json.loads(cfg_file.read_text())
    ours = {"block_size": c.block_size, "num_hidden_layers": c.num_hidden_layers, "markov_rank": c.markov_rank,
            "target_layer_ids": list(c.target_layer_ids), "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size}
    differ = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    narrower = differ.pop("intermediate_size", None)
    if narrower is not None and not (isinstance(narrower[0], int) and 0 < narrower[0] < narrower[1]):
        differ["intermediate_size"] = narrower  # a narrower MLP would drop what the head learned
    if differ:
        what = ", ".join(f"{k} {a} (--init) vs {b} (this run)" for k, (a, b) in differ.items())
        raise InputError(f"--init head {str(src)!r} has another architecture: {what}. Use the same --block, --layers, "
                         "--markov-rank and --intermediate-size it was trained with (a wider --intermediate-size widens it).")
    their_c = replace(c, intermediate_size=narrower[0]) if narrower else c
    trained = DSparkHead(their_c, head.fc.weight.shape[1] // len(c.target_layer_ids))
    loaded = mx.load(str(weights))
    # A head stored quantized (quantize-head, to be small enough for git) starts from its values as floats.
    load_into(trained, loaded, stored_quantization(theirs, set(loaded)), 16)
    values = {k: v.astype(mx.float32) for k, v in tree_flatten(trained.parameters())}
    if narrower:
        values = _widened(values, dict(tree_flatten(head.parameters())), narrower[0])
    head.load_weights(list(values.items()), strict=True)
    return f", its MLPs widened from {narrower[0]} to {narrower[1]} units (the new ones start silent)" if narrower else ""


def _widened(values: dict[str, mx.array], fresh: dict[str, mx.array], width: int) -> dict[str, mx.array]:
    """The trained head's weights in a head whose MLPs are wider than its `width`: each MLP keeps
    its units as the first `width`, the new units get the fresh head's random gate and up rows and
    zero down-projection columns. A new unit's output is multiplied by those zeros, so the wider
    head computes exactly what the trained one did; the gradient through the zeros is not zero
    (it is the unit's activation times the error), so training puts the new units to use."""
    out = dict(values)
    for name, new in fresh.items():
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):  # (intermediate, hidden)
            out[name] = mx.concatenate([values[name], new[width:].astype(mx.float32)], axis=0)
        elif name.endswith("mlp.down_proj.weight"):  # (hidden, intermediate)
            old = values[name]
            out[name] = mx.concatenate([old, mx.zeros((old.shape[0], new.shape[1] - width), mx.float32)], axis=1)
    return out


def _save_head(head: DSparkHead, path: Path, dtype: str = "float32") -> None:
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(head.parameters())}
    # Written beside and renamed into place: a reader that copies the head while a checkpoint is
    # saved (h200_collect.sh polls a running distill) gets the previous file whole, never half.
    # (In a folder of its own, so no glob for *.safetensors in the head's folder ever sees it.)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".saving-") as tmp:
        partial = Path(tmp) / path.name
        mx.save_safetensors(str(partial), weights, metadata={"format": "mlx"})
        partial.replace(path)


def _save_loadable(head: DSparkHead, c: DSparkConfig, target: Target, out: Path, dtype: str) -> None:
    """The head as the engine loads it: config.json and model.safetensors in `dtype`."""
    _save_head(head, out / "model.safetensors", dtype)
    (out / "config.json").write_text(json.dumps(native_config(c, target), indent=2))


def native_config(c: DSparkConfig, target: Target) -> dict:
    """DeepSpec-native config.json for the head."""
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
        "num_hidden_layers": c.num_hidden_layers, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.kv_heads, "head_dim": c.dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "block_size": c.block_size,
        "mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids, "num_target_layers": target.num_layers,
        "markov_rank": c.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": False,
        "layer_types": ["full_attention"] * c.num_hidden_layers, "tie_word_embeddings": False,
    }


def writer_name(model: str) -> str:
    """What a generated row's "model" field holds: the model's folder name, the same on every
    machine it is shipped to."""
    return Path(model.rstrip("/")).name


def split_held_rows(data: list[dict], cfg: DistillConfig) -> tuple[list[dict], list[dict]]:
    """(held-out rows, training rows) for --held-rows N: the first N of this target's own generated
    rows in data.jsonl's order, which a run that tops its data up later keeps (rows are appended),
    so a resumed run holds out the same ones."""
    if not cfg.held_rows:
        return [], data
    writer = writer_name(cfg.model)
    own = [i for i, d in enumerate(data) if d.get("generation") != "corpus" and d.get("model", writer) == writer]
    if len(own) < cfg.held_rows or len(data) == cfg.held_rows:
        raise InputError(f"--held-rows {cfg.held_rows}: the data has {len(own)} rows this model generated and {len(data)} in all; "
                         "hold out fewer, or generate more (--tokens), so that some remain to train on.")
    out = set(own[: cfg.held_rows])
    return [data[i] for i in sorted(out)], [d for i, d in enumerate(data) if i not in out]


def held_rows_accept(target, head, rows: list[dict], cap: int, max_len: int) -> dict:
    """The head's teacher-forced accept length on the held-out rows: over every answer position
    ("held_rows_accept"), and on the decode's path along them ("held_rows_path_accept": what
    decoding them would report, lower: a decode crosses easy stretches in few rounds)."""
    from .block_accept import mean_accept, path_mean_accept, row_accept

    drafter = DSparkDrafter(head, target.embed, target.head_logits)
    measured = [row_accept(target, drafter, r, cap, max_len) for r in rows]
    return {"held_rows_accept": mean_accept(measured), "held_rows_path_accept": path_mean_accept(measured)}


def _say_held_rows(say, step: int, entry: dict, n: int) -> None:
    say(f"step {step}: teacher-forced accept length {entry['held_rows_accept']:.3f} over every answer position of {n} "
        f"held-out rows, {entry['held_rows_path_accept']:.3f} on the decode's path along them")


def evaluate(target, tokenizer, head, held, cap: int, max_new_tokens: int = 64) -> float:
    """Mean accept length of the head on held-out prompts, through the real generation path."""
    drafter = DSparkDrafter(head, target.embed, target.head_logits)
    accepts = []
    for p in held:
        r = speculative_generate(target, tokenizer, drafter, p.as_input(), max_new_tokens=max_new_tokens,
                                 max_draft_tokens=cap, lookup_drafts=False)
        accepts += r.accept_lengths
    return sum(accepts) / max(len(accepts), 1)


def distill(cfg: DistillConfig, *, resume: bool = False, progress: bool = True, say: Callable[[str], None] = print) -> Path:
    """Run (or resume) a distillation; returns the output directory (a loadable head)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    out = Path(cfg.out)
    ckpt = out / "checkpoint"
    if out.exists() and any(out.iterdir()) and not resume and not (out / "data.jsonl").exists():
        raise InputError(f"output directory {str(out)!r} exists and is not a distill run; choose another --out or remove it.")
    out.mkdir(parents=True, exist_ok=True)
    ckpt.mkdir(exist_ok=True)
    mx.random.seed(cfg.seed)
    if cfg.cache_gb:
        # Batches come in several padded shapes, and MLX keeps every freed buffer for reuse up to
        # its memory limit: on the H200 one run's cache grew past 50 GB, and two runs on one GPU
        # ran it out of memory.
        mx.set_cache_limit(int(cfg.cache_gb * 2**30))
    if cfg.memory_gb:  # the cache cap alone let one run's live arrays and cache take 138 GB of the H200's 141
        mx.set_memory_limit(int(cfg.memory_gb * 2**30))
    if cfg.data_only and cfg.tokens == 0:
        # Reading corpora is tokenizing alone: no weights, no probe, no dequantized copy (for a
        # 1.5B model on a 2-core CPU those took 4 of the 5 minutes of reading 3 M ShareGPT tokens).
        from ..engine.loading import load_tokenizer

        data, _ = prepare_data(None, load_tokenizer(cfg.model), cfg, say, "as-loaded")
        say(f"data ready in {out / 'data.jsonl'}: {len(data)} sequences, {answer_tokens(data)} answer tokens "
            "(read, not generated: the weights were not loaded); train with the same command without --data-only")
        return out
    target, tokenizer = load_target_as_is(cfg.model)
    if cfg.soft_labels > target.vocab_size:
        raise InputError(f"--soft-labels {cfg.soft_labels} is more than the target's vocabulary ({target.vocab_size} tokens); "
                         "a few dozen hold nearly all of a next-token distribution's mass.")
    c = head_config(target, cfg)
    target.check_taps(c.target_layer_ids)
    target.probe(c.target_layer_ids)
    # The data's continuations and the training forward come from `teacher`; the held-out
    # evaluation decodes with `target`, the model the head will draft for.
    teacher, dense, why = training_copy(cfg.model, target, cfg.target_weights, c.target_layer_ids)
    say(f"data and training forward: {why}")
    data, held = prepare_data(teacher, tokenizer, cfg, say, "dequantized" if dense else "as-loaded")
    if cfg.data_only:
        say(f"data ready in {out / 'data.jsonl'}: {len(data)} sequences, {answer_tokens(data)} answer tokens; "
            "train with the same command without --data-only")
        return out
    held_rows, data = split_held_rows(data, cfg)
    if held_rows:
        say(f"{len(held_rows)} of this model's generated rows held out ({answer_tokens(held_rows)} answer tokens): "
            "the teacher-forced accept length is measured on them at every evaluation")
        if cfg.init:
            say(f"note: with --init the held-out rows are the data's first {len(held_rows)} of this model, which the head in "
                f"{cfg.init} may have trained on; measure a continued head on rows no run trained on instead "
                "(benchmarks/block_accept.py --data FILE, HELD=FILE in h200_corpus_heads.sh)")

    head = DSparkHead(c, target.hidden_size)
    optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=0.0)
    step = 0
    state_file = ckpt / "state.json"
    if resume and state_file.exists():
        head.load_weights(str(ckpt / "head.safetensors"))
        opt_state = mx.load(str(ckpt / "optimizer.safetensors"))
        from mlx.utils import tree_unflatten

        optimizer.state = tree_unflatten(list(opt_state.items()))
        step = json.loads(state_file.read_text())["step"]
        say(f"resumed at step {step}")
    elif resume and not cfg.init:
        say("no checkpoint to resume from: starting at step 0")
    if cfg.init and step == 0:
        widened = _init_from(head, c, Path(cfg.init))
        say(f"starting from the weights of {cfg.init} (fresh optimizer{widened})")
    mx.eval(head.parameters())
    lm_head = dense_lm_head(teacher)
    loss_and_grad = head_loss_and_grad(head, c, teacher, lm_head, cfg)
    log = (out / "train_log.jsonl").open("a")
    cap = min(c.max_drafts, 7)
    rng = __import__("random").Random(cfg.seed + step)
    weights, mix_lines = draw_weights(data, cfg.mix)
    cum_weights = list(itertools.accumulate(weights)) if weights else None
    for line in mix_lines:
        say(line)
    t0, losses, saved_at = time.perf_counter(), [], None
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), disable=not progress) as bar:
        task = bar.add_task("distill", total=cfg.steps, completed=step)
        while step < cfg.steps:
            if cfg.minutes and time.perf_counter() - t0 > 60 * cfg.minutes:
                say(f"time budget of {cfg.minutes} min reached at step {step}")
                break
            batch = _training_batch(data, rng, cfg, cum_weights)
            if batch is None:
                continue
            ids, lengths, anchors = batch
            taps_cat, labels, rows, soft = step_inputs(teacher, c, cfg, ids, anchors, lengths)
            loss, grads = loss_and_grad(head, taps_cat, ids, anchors, lengths, labels, rows, soft)
            optimizer.learning_rate = learning_rate(cfg, step, time.perf_counter() - t0)
            optimizer.update(head, grads)
            mx.eval(head.parameters(), optimizer.state, loss)
            step += 1
            losses.append(loss.item())
            bar.update(task, completed=step, description=f"distill loss {losses[-1]:.3f}")
            entry = {"step": step, "loss": losses[-1], "seconds": round(time.perf_counter() - t0, 2)}
            if step % cfg.eval_every == 0 or step == cfg.steps:
                entry["mean_accept_len"] = evaluate(target, tokenizer, head, held, cap)
                say(f"step {step}: loss {losses[-1]:.3f}, held-out mean accept length {entry['mean_accept_len']:.2f} at cap {cap}")
                if held_rows:
                    entry.update(held_rows_accept(target, head, held_rows, cap, cfg.max_len))
                    _say_held_rows(say, step, entry, len(held_rows))
            log.write(json.dumps(entry) + "\n")
            log.flush()
            if step % cfg.checkpoint_every == 0:
                _save_checkpoint(head, optimizer, ckpt, step)
                # The output directory is a loadable head as of the last checkpoint: a run that
                # dies (a lent machine given back, out of memory) still leaves one to take away.
                _save_loadable(head, c, target, out, cfg.save_dtype)
                saved_at = step
    log.close()
    if saved_at != step:  # the last step, however the loop ended (unless it was just saved)
        _save_checkpoint(head, optimizer, ckpt, step)
        # The final head is written before the held-out evaluation below, not after it: a poller
        # that sees the checkpoint's last step (h200_collect.sh prints it) takes these weights, not
        # the previous checkpoint's (the eleventh round spent a 45 MB poll on those).
        _save_loadable(head, c, target, out, cfg.save_dtype)
    final = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    if final and "mean_accept_len" not in final[-1]:  # stopped by the time budget: measure the head as saved
        final[-1]["mean_accept_len"] = evaluate(target, tokenizer, head, held, cap)
        say(f"step {step}: held-out mean accept length {final[-1]['mean_accept_len']:.2f} at cap {cap}")
        if held_rows:
            final[-1].update(held_rows_accept(target, head, held_rows, cap, cfg.max_len))
            _say_held_rows(say, step, final[-1], len(held_rows))
        (out / "train_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in final))
    accept = next((e["mean_accept_len"] for e in reversed(final) if "mean_accept_len" in e), None)
    write_model_card(out, cfg, c, data, held, final, accept, cap, why, held_rows)
    return out


def write_model_card(out: Path, cfg: DistillConfig, c: DSparkConfig, data, held, log, accept, cap, weights: str = "",
                     held_rows: list[dict] | None = None) -> None:
    sets = sorted({(d["set"], d["set_version"]) for d in data})
    first = sum(e["loss"] for e in log[:10]) / max(1, len(log[:10]))
    last = sum(e["loss"] for e in log[-10:]) / max(1, len(log[-10:]))
    params = sum(v.size for _, v in tree_flatten(DSparkHead(c, c.hidden_size).parameters()))
    forced = next((e for e in reversed(log) if "held_rows_accept" in e), None)
    forced_line = (f"\n- Teacher-forced accept length at cap {cap} on {len(held_rows)} of its own generated rows held out of "
                   f"training ({answer_tokens(held_rows)} answer tokens; lab/block_accept.py): "
                   + (f"{forced['held_rows_path_accept']:.3f} on the decode's path along them (what decoding them reports), "
                      if "held_rows_path_accept" in forced else "")  # a log resumed from before the path was measured
                   + f"{forced['held_rows_accept']:.3f} over every answer position") if held_rows and forced else ""
    (out / "README.md").write_text(f"""# DSpark head for {cfg.model}

Distilled by dspark-lab against the target's own greedy behaviour ({'its greedy prediction at every position' if cfg.labels == 'target' and not cfg.soft_labels else f'its next-token distribution over its {cfg.soft_labels} most likely tokens at every position' if cfg.labels == 'target' else 'the stored next tokens'}{', on its continuations of prompts' if cfg.tokens else ''}{' and on conversations it read (' + cfg.corpus + ')' if cfg.corpus else ''}).

- Command: `{cfg.command or 'dspark-lab distill ...'}`
- Settings: {json.dumps({k: v for k, v in asdict(cfg).items() if k != 'command'})}
- Architecture: DeepSpec-native DSpark, qwen3 backbone, {c.num_hidden_layers} layer(s), block {c.block_size},
  Markov rank {c.markov_rank}, MLP width {c.intermediate_size}, taps {c.target_layer_ids}, mask token {c.mask_token_id}; binds the target's
  embeddings and lm_head (not stored). {params / 1e6:.1f} M parameters.
- Data: {len(data)} sequences, {answer_tokens(data)} continuation tokens, from prompt sets
  {', '.join(f'{n} (version {v})' for n, v in sets)}; {cfg.held_out} prompts per set held out:
  {', '.join(p.id for p in held)}. The sequences are in data.jsonl.
- Training: {len(log)} steps logged; mean loss of the first 10 steps {first:.3f}, of the last 10 {last:.3f}.{chr(10) + '  Data and training forward: ' + weights + '.' if weights else ''}
- Held-out mean accept length at cap {cap}: {accept if accept is None else round(accept, 3)}
  (through `speculative_generate`, greedy, lossless).{forced_line}

Load it with `load_pair(model, this_directory)` or `dspark-lab generate -m MODEL -d THIS_DIR --mode dspark`.
""")
