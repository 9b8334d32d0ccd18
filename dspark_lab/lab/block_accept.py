"""Teacher-forced accept length: how many of a DSpark head's drafts greedy verification would
accept at every position of text the target wrote greedily, from one target forward and one head
pass per row instead of a decode per prompt.

At an anchor a (a committed token whose context before it the drafter has) the head drafts token
j for position a + j + 1. Greedy verification accepts draft j when it and every draft before it
are the target's greedy tokens there. On the target's own greedy text those are the stored
tokens, and the target's predictions come from one forward over the row
(`Target.taps_and_predictions`); the head's teacher-forced block is the block inference drafts
from the same context (`distill._block_forward`, tests/test_distill.py). So

    accepted(a) = the number of leading drafts j < cap with draft_j == label[a + j],

and that round commits accepted + 1 tokens (tests/test_block_accept.py checks this against
`speculative_generate`'s rounds, anchor by anchor). Every answer position is an anchor, not only
those a decode happens to visit: a few hundred rows give tens of thousands of anchors, and two
heads compared on the same rows differ by far less noise than 8 prompts' decodes allow
(docs/performance.md: checkpoints of one head moved by up to 0.29 a prompt). An anchor whose next
cap - 1 stored tokens leave the target's greedy path (a tie the row's writer broke the other way,
text it did not write greedily) is skipped: inference would verify other tokens there.

The mean over every anchor is not a decode's mean accept length: a decode starts its next round
where the last one ended, so it visits an easy stretch in a few long rounds and a hard one in
many short ones, and every anchor weighs the easy stretches more. `RowAccept.path` follows the
decode instead (round 0 at the first answer token, each next one `accepted + 1` tokens on), so
its mean is what `speculative_generate` would report on this row; where the row leaves the
target's greedy path (an anchor skipped above) it goes on from the next anchor that is on it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import InputError
from .distill import _block_forward

ANCHORS_PER_PASS = 512  # anchors per head pass over one row (its block attention grows with anchors x length)


@dataclass
class RowAccept:
    """One head's teacher-forced result on one row: each anchor's accepted drafts, from which the
    sums, the per-position counts and the decode's path are derived."""

    prompt_id: str
    set: str
    cap: int  # drafts checked at each anchor
    offsets: list[int] = field(default_factory=list)  # each anchor's distance from the first answer token
    per_anchor: list[int] = field(default_factory=list)  # each anchor's accepted drafts

    @property
    def anchors(self) -> int:
        return len(self.offsets)

    @property
    def accepted(self) -> int:
        """Accepted drafts summed over the anchors."""
        return sum(self.per_anchor)

    @property
    def through(self) -> list[int]:
        """Anchors whose drafts 0..j were all accepted, per j (accepts are leading runs)."""
        return [sum(n > j for n in self.per_anchor) for j in range(self.cap)]

    @property
    def path(self) -> list[int]:
        """Accepted drafts per round of a decode along the row (decode_path)."""
        return decode_path(self.offsets, self.per_anchor)

    @property
    def mean_accept(self) -> float:
        """Tokens a round commits at this row's anchors, on average (accepted drafts + 1)."""
        return 1 + self.accepted / self.anchors if self.anchors else float("nan")

    def first(self, answer_tokens: int) -> "RowAccept":
        """This row measured on its first `answer_tokens` answer tokens only: the anchors whose
        drafts all fall among them. The head is bidirectional within a block and the target
        causal, so an anchor's drafts and labels do not depend on what follows its block: this is
        exactly what measuring the cut row gives (unless --max-len cut the whole row's prompt)."""
        keep = [i for i, o in enumerate(self.offsets) if o <= answer_tokens - self.cap]
        return RowAccept(self.prompt_id, self.set, self.cap, [self.offsets[i] for i in keep], [self.per_anchor[i] for i in keep])

    @property
    def path_mean_accept(self) -> float:
        """Tokens a round commits on the decode's path along this row, on average."""
        path = self.path
        return 1 + sum(path) / len(path) if path else float("nan")


def on_path_anchors(ids: list[int], labels: list[int], start: int, cap: int) -> list[int]:
    """Anchors a >= start whose drafts 0..cap-1 can all be checked: label[a + cap - 1] exists and the
    stored tokens a+1 .. a+cap-1 are the target's greedy tokens (label[a .. a+cap-2])."""
    n = len(ids)
    off = [i for i in range(n - 1) if ids[i + 1] != labels[i]]  # positions whose stored next token is off the path
    good = []
    j = 0
    for a in range(start, n - cap + 1):
        while j < len(off) and off[j] < a:
            j += 1
        if j == len(off) or off[j] > a + cap - 2:
            good.append(a)
    return good


def decode_path_rounds(anchors: list[int], accepted: list[int]) -> list[tuple[int, int]]:
    """The rounds a greedy decode would run along a row, given each anchor's accepted drafts
    (`anchors` ascending, the first the first answer token's): round 0 drafts at the first anchor
    and each round's next starts `accepted + 1` tokens on, or at the next anchor after that where
    the row left the target's greedy path there. (anchor, accepted drafts) per round."""
    rounds, i = [], 0
    while i < len(anchors):
        rounds.append((anchors[i], accepted[i]))
        i = bisect.bisect_left(anchors, anchors[i] + accepted[i] + 1, lo=i + 1)
    return rounds


def decode_path(anchors: list[int], accepted: list[int]) -> list[int]:
    """The accepted drafts of each round of decode_path_rounds."""
    return [n for _, n in decode_path_rounds(anchors, accepted)]


def _refuse_causal(drafter) -> None:
    if drafter.config.causal:
        raise InputError(f"{drafter.name or 'this head'} has a causal block (DFlash lineage): the teacher-forced accept "
                         "length covers DSpark heads with a bidirectional block; measure it by decoding (lossless_check.py).")


