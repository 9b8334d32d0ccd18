"""The pipelined verify loop: the host builds round r+1 while the device computes round r.

The plain loop (generate.speculative_loop) reads each round's verdict before it builds the next
round, because the next round's inputs (the pending token, the cache length, how many tapped
rows the head's context gains) come from that verdict, so the host's building cannot overlap
the device's computing as it does in plain decoding. (Measured on the H200, docs/performance.md:
removing that wait gained little by itself; the compiled verify this loop runs gained most.)

Here nothing the next round needs is read on the host. The pending token, the target's cache
length and the rows to append stay lazy arrays; caches are written at an array offset
(compiled.ArrayOffsetKV, Target.forward_at, ContextDrafter.append_context_at), so a rejected
draft needs no trim: its rows sit past the new end, hidden by the mask, and the next round
overwrites them. Shapes are fixed by the cap alone, so round r+1 can be built before round r
is known. The host reads round r's verdict one round late and only to stream the text, stop,
and feed the cap controller; a generation that stops throws away the one round in flight.

The head's context length always equals the target's cache length when a block is drafted
(both hold every position except the newest pending token), so one offset serves both.

Output is the same as the plain loop's: the same draft, verify and acceptance rule run on the
same rows. A small draft model drafts the same way (drafters/draft_model.py: its own cache is
written at the same offset). With `lookup_n`, n-gram lookup drafts run on the device too
(DeviceLookup): the committed tokens stay in a device array, and where the newest n of them
occurred before, the tokens that followed then replace the head's drafts slot by slot (the
width stays the cap, so the shapes stay fixed). What is left out: confidence truncation (it changes the verify width
after reading the head); targets with recurrent or sliding-window caches (their state cannot be
rewound by moving an offset).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import mlx.core as mx

from .generate import GenResult, _Clock
from .sampling import SamplingParams, pick_token, verify
from .target import Target
from .text import TextStream


def _round_end(logits: mx.array, drafts: mx.array, offset: mx.array, params: SamplingParams, probs: mx.array | None):
    """A chain round's verdict [n accepted, next token], the next round's offset and pending token,
    and the payload the host reads ([verdict, drafts]), all lazy."""
    verdict = verify(logits, drafts, params, probs)
    return verdict, offset + verdict[0] + 1, verdict[1:].astype(mx.uint32), mx.concatenate([verdict, drafts.astype(mx.int32)])


# Greedy, as one trace (one per draft width): its comparisons, conversions and sums fuse into fewer
# kernels than they launch one by one, and a round on a GPU costs what it launches. Sampling stays
# uncompiled: its random draws would have to be threaded through the trace.
_greedy_round_end = mx.compile(lambda logits, drafts, offset: _round_end(logits, drafts, offset, SamplingParams(), None))


class InFlight:
    """The host's side of a pipelined loop: the prefill, the rounds launched and not yet read, and
    reading each verdict one round late ([accepted n, next token, the drafts the n come from, ...])
    to stream the text and stop. Shared by the chain's loop and the tree's (engine/tree_pipeline.py)."""

    def __init__(self, target: Target, prompt_ids: list[int], params: SamplingParams, drafter, *, max_new_tokens: int,
                 stream: TextStream, on_round: Callable[[int, int, float], None] | None):
        self.clock, self.stream, self.on_round, self.max_new_tokens = _Clock(), stream, on_round, max_new_tokens
        self.cache = target.make_cache()
        prefill = target.forward(mx.array(prompt_ids, dtype=mx.uint32), self.cache, taps=drafter.target_layer_ids, last_only=True)
        first = pick_token(prefill.logits[-1], params)
        drafter.reset()
        drafter.use_kernels_of(target)  # the head's writes and block attention at array positions, as the target's
        drafter.append_context(prefill.taps)
        self.first_token = first.item()
        self.clock.first_token()
        self.done = stream.add([self.first_token])
        self.produced, self.accepts, self.drafted, self.reads, self.forwards = 1, [], [], 1, 1
        self.known_len = len(prompt_ids)  # the cache length after the last round read on the host
        self.rounds: deque = deque()  # (verdict, drafted, built)
        self.last_read = time.perf_counter()

    def launch(self, verdict: mx.array, drafted: int) -> None:
        """A round built (its verdict lazy, already handed to the device)."""
        self.forwards += 1
        self.rounds.append((verdict, drafted, time.perf_counter()))

    def drive(self, build: Callable[[], None], prompt_tokens: int, mode: str) -> GenResult:
        """Keep one round in flight: build round r+1 (`build` launches it), then read round r."""
        if not self.done:
            build()
        while not self.done:
            # Unless the rounds in flight (each commits at least one token) may already finish the job.
            if self.produced + len(self.rounds) < self.max_new_tokens:
                build()
            self.read()  # round r's verdict, read while round r+1 computes
        return self.result(prompt_tokens, mode)

    def most_rows(self) -> int:
        """An upper bound of the rows the rounds in flight commit (each at most its drafts + 1)."""
        return sum(d + 1 for _, d, _ in self.rounds)

    def read(self) -> None:
        """Read the oldest round's verdict (while the next one computes) and commit its tokens."""
        verdict, k, built = self.rounds.popleft()
        read = verdict.tolist()
        self.reads += 1
        # A round's cost is the time between verdicts (rounds overlap, so build-to-read would
        # count the previous round's computing too); the first round has no previous verdict.
        now = time.perf_counter()
        seconds, self.last_read = now - max(built, self.last_read), now
        n, nxt = read[0], read[1]
        self.known_len += n + 1
        new = (read[2 : 2 + n] + [nxt])[: self.max_new_tokens - self.produced]
        self.accepts.append(len(new))
        self.drafted.append(k)
        self.produced += len(new)
        self.done = self.stream.add(new)
        if self.on_round is not None:
            self.on_round(k, len(new), seconds)
        if not self.done and self.produced >= self.max_new_tokens:
            self.stream.finish("length")
            self.done = True

    def result(self, prompt_tokens: int, mode: str) -> GenResult:
        result = self.clock.result(self.stream, prompt_tokens=prompt_tokens, rounds=len(self.accepts), forwards=self.forwards,
                                   accepts=self.accepts, drafts=self.drafted, mode=mode)
        result.host_reads = self.reads
        return result


