"""Plain decoding and the speculative verify loop.

State between rounds: the target cache holds the prompt and every output token except the
newest one, `pending`. A round drafts k tokens, feeds `[pending] + drafts` to the target in one
forward, keeps the longest accepted prefix plus the target's own next token, and trims the
k - n rejected positions from the cache. Output is therefore exactly what the target alone
would produce (greedy) or an exact sample of it (temperature > 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx

from ..errors import InputError
from .drafters.lookup import LookupConfig, NgramIndex
from .sampling import SamplingParams, pick_token, verify
from .target import Target
from .text import TextStream, encode_prompt


@dataclass
class GenResult:
    text: str
    token_ids: list[int]
    num_tokens: int
    num_rounds: int  # target forwards after prefill (each commits >= 1 token)
    target_forwards: int  # all target forwards, prefill included
    accept_lengths: list[int]  # tokens committed per round (accepted drafts + the target's own)
    mean_accept_len: float
    tokens_per_sec: float  # num_tokens / wall time including prefill
    decode_tokens_per_sec: float  # tokens after the first / time after the first token
    prefill_seconds: float
    ttft_seconds: float
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    prompt_tokens: int = 0
    draft_lengths: list[int] = field(default_factory=list)  # tokens drafted per round
    mode: str = "baseline"
    host_reads: int = 0  # device -> host synchronizations (prefill's included)

    def per_position_acceptance(self) -> list[float]:
        """d_i: of the rounds that drafted at least i+1 tokens, the share that accepted them."""
        return position_acceptance(self.accept_lengths, self.draft_lengths)


def position_acceptance(accept_lengths: list[int], draft_lengths: list[int]) -> list[float]:
    """GenResult.per_position_acceptance over any rounds (e.g. several generations' pooled)."""
    out = []
    for i in range(max(draft_lengths, default=0)):
        tried = [a - 1 for a, d in zip(accept_lengths, draft_lengths) if d > i]
        out.append(sum(1 for a in tried if a > i) / len(tried))
    return out


def check_max_new_tokens(max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")


class _Clock:
    """Wall times for GenResult: start, first token, end."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def first_token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def result(self, stream: TextStream, *, prompt_tokens, rounds, forwards, accepts, drafts, mode) -> GenResult:
        end = time.perf_counter()
        first = self.first or end
        n = len(stream.token_ids)
        total, decode = end - self.start, end - first
        return GenResult(
            text=stream.text,
            token_ids=list(stream.token_ids),
            num_tokens=n,
            num_rounds=rounds,
            target_forwards=forwards,
            accept_lengths=accepts,
            mean_accept_len=(sum(accepts) / len(accepts)) if accepts else 0.0,
            tokens_per_sec=n / total if total > 0 else 0.0,
            decode_tokens_per_sec=(n - 1) / decode if n > 1 and decode > 0 else 0.0,
            prefill_seconds=first - self.start,
            ttft_seconds=first - self.start,
            finish_reason=stream.finish_reason or "length",
            prompt_tokens=prompt_tokens,
            draft_lengths=drafts,
            mode=mode,
        )


def _setup(target, tokenizer, prompt, max_new_tokens, temperature, top_p, top_k, seed, apply_chat_template):
    check_max_new_tokens(max_new_tokens)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    prompt_ids = encode_prompt(tokenizer, prompt, apply_chat_template=apply_chat_template)
    if params.seed is not None:
        mx.random.seed(params.seed)
    return params, prompt_ids


def greedy_generate(
    target: Target,
    tokenizer,
    prompt: str | Sequence[int] | list[dict],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] | str | None = None,
    on_text: Callable[[str], None] | None = None,
    apply_chat_template: bool = True,
    compiled_step: bool = False,
) -> GenResult:
    """Plain one-token-per-forward decoding, pipelined: step t+1 is scheduled on the device
    (`mx.async_eval`) before the host reads token t, so the host never leaves the GPU idle.

    `compiled_step`: each one-token step replays the target's compiled array-offset forward
    (Target.forward_at's trace, its one-row attention through the target's attention route where
    one is set: Target.route_attention) instead of building the step's graph op by op. With
    engine/attention_kernel.py routed, on an H100 that decoded 1.07-1.10x faster than the plain
    step; compiled with MLX's own attention (its unfused one-row path over a masked buffer), 0.83-0.85x
    (docs/performance.md, forty-first round). Models whose caches are not plain KV caches step
    plainly."""
    params, prompt_ids = _setup(target, tokenizer, prompt, max_new_tokens, temperature, top_p, top_k, seed, apply_chat_template)
    stream = TextStream(tokenizer, stop, on_text)
    clock = _Clock()
    cache = target.make_cache()
    compiled_step = compiled_step and target.can_pipeline(cache)
    bound = len(prompt_ids) + max_new_tokens + 1  # the buffers' size: every step's position lies below it
    offset = None  # compiled_step: where the next token's keys and values go, on the device

    def step(ids, last_only=False):
        nonlocal offset
        if compiled_step and offset is not None:
            logits = target.forward_at(ids, cache, offset, capacity=bound).logits
            offset = offset + 1
            return pick_token(logits[-1], params)
        out = target.forward(ids, cache, last_only=last_only)
        if compiled_step:  # after the prefill, the host's offset is where the device's starts
            offset = mx.array(cache[0].offset, dtype=mx.int32)
        return pick_token(out.logits[-1], params)

    y = step(mx.array(prompt_ids, dtype=mx.uint32), last_only=True)
    mx.async_eval(y)
    forwards, reads = 1, 0
    while True:
        if len(stream.token_ids) + 1 < max_new_tokens:
            y_next = step(y.reshape(1))
            mx.async_eval(y_next)
            forwards += 1
        else:
            y_next = None
        token = y.item()
        reads += 1
        clock.first_token()
        if stream.add([token]):
            break
        if y_next is None:
            stream.finish("length")
            break
        y = y_next
    rounds = reads - 1  # tokens after the first each came from one decode forward
    return clock.result(stream, prompt_tokens=len(prompt_ids), rounds=rounds, forwards=forwards,
                        accepts=[1] * rounds, drafts=[0] * rounds, mode="baseline")


@dataclass
class Draft:
    """One round's proposal. `tokens` is a host list (lookup) or a lazy device array (a model
    drafter: reading it would cost a host sync, so it is read together with the verdict).
    `probs` (k, vocab) is the drafter's distribution at temperature > 0, None for one-hot."""

    tokens: list[int] | mx.array
    probs: mx.array | None = None

    def __len__(self) -> int:
        return len(self.tokens) if isinstance(self.tokens, list) else int(self.tokens.shape[0])


class DraftSource:
    """What proposes tokens each round. Lookup needs no tap; a model drafter lists the target
    layers it reads (`taps`) and is handed their rows for every committed token."""

    taps: tuple[int, ...] = ()

    def start(self, prompt_ids: list[int], prompt_taps: dict[int, mx.array]) -> None:
        """Called once after prefill with the prompt's tapped rows (lazy)."""

    def propose(self, pending: int, cap: int, params: SamplingParams) -> Draft:
        raise NotImplementedError

    def commit(self, tokens: list[int], taps: dict[int, mx.array]) -> None:
        """The round committed `tokens` (accepted drafts + the target's own next token);
        `taps` holds the target's rows for the positions that entered its cache this round
        (pending + accepted drafts)."""


class LookupSource(DraftSource):
    def __init__(self, config: LookupConfig):
        self.config = config
        self.index: NgramIndex | None = None

    def start(self, prompt_ids, prompt_taps):
        self.index = NgramIndex(prompt_ids, self.config)

    def propose(self, pending, cap, params):
        return Draft(self.index.propose(cap))

    def commit(self, tokens, taps):
        self.index.extend(tokens)


def cap_schedule(cap_controller, fixed: int, limit: int):
    """(cap, on_round) for speculative_loop: a fixed cap, or a controller asked before every
    round (bounded by `limit`) and told how each round went."""
    if cap_controller is None:
        return fixed, None
    return (lambda: min(cap_controller.cap(), limit)), cap_controller.observe


def prefill_and_start(target: Target, prompt_ids: list[int], params: SamplingParams, source: DraftSource,
                      stream: TextStream, clock: _Clock) -> tuple[list, int, bool]:
    """A verify loop's start: the prompt through the target (with the source's taps) into a fresh
    cache, the first token picked (one host read) and given to the stream and the source, which
    is started on the prompt's rows. Returns (cache, the first token, whether the stream is done)."""
    cache = target.make_cache()
    prefill = target.forward(mx.array(prompt_ids, dtype=mx.uint32), cache, taps=source.taps, last_only=True)
    first = pick_token(prefill.logits[-1], params)
    source.start(prompt_ids, prefill.taps)
    pending = first.item()
    clock.first_token()
    done = stream.add([pending])
    source.commit([pending], {})
    return cache, pending, done


def speculative_loop(
    target: Target,
    prompt_ids: list[int],
    params: SamplingParams,
    source: DraftSource,
    *,
    max_new_tokens: int,
    cap: int | Callable[[], int],
    stream: TextStream,
    mode: str,
    on_round: Callable[[int, int, float], None] | None = None,
) -> GenResult:
    """The verify loop every drafter shares. A round: the source drafts up to `cap` tokens;
    `[pending] + drafts` goes through the target in ONE forward (with the source's taps); the
    verdict and any device-side drafts are read back in ONE host read; the cache is trimmed
    of the rejected positions and the source is told what was committed.

    `cap` may be a callable (a cap controller) asked before every round; `on_round(drafted,
    committed, seconds)` reports each round back to it."""
    clock = _Clock()
    cache, pending, done = prefill_and_start(target, prompt_ids, params, source, stream, clock)
    forwards, accepts, drafted, host_reads = 1, [], [], 1
    produced = 1
    while not done and produced < max_new_tokens:
        t0 = time.perf_counter()
        # Never draft past the length limit: the last round may commit at most `room` tokens.
        room = max_new_tokens - produced
        want = cap() if callable(cap) else cap
        draft = source.propose(pending, max(0, min(want, room - 1)), params)
        k = len(draft)
        on_host = isinstance(draft.tokens, list)
        drafts = mx.array(draft.tokens, dtype=mx.uint32) if on_host else draft.tokens.astype(mx.uint32)
        ids = mx.concatenate([mx.array([pending], dtype=mx.uint32), drafts])
        snap = target.checkpoint(cache) if k else None
        out = target.forward(ids, cache, taps=source.taps)
        verdict = verify(out.logits, drafts, params, draft.probs)
        if not on_host and k:
            verdict = mx.concatenate([verdict, drafts.astype(mx.int32)])
        read = verdict.tolist()  # the round's one host read
        host_reads += 1
        n, nxt = read[0], read[1]
        tokens = draft.tokens[:n] if on_host else read[2 : 2 + n]
        forwards += 1
        target.rewind(cache, snap, ids, n + 1)
        new = tokens + [nxt]
        source.commit(new, {t: rows[: n + 1] for t, rows in out.taps.items()})
        accepts.append(len(new))
        drafted.append(k)
        produced += len(new)
        pending = nxt
        done = stream.add(new)
        if on_round is not None:
            on_round(k, len(new), time.perf_counter() - t0)
    if not done:
        stream.finish("length")
    result = clock.result(stream, prompt_tokens=len(prompt_ids), rounds=forwards - 1, forwards=forwards,
                          accepts=accepts, drafts=drafted, mode=mode)
    result.host_reads = host_reads
    return result


def lookup_generate(
    target: Target,
    tokenizer,
    prompt: str | Sequence[int] | list[dict],
    *,
    max_new_tokens: int = 256,
    max_draft_tokens: int = 8,
    min_n: int = 2,
    max_n: int = 4,
    cap_controller=None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] | str | None = None,
    on_text: Callable[[str], None] | None = None,
    apply_chat_template: bool = True,
) -> GenResult:
    """Speculative decoding with n-gram lookup over prompt and output as the drafter."""
    params, prompt_ids = _setup(target, tokenizer, prompt, max_new_tokens, temperature, top_p, top_k, seed, apply_chat_template)
    if max_draft_tokens < 1:
        raise InputError(f"max_draft_tokens must be >= 1 for lookup, got {max_draft_tokens}.")
    try:
        config = LookupConfig(min_n=min_n, max_n=max_n, max_draft=max_draft_tokens)
    except ValueError as e:
        raise InputError(str(e)) from e
    cap, on_round = cap_schedule(cap_controller, max_draft_tokens, max_draft_tokens)
    return speculative_loop(
        target, prompt_ids, params, LookupSource(config), max_new_tokens=max_new_tokens, cap=cap,
        stream=TextStream(tokenizer, stop, on_text), mode="lookup", on_round=on_round,
    )