def accepted_at(target, drafter, ids: list[int], anchors: list[int], cap: int, labels: mx.array | None = None,
                taps: dict | None = None, ctx: mx.array | None = None) -> mx.array:
    """(A, cap) 0/1: draft j at each anchor accepted (it and every draft before it are the target's
    greedy tokens). `labels`/`taps`: the target's forward over `ids`, when the caller has it;
    `ctx`: the head's fusion of those taps, when the caller measures the row in several passes."""
    c = drafter.config
    _refuse_causal(drafter)
    cap = min(cap, c.max_drafts)
    x = mx.array([ids], dtype=mx.uint32)
    if labels is None or taps is None:
        taps, labels = target.taps_and_predictions(x, c.target_layer_ids)
    if ctx is None:
        ctx = drafter.fuse(taps)  # (1, L, H)
    a = mx.array([anchors], dtype=mx.int32)
    h = _block_forward(drafter.head, c, drafter.embed, ctx, x, a)[0, :, c.logits_start : c.logits_start + cap]  # (A, cap, H)
    logits = drafter.vocab_logits(h)
    pos = a[0][:, None] + mx.arange(cap)  # (A, cap): draft j is checked against label[a + j]
    want = labels[0][pos]
    markov = getattr(drafter.head, "markov_head", None)
    if markov is not None:  # prev_0 = the anchor's token, prev_j = draft j-1, which counts only where it was the label
        prev = mx.concatenate([x[0][a[0]][:, None], want[:, :-1]], axis=1)
        logits = logits + markov.markov_w2(markov.markov_w1(prev))
    drafts = drafter._to_target_ids(mx.argmax(logits, axis=-1).astype(mx.uint32))
    return mx.cumprod((drafts == want).astype(mx.int32), axis=-1)


def row_accept(target, drafter, row: dict, cap: int, max_len: int = 1024) -> RowAccept:
    """The teacher-forced accept length over one row's answer (the target's continuation)."""
    return row_accepts(target, [drafter], row, cap, max_len)[0]


def row_accepts(target, drafters: list, row: dict, cap: int, max_len: int = 1024) -> list[RowAccept]:
    """`row_accept` for each of several heads, from one target forward over the row (its taps
    for every head's layers at once): comparing heads costs one head pass more per head, not
    one target forward more."""
    for drafter in drafters:  # before the forward, and whether or not the row has an anchor
        _refuse_causal(drafter)
    ids = list(row["ids"])[-max_len:]
    start = max(1, row["prompt_len"] - (len(row["ids"]) - len(ids)))  # the first answer token: the first round's anchor
    x = mx.array([ids], dtype=mx.uint32)
    layers = sorted({t for d in drafters for t in d.config.target_layer_ids})
    taps, labels = target.taps_and_predictions(x, layers)
    path_labels = labels[0].tolist()
    out = []
    for drafter in drafters:
        head_cap = min(cap, drafter.config.max_drafts)
        anchors = on_path_anchors(ids, path_labels, start, head_cap)
        per_anchor = []
        ctx = drafter.fuse(taps) if anchors else None  # once per head: a long row takes several passes
        for i in range(0, len(anchors), ANCHORS_PER_PASS):
            got = accepted_at(target, drafter, ids, anchors[i : i + ANCHORS_PER_PASS], head_cap, labels, taps, ctx)
            per_anchor += got.sum(axis=1).tolist()
        out.append(RowAccept(str(row.get("prompt_id", "")), str(row.get("set", "")), head_cap, [a - start for a in anchors], per_anchor))
    return out


def mean_accept(rows: list[RowAccept]) -> float:
    """Over every anchor of the rows (not a mean of row means)."""
    n = sum(r.anchors for r in rows)
    return 1 + sum(r.accepted for r in rows) / n if n else float("nan")


def path_mean_accept(rows: list[RowAccept]) -> float:
    """Over every round of the decode paths along the rows: what decoding them would report."""
    n = sum(len(r.path) for r in rows)
    return 1 + sum(sum(r.path) for r in rows) / n if n else float("nan")


def decode_rounds(target, tokenizer, drafter, prompt, cap: int, max_new_tokens: int) -> tuple[list[int], list[int], dict]:
    """Decode `prompt` greedily with the head (no lookup drafts), then count the teacher-forced
    accepts at the anchors its rounds started from, on the decoded text: (the decode's accepted
    drafts per round, the teacher-forced counts), for every round that drafted `cap` tokens with
    `cap` labels after its anchor, and the decoded text as a row ({"ids", "prompt_len"}: the
    rows `row_accepts` measures). They agree wherever no draft's verdict hangs on a near-tie of
    the target's logits (a verify of another width can order a tie the other way)."""
    from ..engine.speculative import speculative_generate
    from ..engine.text import encode_prompt

    ids = encode_prompt(tokenizer, prompt)  # ids already tokenized come back as they are
    r = speculative_generate(target, tokenizer, drafter, ids, max_new_tokens=max_new_tokens, max_draft_tokens=cap, lookup_drafts=False)
    full = ids + r.token_ids
    anchors, rounds, a = [], [], len(ids)  # round 0 drafts after the first generated token
    for accepted, drafted in zip(r.accept_lengths, r.draft_lengths):
        if drafted == cap and a + cap - 1 <= len(full) - 1:
            anchors.append(a)
            rounds.append(accepted - 1)
        a += accepted
    counted = accepted_at(target, drafter, full, anchors, cap).sum(axis=-1).tolist() if anchors else []
    return rounds, counted, {"ids": full, "prompt_len": len(ids)}
