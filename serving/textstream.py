"""Token ids arriving a cycle at a time -> text deltas whose concatenation is exactly the final text.

Each cycle's text is the difference between the decoding of all ids so far and the text already sent. Decoding the
whole sequence (not each chunk alone) keeps tokenizers that merge across tokens (byte-level BPE, SentencePiece's
leading spaces) correct; trailing U+FFFD (a UTF-8 character split across tokens) is held back until the next cycle
completes it. Stop words end the text at their first occurrence, as in TensorRT-LLM; a tail that may
be the start of a stop word is held back, so that no text is ever sent that the stop word would have cut.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop_words: list[str] | None = None):
        self.tok, self.stop_words = tokenizer, [w for w in (stop_words or []) if w]
        self.ids: list[int] = []
        self.sent = ""             # text already handed out
        self.stopped = False       # a stop word was found: the text is final

    def _decode(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True) if self.tok is not None else ""

    def push(self, ids: list[int]) -> str:
        """Add a cycle's tokens; return the new text that can be sent now."""
        self.ids.extend(ids)
        if self.tok is None or self.stopped:
            return ""
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped, text = True, text[:cut]
        else:
            text = text.rstrip("\ufffd")    # an incomplete character: wait for the rest of its bytes
            text = text[:len(text) - self._partial_stop(text)]
        return self._delta(text)

    def finish(self) -> str:
        """The rest of the text once generation has ended (held-back bytes that never completed included)."""
        if self.tok is None or self.stopped:
            return ""
        text = self._decode()
        cut = self._stop_at(text)
        return self._delta(text[:cut] if cut is not None else text)

    def _stop_at(self, text: str) -> int | None:
        """End of the text at the first stop word (the word itself excluded), or None."""
        hits = [i for i in (text.find(w) for w in self.stop_words) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that begins a stop word: held back until it is known whether the
        stop word completes (then it is cut) or not (then it is sent)."""
        return max((k for w in self.stop_words for k in range(1, len(w)) if text.endswith(w[:k])), default=0)

    def _delta(self, text: str) -> str:
        if text.startswith(self.sent):
            delta = text[len(self.sent):]
        else:
            # Decoding more ids rewrote text already sent (a tokenizer quirk); text cannot be taken back, so only
            # the part past what was sent goes out. Streamed text may then differ from a one-shot decode.
            delta = text[len(self.sent):] if len(text) > len(self.sent) else ""
        self.sent += delta
        return delta

    @property
    def text(self) -> str:
        return self.sent