def pipelined_loop(
    target: Target,
    prompt_ids: list[int],
    params: SamplingParams,
    drafter,
    *,
    max_new_tokens: int,
    cap: int | Callable[[], int],
    stream: TextStream,
    mode: str,
    on_round: Callable[[int, int, float], None] | None = None,
    lookup_n: tuple[int, ...] = (),
    compile_draft: bool = False,
    lookup_kernel=None,
) -> GenResult:
    """Speculative decoding with a DSpark head, or a draft model (drafters.draft_model.PipelinedDraftModel),
    one round always in flight (see module doc).
    `lookup_n`: n-gram lengths for device-side lookup drafts, the longest matching one used (none: head alone).
    `compile_draft`: append the context and draft in one compiled trace (greedy; DSparkDrafter.draft_step_at).
    `lookup_kernel`: a custom kernel for the device-side lookup (see DeviceLookup)."""
    run = InFlight(target, prompt_ids, params, drafter, max_new_tokens=max_new_tokens, stream=stream, on_round=on_round)
    cache, taps = run.cache, drafter.target_layer_ids
    # Device-side state of the next round to build (lazy arrays after the first round).
    pending = mx.array([run.first_token], dtype=mx.uint32)
    offset = mx.array(len(prompt_ids), dtype=mx.int32)  # target cache length == head context length
    rows, rows_at = None, None  # the previous round's tapped rows, and where they go in the head's context
    lookup = DeviceLookup(prompt_ids, lookup_n, kernel=lookup_kernel) if lookup_n else None

    def build() -> None:
        nonlocal pending, offset, rows, rows_at
        k = max(0, min(cap() if callable(cap) else cap, drafter.config.max_drafts))
        # Upper bound of the cache length after this round: each round in flight adds at most its width.
        bound = run.known_len + run.most_rows() + k + 1
        drafter.ensure_capacity(bound + drafter.config.block_size)
        if k:
            draft = drafter.draft_step_at(rows, rows_at, pending, k, params, offset, compiled=compile_draft)
            drafts, probs = draft.tokens.astype(mx.uint32), draft.probs
        else:
            drafter.catch_up_at(rows, rows_at, pending, offset)
            drafts, probs = mx.zeros((0,), dtype=mx.uint32), None
        if lookup is not None:
            drafts, probs = lookup.overlay(pending, offset, drafts, probs, bound)
        out = target.forward_at(mx.concatenate([pending, drafts]), cache, offset, capacity=bound, taps=taps)
        rows, rows_at = out.taps, offset
        if params.greedy:
            _, offset, pending, payload = _greedy_round_end(out.logits, drafts, offset)
        else:
            _, offset, pending, payload = _round_end(out.logits, drafts, offset, params, probs)
        mx.async_eval(payload, offset, pending)
        run.launch(payload, k)

    return run.drive(build, len(prompt_ids), mode)


