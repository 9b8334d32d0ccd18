"""Prompt encoding and the text side of generation: stop strings, EOS and streaming.

Only committed tokens (accepted by the target) ever reach the text stream, so a user never
sees a draft that is later taken back. Text that could still turn out to be the start of a
stop string is held back until the next tokens decide it.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..errors import InputError


def encode_prompt(tokenizer, prompt: str | Sequence[int] | list[dict], *, apply_chat_template: bool = True) -> list[int]:
    """Token ids for a prompt: a string (wrapped as one user turn in the chat template when the
    tokenizer has one), a list of chat messages, or ids already tokenized."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, str) and not prompt.strip():
        raise InputError("the prompt is empty; pass some text to continue.")
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise InputError("the prompt is empty; pass some text or at least one chat message.")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if isinstance(prompt, (list, tuple)) and not has_template:
        # A base model has no chat template: its prompt is the messages' text, one per paragraph.
        prompt = "\n\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
        apply_chat_template = False
    if isinstance(prompt, (list, tuple)):
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    elif apply_chat_template and has_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    else:
        ids = tokenizer.encode(prompt)
    if hasattr(ids, "input_ids"):  # transformers may hand back a BatchEncoding
        ids = ids["input_ids"]
    ids = list(ids)
    if not ids:
        raise InputError(f"the prompt {prompt!r} tokenizes to no tokens; this tokenizer cannot represent it. Use other text.")
    return ids


class IncrementalDecoder:
    """Text of a growing token list, always equal to `tokenizer.decode(all tokens)` minus an
    incomplete trailing character, at O(1) decode work per token.

    Decodes only a short window (from a few tokens before the last stable point), so byte-level
    and sentencepiece merges across token boundaries come out exactly as a full decode would."""

    def __init__(self, tokenizer):
        self._decode = tokenizer.decode
        self.tokens: list[int] = []
        self._stable_text = ""  # text up to token index _read
        self._prefix = 0  # window start
        self._read = 0  # tokens covered by _stable_text
        self.text = ""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        prefix_text = self._decode(self.tokens[self._prefix : self._read])
        window_text = self._decode(self.tokens[self._prefix :])
        if len(window_text) > len(prefix_text) and not window_text.endswith("\ufffd"):
            self._stable_text += window_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.tokens)
        self.text = self._stable_text

    def finalize(self) -> None:
        self.text = self._decode(self.tokens)


class TextStream:
    """Turns committed token ids into text, finds stop strings and EOS, streams new text."""

    def __init__(self, tokenizer, stop: Sequence[str] | str | None = None, on_text: Callable[[str], None] | None = None):
        if isinstance(stop, str):
            stop = [stop]
        self.stop = [s for s in (stop or []) if s]
        if stop and len(self.stop) != len(stop):
            raise InputError("stop strings must not be empty.")
        self.on_text = on_text
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
        if not self.eos and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos = {tokenizer.eos_token_id}
        self._detok = IncrementalDecoder(tokenizer)
        self.token_ids: list[int] = []
        self.text = ""  # final text (up to a stop string)
        self._emitted = 0  # chars of the decoded text already passed to on_text
        self.finish_reason: str | None = None

    def add(self, tokens: Sequence[int]) -> bool:
        """Commit tokens in order; True once generation must stop (EOS or a stop string)."""
        for t in tokens:
            if t in self.eos:
                self.finish("stop")
                return True
            self.token_ids.append(t)
            self._detok.add_token(t)
            if self.stop and self._find_stop():
                self.finish_reason = "stop"
                self._emit(final=True)
                return True
        self.text = self._detok.text
        self._emit(final=False)
        return False

    def finish(self, reason: str) -> None:
        """End of generation: flush the detokenizer (a partial UTF-8 sequence, a held-back
        tail) and emit what is left."""
        if self.finish_reason is None:
            self._detok.finalize()
            if self.stop and self._find_stop():
                reason = "stop"
            else:
                self.text = self._detok.text
            self.finish_reason = reason
        self._emit(final=True)

    def _find_stop(self) -> bool:
        """Cut the text at the first stop string, if the decoded text now holds one."""
        text = self._detok.text
        # Only the tail can hold a stop string that the newest token completed.
        start = max(0, len(self.text) - max(map(len, self.stop)))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        self.text = text[: min(hits)] if hits else text
        return bool(hits)

    def _emit(self, final: bool) -> None:
        if self.on_text is None:
            return
        safe = len(self.text)
        if not final and self.stop:
            # Hold back a tail that is a prefix of some stop string.
            for s in self.stop:
                for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:n]):
                        safe = min(safe, len(self.text) - n)
                        break
        if safe > self._emitted:
            self.on_text(self.text[self._emitted : safe])
            self._emitted = safe
