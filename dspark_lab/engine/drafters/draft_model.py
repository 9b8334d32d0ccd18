"""A small language model with the target's tokenizer as the drafter ("draft" mode).

The drafter is a `Target` of its own with its own cache. Its cache always holds a prefix of
the committed sequence, possibly followed by drafted tokens of the current round; `unseen`
holds the committed tokens after that prefix (at least `pending`). A round feeds `unseen` in
one forward and then drafts autoregressively, one token per forward, everything lazy on the
device: the verify loop reads the drafts together with the verdict, in its one host read.

Drafting k tokens feeds only the first k - 1 of them (the last one's successor is never
needed), so after a round the cache holds the committed prefix plus d1..d(k-1). `commit`
keeps the accepted ones among those, drops the rest (trim, or checkpoint-and-replay for
caches that cannot trim), and queues what the drafter has not seen: the accepted draft it
never fed (when all k were accepted) and the target's own next token.

`PipelinedDraftModel` is the same drafter for the pipelined loop (engine/pipeline.py), where
the host never learns a round's verdict before it builds the next: its cache is written at an
array offset, so rejected drafts need no rollback (their rows sit past the new end, hidden by
the mask, and are overwritten), and each round feeds the last committed token again with the
pending one, which covers the one accepted draft it never fed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..generate import Draft, DraftSource
from ..sampling import SamplingParams, sample_rows, target_probs
from ..target import Target
from .dspark import BlockOut


def _fit_width(logits: mx.array, width: int) -> mx.array:
    """Drafter logits with exactly the target's vocabulary width: extra rows (padding a bigger
    embedding matrix) are cut, missing ones are -inf (a token the drafter cannot propose)."""
    have = logits.shape[-1]
    if have > width:
        return logits[..., :width]
    if have < width:
        pad = mx.full((*logits.shape[:-1], width - have), -mx.inf, dtype=logits.dtype)
        return mx.concatenate([logits, pad], axis=-1)
    return logits


def drafter_ids(drafter: Target, ids: mx.array) -> mx.array:
    """Target token ids as the drafter's input. A target id past the drafter's embedding rows
    (unused padding rows of a bigger target) would index out of bounds; clamping only costs the
    drafter a guess."""
    return mx.minimum(ids.astype(mx.uint32), drafter.vocab_size - 1)


def pick_draft(logits: mx.array, params: SamplingParams, width: int):
    """Next draft token from one row of drafter logits, and its distribution over the target's
    `width` tokens (None when greedy): sampled at temperature > 0 from the distribution
    processed exactly as the target's (temperature, top_k, top_p), which verify then needs."""
    logits = _fit_width(logits, width)
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.uint32), None
    q = target_probs(logits[None], params)
    return sample_rows(q)[0].astype(mx.uint32), q[0]


class DraftModelSource(DraftSource):
    """Drafts `cap` tokens per round from a small LM; at temperature > 0 they are sampled from
    the drafter's distribution, processed exactly as the target's (temperature, top_k, top_p),
    and that distribution goes to `verify` as `Draft.probs`."""

    def __init__(self, drafter: Target, vocab_width: int):
        self.drafter = drafter
        self.width = vocab_width  # the target's logit width: verify subtracts q from p row-wise
        self.cache: list | None = None
        self.unseen: list[int] = []
        self.fed: mx.array | None = None  # drafted tokens fed to the drafter this round
        self.snap = None  # pre-drafting state, for caches that cannot trim

    def start(self, prompt_ids, prompt_taps):
        self.cache = self.drafter.make_cache()
        self.unseen, self.fed, self.snap = [], None, None
        # Only the cache matters; the logits of this forward are never read.
        self.drafter.forward(self._ids(prompt_ids), self.cache, last_only=True)

    def _ids(self, ids: list[int]) -> mx.array:
        return drafter_ids(self.drafter, mx.array(ids, dtype=mx.uint32))

    def _pick(self, logits: mx.array, params: SamplingParams):
        return pick_draft(logits, params, self.width)

    def propose(self, pending, cap, params):
        self.fed, self.snap = None, None
        if cap <= 0:
            return Draft([])  # nothing fed: `unseen` waits for the next round
        # Everything committed since the last round, in one forward (its last token is `pending`).
        out = self.drafter.forward(self._ids(self.unseen), self.cache, last_only=True)
        self.unseen = []
        token, q = self._pick(out.logits[-1], params)
        tokens, probs = [token], [q]
        if cap > 1:
            # Taken after `unseen` went in: a rollback keeps that, and drops only drafts.
            self.snap = self.drafter.checkpoint(self.cache)
        for _ in range(cap - 1):
            mx.async_eval(token)  # start the device on this step while the host builds the next
            out = self.drafter.forward(token.reshape(1), self.cache, last_only=True)
            token, q = self._pick(out.logits[-1], params)
            tokens.append(token)
            probs.append(q)
        drafts = mx.stack(tokens)
        self.fed = drafts[:-1] if cap > 1 else None
        return Draft(drafts, None if params.greedy else mx.stack(probs))

    def commit(self, tokens, taps):
        fed = 0 if self.fed is None else int(self.fed.shape[0])
        # tokens = accepted drafts + the target's own token: len(tokens) - 1 drafts were accepted.
        keep = min(len(tokens) - 1, fed) if fed else 0
        if fed:
            self.drafter.rewind(self.cache, self.snap, self.fed, keep)
        self.fed, self.snap = None, None
        self.unseen += tokens[keep:]


