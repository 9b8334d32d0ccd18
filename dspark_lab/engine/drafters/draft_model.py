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
"""

from __future__ import annotations

import mlx.core as mx

from ..generate import Draft, DraftSource
from ..sampling import SamplingParams, sample_rows, target_probs
from ..target import Target


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
        # A target id past the drafter's embedding rows (unused padding rows of a bigger
        # target) would index out of bounds; clamping only costs the drafter a guess.
        top = self.drafter.vocab_size - 1
        return mx.array([min(t, top) for t in ids], dtype=mx.uint32)

    def _pick(self, logits: mx.array, params: SamplingParams):
        """Next draft token from one row of logits, and its distribution (None when greedy)."""
        logits = _fit_width(logits, self.width)
        if params.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.uint32), None
        q = target_probs(logits[None], params)
        return sample_rows(q)[0].astype(mx.uint32), q[0]

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
