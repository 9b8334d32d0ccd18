"""Drafter-free n-gram lookup ("prompt lookup decoding").

When the newest n tokens occurred earlier in the prompt or the output, guess that what
followed them then follows them again. Costs no model and pays on copy-heavy work (editing
code, quoting, structured output). A longer match is stronger evidence, so it earns a longer
draft: `draft_per_match` tokens per matched token, capped at `max_draft`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LookupConfig:
    min_n: int = 2  # shortest suffix that may trigger a draft
    max_n: int = 4  # longest suffix looked up in the index
    max_draft: int = 8  # most tokens drafted in one round
    draft_per_match: float = 2.0  # draft length per matched token
    max_match: int = 32  # how far back a match is extended to measure its strength

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"lookup needs 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}.")
        if self.max_draft < 1:
            raise ValueError(f"lookup max_draft must be >= 1, got {self.max_draft}.")


class NgramIndex:
    """Incremental index from each n-gram (min_n..max_n) to where it last ended.

    The index lags one token behind the sequence, so a query for the current suffix finds an
    earlier occurrence, never the suffix itself."""

    def __init__(self, tokens: list[int], config: LookupConfig = LookupConfig()):
        self.config = config
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens) - 1  # register n-grams ending just before the newest token
            for n in range(self.config.min_n, self.config.max_n + 1):
                if end - n >= 0:
                    self._last_end[tuple(self.tokens[end - n : end])] = end

    def propose(self, cap: int | None = None) -> list[int]:
        """Draft tokens continuing the current sequence, or [] when no suffix matches."""
        cfg, toks = self.config, self.tokens
        cap = cfg.max_draft if cap is None else min(cap, cfg.max_draft)
        if cap <= 0:
            return []
        for n in range(min(cfg.max_n, len(toks)), cfg.min_n - 1, -1):
            start = self._last_end.get(tuple(toks[len(toks) - n :]))
            if start is None:
                continue
            # Measure the whole match, not just the indexed n, to scale the draft length.
            match = n
            while match < cfg.max_match and start - match - 1 >= 0 and toks[start - match - 1] == toks[-match - 1]:
                match += 1
            k = min(cap, max(1, int(match * cfg.draft_per_match)))
            return toks[start : start + k]
        return []