@dataclass(frozen=True)
class DraftLimits:
    """What the pipelined loop asks of a drafter's config: the most drafts a round may take,
    and how many rows past the cache bound it writes (a draft model: none past its drafts)."""

    max_drafts: int
    block_size: int = 1


class PipelinedDraftModel:
    """A draft model in the pipelined loop's drafter interface (DSparkDrafter's `draft_step_at`,
    `catch_up_at`, `ensure_capacity`), for one generation of `prompt_ids`.

    Nothing is read on the host. The cache is written at the round's offset (an int32 array,
    the target's cache length), like the target's. A round of cap k feeds the committed token
    at offset - 1 together with the pending token (width 2, at offset - 1), drafts d1, then
    feeds d1..d(k-1) one per forward. After the verdict every committed row is in the cache but
    possibly the last (d_k, accepted when the whole draft was), which the next round's first
    forward writes, since it always starts one row back. Rows of rejected drafts lie past the
    new offset: the mask hides them until they are overwritten. Lookup drafts cannot overlay a
    draft model's slots here: the rows it fed would then not be the committed tokens."""

    kind = "draft"
    target_layer_ids: tuple = ()  # it reads token ids, not the target's hidden states

    def __init__(self, drafter: Target, vocab_width: int, prompt_ids: list[int], max_drafts: int):
        self.drafter = drafter
        self.width = vocab_width
        self.config = DraftLimits(max_drafts=max_drafts)
        self.prompt_ids = list(prompt_ids)
        self.capacity = len(prompt_ids) + 1
        self.cache: list | None = None
        self.fed: mx.array | None = None  # the last round's [pending, drafts...]: the committed token at offset - 1 is one of them
        self.fed_at: mx.array | None = None  # where fed[0] sits

    def reset(self) -> None:
        """Prefill the prompt but its last token (the first round feeds that one again)."""
        self.cache = self.drafter.make_cache()
        head = self.prompt_ids[:-1]
        if head:
            self.drafter.forward(drafter_ids(self.drafter, mx.array(head, dtype=mx.uint32)), self.cache, last_only=True)
        self.fed = mx.array(self.prompt_ids[-1:], dtype=mx.uint32)
        self.fed_at = mx.array(len(self.prompt_ids) - 1, dtype=mx.int32)

    def append_context(self, taps) -> None:
        """Nothing to append: the prefill's tokens went in at `reset`."""

    def use_kernels_of(self, target) -> None:
        """The target's kernels are not taken: the draft model's forwards write and attend with its
        own (Target.write_cache_with and route_attention on the draft model)."""

    def ensure_capacity(self, size: int) -> None:
        self.capacity = max(self.capacity, size)

    def _feed_back(self, pending: mx.array, at: mx.array) -> mx.array:
        """Feed [committed token at at - 1, pending] at at - 1; the logits of the pending row."""
        previous = mx.take(self.fed, (at - 1 - self.fed_at).reshape(1))
        out = self.drafter.forward_at(drafter_ids(self.drafter, mx.concatenate([previous, pending])), self.cache, at - 1, capacity=self.capacity)
        return out.logits[-1]

    def catch_up_at(self, rows, rows_at, pending: mx.array, at: mx.array) -> None:
        """A round of cap 0: no drafts, but the cache still takes the newest committed token."""
        self._feed_back(pending, at)
        self.fed, self.fed_at = pending, at

    def draft_step_at(self, rows, rows_at, pending: mx.array, cap: int, params: SamplingParams, at: mx.array,
                      *, compiled: bool = False) -> BlockOut:
        """`cap` drafts after `pending` (at position `at`), lazily; `rows`/`compiled` are the
        head's and unused (the forwards run the drafter's own compiled decode traces)."""
        token, q = pick_draft(self._feed_back(pending, at), params, self.width)
        tokens, probs = [token], [q]
        for i in range(1, cap):
            out = self.drafter.forward_at(drafter_ids(self.drafter, token.reshape(1)), self.cache, at + i, capacity=self.capacity)
            token, q = pick_draft(out.logits[-1], params, self.width)
            tokens.append(token)
            probs.append(q)
        drafts = mx.stack(tokens)
        self.fed, self.fed_at = mx.concatenate([pending, drafts]), at
        return BlockOut(drafts, None if params.greedy else mx.stack(probs), None)
