"""Hugging Face TGI's routes: POST /generate (an object), POST /generate_stream (SSE) and POST /
(a one-element list, or SSE with "stream": true), in TGI's shapes, so `huggingface_hub.InferenceClient`
and `text-generation` clients work pointed at the server's base URL.

The body is LMI's (`inputs`, `parameters`, `stream`) with a single string input. Shapes follow
TGI's router (GenerateResponse, StreamResponse, ErrorResponse with error_type).
"""
from __future__ import annotations

import json

from handler.engine.request import RequestError
from handler.http.protocols import Generation, Sample, lmi, ranked


def parse(payload, *, stream: bool | None = None) -> Generation:
    gen = lmi.parse(payload, require_string=True)
    if stream is not None:
        gen.stream = stream
    if gen.stream and gen.params.num_samples > 1:
        raise RequestError("parameters.best_of", "best_of > 1 is not allowed when streaming")
    return gen


def _token(t) -> dict:
    return {"id": t.id, "text": t.text, "logprob": t.log_prob, "special": bool(t.special)}


def _alt(tid, text, lp) -> dict:
    return {"id": tid, "text": text, "logprob": lp, "special": False}


def _details(gen: Generation, s: Sample) -> dict:
    return {"finish_reason": s.done.finish_reason, "generated_tokens": s.done.generated_tokens,
            "seed": gen.params.seed,
            "prefill": [_alt(i, x, lp) for i, x, lp in (s.done.prefill or ())]
            if gen.params.decoder_input_details else [],
            "tokens": [_token(t) for t in s.tokens],
            "top_tokens": [[_alt(*a) for a in t.top_tokens] for t in s.tokens] if gen.params.top_n_tokens else []}


def encode(gen: Generation, samples: list[Sample]) -> dict:
    order = ranked(samples)
    best = order[0]
    prompt = gen.prompts[0]
    out = {"generated_text": lmi.generated_text(gen, prompt, best)}
    if gen.params.details:
        details = _details(gen, best)
        if len(order) > 1:
            details["best_of_sequences"] = [{"generated_text": lmi.generated_text(gen, prompt, s),
                                             **_details(gen, s)} for s in order[1:]]
        out["details"] = details
    return out


def stream(gen: Generation, events):
    prompt = gen.prompts[0]
    index = 0
    for _p, _s, ev in events:
        if not hasattr(ev, "id"):
            yield f"data:{json.dumps({'error': ev.message, 'error_type': 'generation'})}\n\n"
            return
        index += 1
        obj = {"index": index, "token": _token(ev), "generated_text": None, "details": None}
        if gen.params.top_n_tokens:
            obj["top_tokens"] = [_alt(*a) for a in ev.top_tokens]
        if ev.done is not None:
            obj["generated_text"] = lmi.generated_text(gen, prompt, Sample(0, 0, [], ev.done))
            if gen.params.details:
                obj["details"] = {"finish_reason": ev.done.finish_reason,
                                  "generated_tokens": ev.done.generated_tokens, "seed": gen.params.seed,
                                  "input_length": ev.done.prompt_tokens}
        yield f"data:{json.dumps(obj, ensure_ascii=False)}\n\n"


def error_body(status: int, message: str, field: str | None = None) -> dict:
    kind = {400: "validation", 422: "validation", 415: "validation", 503: "overloaded",
            504: "timeout"}.get(status, "generation")
    return {"error": f"{field}: {message}" if field else message, "error_type": kind}
