"""1-client decode step, Qwen3-0.6B's shape (random weights): the C layer stack (now taking Qwen3's q/k norms)
against the Python layers (decode_stack=0 arm), both engines in one process, arms alternated.

    HF_HUB_OFFLINE=1 python qwen3_ab.py [fp32|bf16]     (the model is made once in /tmp/qwen3-0.6b-shape)
"""
import os, sys, shutil, statistics, time
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
import torch
d = "/tmp/qwen3-0.6b-shape"
if not os.path.exists(os.path.join(d, "config.json")):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                      max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, initializer_range=0.02)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ROOT, ".cache/models/qwen2.5-coder-0.5b", f), d)
from handler.tools.bench.inprocess import make_engine
from handler.model.cpu import Arms
from handler.engine.request import SamplingParams
torch.set_num_threads(2)
dtype = sys.argv[1] if len(sys.argv) > 1 else "fp32"
engines = {"stack": make_engine(d, dtype, 4, 4096), "python": make_engine(d, dtype, 4, 4096, arms=Arms(decode_stack=False))}
for e in engines.values():
    e.submit([list(range(100, 160))], SamplingParams(max_new_tokens=1000, ignore_eos=True))
    for _ in range(5): e.step()
res = {k: [] for k in engines}
for rep in range(6):
    for k, e in (engines.items() if rep % 2 == 0 else reversed(list(engines.items()))):
        t = time.perf_counter()
        for _ in range(15): e.step()
        res[k].append((time.perf_counter() - t) / 15 * 1e3)
print(dtype, {k: round(statistics.median(v), 2) for k, v in res.items()}, "python/stack",
      round(statistics.median(res["python"]) / statistics.median(res["stack"]), 3))
print(res)
