"""option.lmi_compat: which LMI release line the server behaves as, declared once.

LMI changed its defaults twice in ways an endpoint notices without a word: 0.27 resolved an absent
`option.rolling_batch` to `auto`, used every GPU (`tensor_parallel_degree=max`) and ran 256 sequences
for the vLLM / lmi-dist backends (wlm/LmiConfigRecommender.java@v0.28.0:81-176); the async vLLM
service of 0.32+ infers sampling from the parameters, runs a chat body without `max_tokens` to the
context limit, answers a `prompt` body on /invocations as OpenAI Completions and reads `parameters`
through vLLM's lax pydantic models, so "50" and 50.0 are 50
(djl_python/lmi_vllm/vllm_async_service.py@HEAD:282-317, request_response_utils.py@HEAD:55-99).

`current` (the default) is today's LMI; `0.31` and `0.26` keep an older endpoint's behaviour. The
configuration reads the defaults (handler/config/properties.py), the protocols the request
behaviours (handler/http/protocols/), docs/PROPERTIES.md the table (handler/config/docs.py).
Plain data: no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """One LMI behaviour line: the defaults it gives absent keys and how it reads requests."""
    name: str
    rolling_batch: str               # option.rolling_batch when absent (batch_size > 1 still means dynamic)
    max_rolling_batch_size: int      # option.max_rolling_batch_size when absent
    tensor_parallel_degree: object   # option.tensor_parallel_degree when absent: "max" or 1
    infer_sampling: bool             # no do_sample: sample when temperature/top_p/top_k/min_p/typical_p ask for it
    chat_to_context: bool            # chat on /invocations without max_tokens: to the context limit (else 30)
    prompt_as_completion: bool       # {"prompt": ...} on /invocations: OpenAI Completions (else a 400)
    lax_numbers: bool                # "50" / 50.0 for an integer, "0.5" for a number, "true" for a flag


LINES: dict[str, Line] = {
    "current": Line("current", "auto", 256, "max", True, True, True, True),
    "0.31": Line("0.31", "auto", 256, "max", False, False, False, False),
    "0.26": Line("0.26", "disable", 32, 1, False, False, False, False),
}
DEFAULT = "current"


def line_of(value: str) -> str:
    """`current` / `latest`, or an LMI version (`0.26`, `0.29.0`, `0.33`) -> the line it behaves as.
    ValueError naming what is allowed."""
    v = value.strip().lower()
    if v in ("current", "latest"):
        return "current"
    m = re.fullmatch(r"v?0\.([0-9]{1,3})(\.[0-9]+)?", v)
    if not m:
        raise ValueError("is not an LMI version line; allowed: current, 0.31, 0.26 (or any 0.N version: "
                         "up to 0.26 behaves as 0.26, 0.27-0.31 as 0.31, 0.32 and later as current)")
    minor = int(m.group(1))
    return "0.26" if minor <= 26 else "0.31" if minor <= 31 else "current"


def line(cfg) -> Line:
    """The Line a ServingConfig (or anything with .lmi_compat) follows; `current` without one."""
    return LINES[getattr(cfg, "lmi_compat", DEFAULT)]


# docs/PROPERTIES.md's table: (behaviour, {line: what it does}). Each row is a Line field.
DIFFERENCES: tuple[tuple[str, dict[str, str]], ...] = (
    ("`option.rolling_batch` absent (and `batch_size` 1)",
     {"current": "`auto`: the paged engine", "0.31": "`auto`: the paged engine",
      "0.26": "`disable`: one request at a time"}),
    ("`option.max_rolling_batch_size` absent",
     {"current": "256 (the KV pool bounds what runs: `config --explain`)", "0.31": "256", "0.26": "32"}),
    ("`option.tensor_parallel_degree` absent (and no `TENSOR_PARALLEL_DEGREE`/`SM_NUM_GPUS`)",
     {"current": "`max`: every visible GPU (1 on a CPU host)", "0.31": "`max`", "0.26": "1"}),
    ("`temperature`/`top_p`/`top_k`/`min_p`/`typical_p` without `do_sample`",
     {"current": "sampling (a bare request, or `temperature: 0`, stays greedy)", "0.31": "greedy (ignored)",
      "0.26": "greedy (ignored)"}),
    ("chat (`messages`) on `/invocations` without `max_tokens`",
     {"current": "to the context limit", "0.31": "30 tokens", "0.26": "30 tokens"}),
    ("`{\"prompt\": ...}` on `/invocations`",
     {"current": "OpenAI Completions (as `/v1/completions`)", "0.31": "400 (`inputs` is required)",
      "0.26": "400 (`inputs` is required)"}),
    ("`\"50\"` / `50.0` for an integer, `\"0.5\"` for a number, `\"true\"` for a flag on `/invocations`",
     {"current": "coerced (vLLM's pydantic models)", "0.31": "400 naming the field", "0.26": "400 naming the field"}),
)


def describe(name: str) -> str:
    """The start-up log's line: the line in force and what it decides."""
    ln = LINES[name]
    yes_no = {True: "", False: "not "}
    return (f"LMI behaviour line {name} (option.lmi_compat; current, 0.31, 0.26): absent option.rolling_batch -> "
            f"{ln.rolling_batch}, option.max_rolling_batch_size {ln.max_rolling_batch_size}, "
            f"option.tensor_parallel_degree {ln.tensor_parallel_degree}; on /invocations sampling "
            f"{yes_no[ln.infer_sampling]}inferred without do_sample, chat without max_tokens "
            f"{'to the context limit' if ln.chat_to_context else 'stops at 30 tokens'}, "
            f"prompt bodies {'as Completions' if ln.prompt_as_completion else 'refused'}, "
            f"numbers in strings {yes_no[ln.lax_numbers]}coerced")
