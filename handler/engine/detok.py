"""Incremental detokenisation and stop-sequence matching, per sequence. No torch.

Token texts are emitted so that their concatenation is exactly the generated text: a token
whose bytes end mid-character waits for the next one, and spaces that a tokenizer only
renders in context (SentencePiece's leading "▁") are kept by decoding with a few tokens of
left context (the approach of TGI and vLLM).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop_sequences=(), context: int = 5,
                 include_stop: bool = True, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, min_tokens: int = 0, special_ids=()):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-context:])
        self.ctx = len(self.ids)         # ids[:ctx] are the prompt's (no space joins them to the output)
        self.prefix = 0                  # ids[prefix:read] is context already emitted
        self.read = len(self.ids)
        self.text = ""                   # generated text emitted so far
        self.stops = tuple(stop_sequences)
        self._longest_stop = max((len(s) for s in self.stops), default=0)
        self.stopped = False
        self.matched: str | None = None  # the stop sequence that ended the text (vLLM's stop_reason)
        # include_stop=False (OpenAI): the text ends before the stop sequence. Text that may be
        # the start of one is held back (`held`) until it is known not to be.
        self.include_stop = include_stop
        self.held = ""
        self.skip_special = skip_special_tokens
        # Special tokens kept in the text: separated by a space from what is next to them (as slow
        # HF tokenizers and vLLM render them) unless spaces_between_special_tokens is false.
        self.spaced = not skip_special_tokens and spaces_between_special_tokens
        self.special = frozenset(special_ids) if self.spaced else frozenset()
        self.min_tokens, self.added = min_tokens, 0     # stop strings end nothing before min_tokens

    def _decode(self, ids, lo: int = 0) -> str:
        """The text of ids (= self.ids[lo:...])."""
        if not self.spaced or not self.special.intersection(ids):
            return self.tok.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)
        out, run, start = "", [], lo

        def part(text, at):
            nonlocal out
            out += (" " if out and at != self.ctx else "") + text

        for k, t in enumerate(ids, lo):
            if t in self.special or k == self.ctx:      # a special token, or the first generated one
                if run:
                    part(self.tok.decode(run, clean_up_tokenization_spaces=False), start)
                    run = []
                if t in self.special:
                    part(self.tok.decode([t], skip_special_tokens=False), k)
                    continue
            if not run:
                start = k
            run.append(t)
        if run:
            part(self.tok.decode(run, clean_up_tokenization_spaces=False), start)
        return out

    def add(self, token_id: int) -> str:
        """Append a generated token; returns the new text it completes ('' if it is pending).
        When a stop sequence appears, the text is cut right after it and `stopped` is set."""
        self.ids.append(token_id)
        self.added += 1
        before = self._decode(self.ids[self.prefix:self.read], self.prefix)
        after = self._decode(self.ids[self.prefix:], self.prefix)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before):]
        # Keep the window short: the last emitted tokens are all the context we need.
        self.prefix, self.read = self.read, len(self.ids)
        if len(self.ids) > 64:
            drop = self.prefix
            self.ids, self.prefix, self.read = self.ids[drop:], 0, self.read - drop
            self.ctx -= drop
        return self._append(new)

    def flush(self) -> str:
        """Text still pending at the end (an incomplete character is rendered as U+FFFD)."""
        if self.stopped:
            return ""
        out = ""
        if self.read < len(self.ids):
            before = self._decode(self.ids[self.prefix:self.read], self.prefix)
            after = self._decode(self.ids[self.prefix:], self.prefix)
            self.read = len(self.ids)
            out = self._append(after[len(before):]) if len(after) > len(before) else ""
        if self.held and not self.stopped:      # the end came before a stop sequence did
            self.text += self.held
            out, self.held = out + self.held, ""
        return out

    def _append(self, new: str) -> str:
        if self.added < self.min_tokens and self.stops and not self.stopped:
            self.text += self.held + new          # too early for a stop string: plain text
            out, self.held = self.held + new, ""
            return out
        if self.stops and not self.stopped and not self.include_stop:
            return self._append_hidden(new)
        if self.stops and not self.stopped:
            start = max(0, len(self.text) - self._longest_stop + 1)
            window = self.text[start:] + new
            hits = [(window.find(s) + len(s), s) for s in self.stops if s in window]
            if hits:
                end, self.matched = min(hits)
                cut = start + end - len(self.text)   # where the stop sequence ends in `new`
                new = new[:cut]
                self.stopped = True
        self.text += new
        return new

    def _append_hidden(self, new: str) -> str:
        """_append when the stop sequence is cut off: emit up to the earliest stop sequence, or
        all but the longest tail that some stop sequence starts with (held back)."""
        buf = self.held + new
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, self.matched = min(hits)
            out, self.held, self.stopped = buf[:at], "", True
        else:
            keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                        if buf.endswith(s[:k])), default=0)
            out, self.held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out
