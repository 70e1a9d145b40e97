"""Incremental detokenisation and stop-sequence matching, per sequence. No torch.

Token texts are emitted so that their concatenation is exactly the generated text: a token
whose bytes end mid-character waits for the next one, and spaces that a tokenizer only
renders in context (SentencePiece's leading "▁") are kept by decoding with a few tokens of
left context (the approach of TGI and vLLM).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop_sequences=(), context: int = 5):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-context:])
        self.prefix = 0                  # ids[prefix:read] is context already emitted
        self.read = len(self.ids)
        self.text = ""                   # generated text emitted so far
        self.stops = tuple(stop_sequences)
        self._longest_stop = max((len(s) for s in self.stops), default=0)
        self.stopped = False

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append a generated token; returns the new text it completes ('' if it is pending).
        When a stop sequence appears, the text is cut right after it and `stopped` is set."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before):]
        # Keep the window short: the last emitted tokens are all the context we need.
        self.prefix, self.read = self.read, len(self.ids)
        if len(self.ids) > 64:
            drop = self.prefix
            self.ids, self.prefix, self.read = self.ids[drop:], 0, self.read - drop
        return self._append(new)

    def flush(self) -> str:
        """Text still pending at the end (an incomplete character is rendered as U+FFFD)."""
        if self.read >= len(self.ids) or self.stopped:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.read = len(self.ids)
        return self._append(after[len(before):]) if len(after) > len(before) else ""

    def _append(self, new: str) -> str:
        if self.stops and not self.stopped:
            start = max(0, len(self.text) - self._longest_stop + 1)
            window = self.text[start:] + new
            hits = [window.find(s) + len(s) for s in self.stops if s in window]
            if hits:
                cut = start + min(hits) - len(self.text)   # where the stop sequence ends in `new`
                new = new[:cut]
                self.stopped = True
        self.text += new
        return new
