"""Guided decoding with xgrammar (the grammar engine of vLLM, SGLang and TensorRT-LLM).

  Guides     one per runner: the tokenizer's vocabulary (built on first use) and a compiler whose
             cache holds each compiled GuideSpec (handler/engine/guide.py) once
  Matcher    one per sequence (an engine GuideState): advanced by each accepted token
  apply      the sampler's step: each guided row's next-token bitmask filled by its matcher, then
             one batched masked fill of the logits ([R, V] float32, disallowed tokens -> -inf)
"""
from __future__ import annotations

import json
import threading

import torch

from handler.engine.errors import RequestError
from handler.engine.guide import GuideSpec


class Matcher:
    """A sequence's grammar state (handler.engine.types.GuideState)."""
    __slots__ = ("m",)

    def __init__(self, m):
        self.m = m

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.m.is_terminated():      # terminated: nothing to constrain (the row is unmasked)
            self.m.fill_next_token_bitmask(bitmask, row)


class Guides:
    """handler.engine.types.Guides over xgrammar. `vocab_size`: the logits' width (the model's
    vocabulary, which may be padded beyond the tokenizer's); `stop_ids`: what ends a grammar."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids=()):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_ids or None)
                # Its cache keys on the grammar's text: a schema compiles once per process.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
            return self._compiler

    def compile(self, spec: GuideSpec):
        c = self.compiler()
        try:
            if spec.kind == "json_schema":
                # Compact JSON (no free whitespace): a small model cannot wander into blank lines.
                return c.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec.value))
                return c.compile_grammar(f"root ::= {alts}")
            if spec.kind == "grammar":
                return c.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as e:
            # xgrammar's message: "[time] /path/file.cc:line: what" -> "what"
            what = str(e).strip().splitlines()[0].split(": ", 1)[-1] if str(e).strip() else type(e).__name__
            raise RequestError(spec.field or "parameters", f"cannot be compiled for guided decoding: "
                                                           f"{what[:300]}") from None
        raise RequestError(spec.field or "parameters", f"unknown guide kind {spec.kind!r}")

    def matcher(self, spec: GuideSpec) -> Matcher:
        import xgrammar as xgr
        return Matcher(xgr.GrammarMatcher(self.compile(spec)))


def apply(logits: torch.Tensor, guides: list, vocab_size: int | None = None) -> None:
    """Mask `logits` [R, V] in place: row r keeps only the tokens guides[r] allows (None: all)."""
    import xgrammar as xgr
    rows = [r for r, g in enumerate(guides) if g is not None]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])   # [R, ceil(V/32)] int32
    for r in rows:
        guides[r].fill(bitmask, r)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=vocab_size, indices=rows)