class DeviceLookup:
    """N-gram lookup drafts without a host read: the committed tokens in a device array.

    Position `at` holds the pending token; every position before it is committed. Where the
    newest n tokens (ending at `at`) also end an earlier window, the latest such window's
    continuation is proposed for the next slots, each slot only where that continuation lies at
    or before `at` (known tokens), like the host's NgramIndex, which proposes the longest n that
    matches. Rows past `at` hold a rejected round's drafts; nothing reads them."""

    CHUNK = 256  # the buffer grows by this many positions (few shapes to build kernels for)

    def __init__(self, prompt_ids: list[int], ns: tuple[int, ...], kernel=None):
        """`kernel`: a custom kernel doing `propose_ops`'s work (engine/kernels.py), used only as
        a probe found it exact and faster on this machine (lab/kernel_probe.py); None: MLX ops."""
        self.ns = tuple(sorted(ns, reverse=True))
        self.kernel = kernel
        self.tokens = mx.array(prompt_ids, dtype=mx.uint32)
        self._back = mx.arange(1 - self.ns[0], 1, dtype=mx.int32)  # the n_max newest positions, relative to the pending one
        self._layout: tuple[mx.array, mx.array, mx.array] | None = None

    def _ensure(self, size: int) -> None:
        have = self.tokens.shape[0]
        if have < size:
            grow = size - have + (-(size - have)) % self.CHUNK
            self.tokens = mx.concatenate([self.tokens, mx.zeros((grow,), dtype=mx.uint32)])

    def _write(self, ids: mx.array, at: mx.array) -> None:
        self.tokens = mx.slice_update(self.tokens, ids, at.reshape(1), axes=(0,))

    def _windows(self, size: int) -> tuple[mx.array, mx.array, mx.array]:
        """(positions (size, n_max), real (size, n_max), follows (size,)): row e lists the n_max
        positions ending at e, clipped at 0 (real: not clipped), and follows[e] = e + 1, where the
        tokens after that window start. Built once per buffer size: constants of the graph."""
        if self._layout is None or self._layout[2].shape[0] != size:
            raw = mx.arange(size, dtype=mx.int32)[:, None] + self._back
            self._layout = (mx.maximum(raw, 0), raw >= 0, mx.arange(1, size + 1, dtype=mx.int32))
            mx.eval(self._layout)
        return self._layout

    def propose(self, at: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """(tokens (k,), usable (k,) bool): the continuation of the longest n-gram match."""
        if self.kernel is not None:
            return self.kernel(self.tokens, at, k)
        return self.propose_ops(at, k)

    def propose_ops(self, at: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """`propose` in MLX operations (the reference a custom kernel is checked against).

        Every n is read off one comparison: row e of `same` says which of the n_max tokens ending
        at e equal the n_max newest ones, and an n-gram ending at e matches where its last n
        columns all do. A few kernels per round, whatever the n-gram lengths (a round is
        launch-bound on a GPU: each kernel costs about as much as the work in it)."""
        size, n_max = self.tokens.shape[0], self.ns[0]
        positions, real, follows = self._windows(size)
        newest = self.tokens[mx.maximum(at + self._back, 0)]
        same = (self.tokens[positions] == newest) & real
        earlier = mx.where(follows <= at, follows, -1)  # windows that end before the pending token
        best = mx.array(-1, dtype=mx.int32)
        for n in self.ns:
            latest = mx.max(mx.where(mx.all(same[:, n_max - n :], axis=1), earlier, -1))
            best = mx.where(best >= 0, best, latest)
        pos = best + mx.arange(k, dtype=mx.int32)
        return self.tokens[mx.clip(pos, 0, size - 1)], (best >= 0) & (pos <= at)

    def propose_after(self, pending: mx.array, at: mx.array, k: int, bound: int) -> tuple[mx.array, mx.array]:
        """Record the pending token at `at` and propose k tokens after it (a tree's lookup branch,
        engine/tree_pipeline.py); `record` then writes the tokens the round kept after it."""
        self._ensure(bound + 1)
        self._write(pending.astype(mx.uint32), at)
        return self.propose(at, k)

    def record(self, ids: mx.array, at: mx.array) -> None:
        """Write tokens from `at` on (lazy): a round's kept drafts, the first past them overwritten next round."""
        self._write(ids.astype(mx.uint32), at)

    def overlay(self, pending: mx.array, at: mx.array, drafts: mx.array, probs: mx.array | None, bound: int):
        """Record the pending token at `at`, put the lookup's tokens over the head's drafts where
        it has some (a one-hot drafter distribution there, for speculative sampling), and record
        the drafts after it (the accepted ones become committed; the next pending overwrites the
        first rejected one)."""
        self._ensure(bound + 1)
        self._write(pending.astype(mx.uint32), at)
        k = drafts.shape[0]
        if k:
            tokens, usable = self.propose(at, k)
            drafts = mx.where(usable, tokens, drafts)
            if probs is not None:
                one_hot = (mx.arange(probs.shape[-1])[None] == drafts[:, None]).astype(probs.dtype)
                probs = mx.where(usable[:, None], one_hot, probs)
            self._write(drafts, at + 1)
        return drafts, probs
