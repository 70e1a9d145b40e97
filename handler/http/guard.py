"""Checks the HTTP layer makes before any real work: admission, body size, prompt text.

Order of the work for one /invocations request, cheapest refusal first:
  1. `Admission.enter()`: a counter of accepted-but-unanswered requests; over capacity -> 503
     (microseconds: no body read, no parsing, no tokenizer, no engine lock);
  2. `read_body`: Content-Length over the limit -> 413 before reading; a chunked body is
     counted while read and refused as soon as it passes the limit;
  3. parsing (handler/engine/request.py), then `check_prompt` per prompt: text the tokenizer cannot
     take (lone surrogates) -> 400, text too long to fit the context even at the most
     characters a token can cover -> 400, both without tokenizing.
No torch, no Flask: plain functions over a WSGI environ and strings.
"""
from __future__ import annotations

import threading

from handler.engine.request import RequestError


class PayloadTooLarge(Exception):
    pass


class ClientDisconnected(Exception):
    """The client went away (or stopped sending) before its body was read."""


class SlowBody(OSError):
    """The body did not arrive within option.http_body_timeout (raised by the gevent worker's
    connection, handler/http/worker.py); the connection is closed after the 408."""


class MalformedBody(Exception):
    """The HTTP framing of the body is broken (e.g. an invalid chunk size)."""


class Admission:
    """Requests accepted by the HTTP layer and not yet answered. `enter` refuses (False) when
    `capacity` are already inside, so a server exactly at capacity still admits the last one."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.inside = 0
        self.refused = 0
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            if self.inside >= self.capacity:
                self.refused += 1
                return False
            self.inside += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.inside -= 1


def read_body(environ: dict, limit: int) -> bytes:
    """The request body, at most `limit` bytes. Raises PayloadTooLarge, ClientDisconnected,
    SlowBody or MalformedBody; never reads more than limit + one chunk."""
    declared = environ.get("CONTENT_LENGTH") or ""
    if declared.strip().isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is {int(declared)} bytes; at most {limit} bytes are accepted")
    stream = environ.get("wsgi.input")
    if stream is None:
        return b""
    try:
        from gunicorn.http.errors import NoMoreData, ParseException
    except ImportError:  # served by another WSGI server (tests: Werkzeug's client)
        NoMoreData = ParseException = ()  # noqa: N806
    parts, size = [], 0
    try:
        while True:
            part = stream.read(min(1 << 16, limit + 1 - size))
            if not part:
                break
            size += len(part)
            if size > limit:
                raise PayloadTooLarge(f"the body is over {limit} bytes; at most {limit} bytes are accepted")
            parts.append(part)
    except SlowBody:
        raise
    except ParseException as e:
        raise MalformedBody(f"malformed request body: {type(e).__name__}: {str(e)[:200]}") from None
    except (NoMoreData, OSError) as e:
        raise ClientDisconnected(f"{type(e).__name__}: {e}") from None
    if declared.strip().isdigit() and size < int(declared):   # the connection closed early
        raise ClientDisconnected(f"{size} of {int(declared)} bytes received")
    done = getattr(environ.get("gunicorn.socket"), "answering", None)
    if done is not None:        # the gevent worker's connection: no longer a slow sender
        done()
    return b"".join(parts)


def longest_token_chars(tokenizer) -> int:
    """The most text characters one token can stand for (vocabulary and added tokens). A
    byte-level token's string has one character per byte, so this bounds characters too."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1) or 1


def check_prompt(text: str, field: str, max_chars: int | None, max_tokens: int) -> None:
    """400 (RequestError) for text the tokenizer cannot take or that cannot fit the context."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(field, f"contains a lone UTF-16 surrogate ({text[e.start]!a}) at character "
                                  f"{e.start}; send valid Unicode text") from None
    if max_chars is not None and len(text) > max_chars:
        raise RequestError(field, f"is {len(text)} characters, more than can fit in the model's "
                                  f"context of {max_tokens} tokens (at most {max_chars} characters)")
