"""Reasoning output: a model's `<think>...</think>` -> message.reasoning_content, the rest -> content.

  deepseek_r1  DeepSeek-R1 (and its distills): the template opens `<think>` in the prompt, so the
               answer usually starts inside the thinking; everything up to `</think>` is reasoning
               (all of it when the end never comes: cut by max_tokens).
  qwen3        Qwen3: thinking is `<think>...</think>` at the start of the answer; with
               enable_thinking=false (chat_template_kwargs) the template closes it in the prompt and
               the answer has no tags: all content.
"""
from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def split(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content)."""
    body = text.lstrip()
    if body.startswith(OPEN):
        body = body[len(OPEN):]
    elif parser == "qwen3":
        return None, text
    if CLOSE in body:
        reasoning, content = body.split(CLOSE, 1)
        return reasoning, content.lstrip("\n")
    return body, ""


def _partial(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that starts `marker`."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


class Splitter:
    """split() for a stream: feed(piece) -> [(kind, text)], kind 'reasoning' or 'content'."""

    def __init__(self, parser: str):
        self.parser = parser
        self.state = "start"     # start -> thinking -> answer
        self.buf = ""
        self.strip_newlines = False

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.buf += piece
        out = []
        if self.state == "start":
            lead = self.buf.lstrip()
            if not lead or OPEN.startswith(lead):
                return out                       # may still be the opening tag
            if lead.startswith(OPEN):
                self.buf, self.state = lead[len(OPEN):], "thinking"
            elif self.parser == "deepseek_r1":
                self.state = "thinking"
            else:                                # qwen3 without an opening tag: an answer
                self.state = "answer"
        if self.state == "thinking":
            if CLOSE in self.buf:
                think, rest = self.buf.split(CLOSE, 1)
                if think:
                    out.append(("reasoning", think))
                self.buf, self.state, self.strip_newlines = rest, "answer", True
            else:
                keep = _partial(self.buf, CLOSE)
                emit, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if emit:
                    out.append(("reasoning", emit))
                return out
        if self.state == "answer":
            if self.strip_newlines:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.strip_newlines = False
            if self.buf:
                out.append(("content", self.buf))
            self.buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held at the end: a partial tag is text of its kind."""
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        if self.state == "start":
            return [("reasoning" if self.parser == "deepseek_r1" else "content", rest)]
        return [("reasoning" if self.state == "thinking" else "content", rest)]
