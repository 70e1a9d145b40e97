"""Qwen3-30B-A3B's shape as a Q4_K_M GGUF made by llama.cpp's own quantizer, served by us and by llama.cpp.

    HF_HUB_OFFLINE=1 python benchmarks/moe_q4km.py [--layers 4] [--out benchmarks/results/moe-30b-a3b-q4km]
        [--work DIR] [--clients 1,16] [--reps 1] [--requests N] [--prepare-only] [--keep] [--arm NAME=...]

The shape (hidden 2048, 128 experts, 8 active, expert width 768, GQA 32/4 heads of 128, Qwen's
151,936-token vocabulary and tokenizer, untied head) at `--layers` of its 48 layers, random bf16
weights (normal, std 0.02; the RMSNorm weights 1), so that the model fits this host beside a peer:

  1. `WORK/hf`: the checkpoint in the Hub's per-expert layout, tokenizer files from
     .cache/models/qwen2.5-coder-0.5b (Qwen2.5's tokenizer is Qwen3's: the same BPE and 151,643
     tokens plus specials; llama.cpp's converter recognises its pre-tokenizer);
  2. llama.cpp's convert_hf_to_gguf.py -> bf16 GGUF, then its `llama-quantize ... Q4_K_M` (the
     llama.cpp peer: `make peer-llamacpp`, which builds both tools);
  3. our server's own conversion of that file (handler/model/gguf.py: dequantized once into the
     model cache, fp32; its expert blocks served as the file's blocks, `paged_gguf`);
  4. `bench compare --preset cpu-moe-30b-a3b --only paged_gguf,llamacpp_gguf` on that directory: one
     server at a time, the same request list, equal KV tokens and running limit, 2 threads; then
     `bench floor --quantize gguf --results`: TPOT at 1 client against the active-bytes read floor.

What fits (this host: 2 vCPUs, 24 GiB): a layer holds 623 M parameters (128 x 3 x 2048 x 768 in
experts), ~0.37 GB a layer as Q4_K_M and 2.5 GB dequantized to fp32, which is what our start-up
converts through (the served blocks are the file's). At 4 layers (the default): the Q4_K_M file
~1.8 GB, our conversion ~12.5 GB on disk and at its peak in memory while loading, one server at a
time; 48 layers do not fit (tests/model/test_moe.py: refused at start with the bytes). Steps 1-3
are skipped where their output exists; `--keep` keeps the bf16 checkpoint and GGUF (deleted once
the Q4_K_M file exists, ~2 x 1.25 GB a layer).

Checked at 2 layers (2026-11-29, a shared host under load, `--clients 1,4 --requests 8`): the
checkpoint, llama.cpp's bf16 conversion and Q4_K_M (1.19 GB; llama-quantize 113 s) and ours (the
file dequantized through transformers, ~1 min) in ~6 minutes; our server's start-up 2.5 minutes
(7.5 GB of fp32 read, then the file's 777 grouped layers installed); both servers answered every
request; `bench floor`: 397 MiB read a token of the 2,315 MiB held.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Qwen3-30B-A3B's config.json, less its depth (set by --layers)
SHAPE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
             num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
             moe_intermediate_size=768, intermediate_size=6144, decoder_sparse_step=1, mlp_only_layers=[],
             norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
             rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", attention_bias=False,
             attention_dropout=0.0, initializer_range=0.02, bos_token_id=151643, eos_token_id=151645,
             torch_dtype="bfloat16", use_cache=True)
TOKENIZER = os.path.join(ROOT, ".cache", "models", "qwen2.5-coder-0.5b")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SHARD_BYTES = 2 << 30


def tensors(c: dict):
    """(name, shape, kind) of every tensor of a qwen3_moe checkpoint of config `c`, in the Hub's
    per-expert layout (kind: "norm" or "weight")."""
    h, d, w = c["hidden_size"], c["head_dim"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (c["vocab_size"], h), "weight"
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), "norm"
        yield p + "post_attention_layernorm.weight", (h,), "norm"
        yield p + "self_attn.q_norm.weight", (d,), "norm"
        yield p + "self_attn.k_norm.weight", (d,), "norm"
        yield p + "self_attn.q_proj.weight", (q, h), "weight"
        yield p + "self_attn.k_proj.weight", (kv, h), "weight"
        yield p + "self_attn.v_proj.weight", (kv, h), "weight"
        yield p + "self_attn.o_proj.weight", (h, q), "weight"
        yield p + "mlp.gate.weight", (c["num_experts"], h), "weight"
        for j in range(c["num_experts"]):
            e = f"{p}mlp.experts.{j}."
            yield e + "gate_proj.weight", (w, h), "weight"
            yield e + "up_proj.weight", (w, h), "weight"
            yield e + "down_proj.weight", (h, w), "weight"
    yield "model.norm.weight", (h,), "norm"
    if not c.get("tie_word_embeddings"):
        yield "lm_head.weight", (c["vocab_size"], h), "weight"


def write_checkpoint(config: dict, out: str, tokenizer_dir: str = TOKENIZER, seed: int = 0) -> str:
    """A random bf16 checkpoint of `config` in `out` (sharded safetensors with an index), tokenizer files
    copied from `tokenizer_dir`; nothing instantiates the model (a layer's 623 M weights drawn tensor by
    tensor)."""
    import torch
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
        return out
    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shard, size, n, index = {}, 0, 0, {}

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, shape, kind in tensors(config):
        t = (torch.ones(shape) if kind == "norm" else torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    flush()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(os.path.getsize(os.path.join(out, v)) for v in set(index.values()))},
                   "weight_map": index}, f, indent=1)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
                   "do_sample": False}, f)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), out)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="of the 48 (default 4: fits this host beside a peer)")
    p.add_argument("--out", help="results directory (default benchmarks/results/moe-30b-a3b-q4km-L<layers>)")
    p.add_argument("--work", help="where the models are made (default .cache/models/qwen3-30b-a3b-shape-L<layers>)")
    p.add_argument("--clients", default="1,16")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--requests", type=int, help="fewer requests than the preset's (a quick check)")
    p.add_argument("--llamacpp-dir", help="the llama.cpp peer (default .cache/peers/llamacpp)")
    p.add_argument("--prepare-only", action="store_true", help="make the files, measure nothing")
    p.add_argument("--keep", action="store_true", help="keep the bf16 checkpoint and GGUF")
    p.add_argument("--floor-prop", action="append", default=[], metavar="option.key=value",
                   help="bench floor's --prop: the served layout whose bytes the floor counts")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=paged_gguf+option.key=value...",
                   help="one more cell of ours (bench compare's --arm), e.g. the int8-activation numerics: "
                        "a8=paged_gguf+option.cpu_grouped_activations=int8+option.grouped_code_layout=packed")
    a = p.parse_args(argv)
    if not 1 <= a.layers <= 48:
        p.error(f"--layers {a.layers}: Qwen3-30B-A3B has 48")
    from handler.tools.bench import llamacpp_peer

    ok, peer = llamacpp_peer.installed(a.llamacpp_dir)
    if not ok or not os.access(llamacpp_peer.binary(peer, "llama-quantize"), os.X_OK):
        print(f"moe_q4km: {peer if not ok else 'llama-quantize not built'}: make peer-llamacpp", file=sys.stderr)
        return 2
    work = os.path.abspath(a.work or os.path.join(ROOT, ".cache", "models", f"qwen3-30b-a3b-shape-L{a.layers}"))
    out = os.path.abspath(a.out or os.path.join(ROOT, "benchmarks", "results", f"moe-30b-a3b-q4km-L{a.layers}"))
    q4 = os.path.join(work, f"qwen3-30b-a3b-shape-L{a.layers}-Q4_K_M.gguf")
    hf = os.path.join(work, "hf")
    if not os.path.isfile(q4):
        write_checkpoint({**SHAPE, "num_hidden_layers": a.layers}, hf)
        bf16 = llamacpp_peer.convert(peer, hf, "bf16")
        made = llamacpp_peer.quantize(peer, bf16, "Q4_K_M")
        os.replace(made, q4)
        if not a.keep:
            os.remove(bf16)
            shutil.rmtree(hf)
    os.environ.setdefault("LMI_MODEL_CACHE", os.path.join(work, "cache"))
    from handler.model.gguf import hf_dir_for
    served = hf_dir_for(q4, "fp32", "cpu")      # our start-up's conversion: paged_gguf serves q4's blocks
    print(f"moe_q4km: {q4} ({os.path.getsize(q4) / 1e9:.2f} GB, llama.cpp's Q4_K_M); ours converted in {served}")
    if a.prepare_only:
        return 0
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    bench = [sys.executable, "-m", "handler", "bench"]
    cmp = [*bench, "compare", "--preset", "cpu-moe-30b-a3b", "--model-dir", served, "--only",
           "paged_gguf,llamacpp_gguf", "--clients", a.clients, "--reps", str(a.reps), "--out", out,
           "--startup-timeout", "1800"]     # ours reads the fp32 conversion, then installs the file's blocks
    cmp += ["--requests", str(a.requests)] if a.requests else []
    cmp += ["--llamacpp-dir", peer] if a.llamacpp_dir else []
    cmp += [x for arm in a.arm for x in ("--arm", arm)]
    print("moe_q4km:", " ".join(cmp), flush=True)
    subprocess.run(cmp, check=True, cwd=ROOT, env=env)
    fl = [*bench, "floor", "--model-dir", served, "--quantize", "gguf", "--results",
          os.path.join(out, "results.json"), "--out", os.path.join(out, "floor.json")]
    fl += [x for kv in a.floor_prop for x in ("--prop", kv)]
    print("moe_q4km:", " ".join(fl), flush=True)
    r = subprocess.run(fl, cwd=ROOT, env=env, capture_output=True, text=True)
    sys.stdout.write(r.stdout + r.stderr)
    with open(os.path.join(out, "floor.txt"), "w") as f:
        f.write(r.stdout)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
