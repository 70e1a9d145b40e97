"""A CPU step's decoder stack in one C call (kernels/cpu_layer.c): decode rows and whole prompts.

At one to a few dozen decoding rows a layer's arithmetic is small and its Python is not: the
layer of handler/model/llama.py makes about twenty calls (norm, fused q/k/v GEMM, the fused
attention call, o_proj, residual, norm, gate/up GEMM, SiLU, product, down, residual), ~150 us a
layer on the dev host, 4-5 ms of a 22 ms one-row step of SmolLM2's 30 layers. At a prompt step's
thousand rows the same element-wise ops are torch passes over megabytes each (~5% of the step).
`DecodeStack.run` hands the whole stack to C: the same kernels in the same order, the element-wise
steps rounded as torch's (SiLU by torch's own Sleef function, split across threads as torch splits
it; RMSNorm sums in torch's order, row by row), so the residual stream and the KV pools come out
bit for bit as the Python layers leave them (tests/model/test_cpu_stack.py).

What it takes is decided once, at load (`build` returns None and why otherwise, naming the layer
where one layer is the reason; the runner logs it once): our Llama family, q/k norms included
(Qwen3's per head, OLMoE's over the projection), without post-norms or residual multipliers; dense
MLPs or mixture-of-experts MLPs (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE's shared expert: the router's
fp32 GEMM, lmi_moe_route, lmi_moe_experts, lmi_moe_shared, the calls handler/model/moe.py's bound
layer makes); one rank; no LoRA; every linear packed for our panel kernels (fp32 panels, bf16 panels
either way, int8, grouped 4-8-bit codes: W8A16, GGUF blocks, AWQ/GPTQ); Llama-style RMSNorms; KV pools the fused attention reads, in the activations' dtype; torch's SiLU
reproduced here (cpu_ext.silu_exact). Whole prompts too unless a layer has a sliding window (the
prompt attention kernel takes none) or the prompt kernel does not run for the dtype: `notes` has
one load-log line per layer that keeps prompts out. Per step the only question is the step plan's
shape, answered once by kernels/step.py (`plan.prompts`): every sequence decodes one row (those
first) or feeds a prompt or a prompt's chunk (its earlier keys read from the pools through its block
table); any other step (a decode row after a prompt) runs the Python layers. A short chunk after
cached rows comes as decode rows (the runner's pack_step, rowwise). Nothing inside a
step falls back: tensors the C call does not take are a bug and raise. The decode_stack=0 A/B arm (handler/model/cpu.py Arms, a runner argument for
benchmarks) turns it off.
"""
from __future__ import annotations

import ctypes
import logging

import torch

from handler.model.cpu import DEFAULT, Arms
from handler.model.linear import cpu_lin, mlp_lins
from handler.model.moe import SparseMoe
from kernels import cpu as cpu_ext

log = logging.getLogger("lmi.cpu")


class DecodeStack:
    """The ctypes description of every layer (pointers into the model's packed weights and the
    KV pools, which it keeps referenced) and the step's call."""

    def __init__(self, model, kv_cache, layers, lanes: int, keep: list):
        a = model.arch
        self.kv_cache, self.layers, self.lanes, self.keep = kv_cache, layers, lanes, keep
        self.dtype = model.model.layers[0].input_layernorm.weight.dtype   # the activations' (an int8 pool's is not)
        # Prompt rows too: their attention is the prompt kernel's, which takes no sliding window
        # (the Python layers send such prompts to SDPA). One load-log line per layer that keeps them out.
        self.notes = [f"layer {i}: sliding window {layer.window}: whole prompts in Python (the prompt "
                      "kernel takes no window)" for i, layer in enumerate(layers) if layer.window]
        if not cpu_ext.prefill_attention_available(self.dtype):
            self.notes.append(f"every layer: no prompt kernel for {self.dtype} here: whole prompts in Python")
        self.prompts = not self.notes
        self.heads, self.kv_heads, self.head_dim = a.heads, a.kv_heads, a.head_dim
        self.intermediate, self.hidden, self.eps, self.scale = a.intermediate, a.hidden, a.eps, a.scaling

    def takes(self, plan, blocks=None) -> bool:
        """Whether a step of this plan runs here: the plan has the stack's shape (kernels/step.py
        decides it once a step) and, with prompts in it, the stack takes prompts (load); a chunk after
        earlier rows not where rows attend both ways in blocks (`blocks`: a VLM's image runs)."""
        return (plan is not None and plan.prompts is not None and (not plan.prompts.shape[1] or self.prompts)
                and not (blocks and plan.prompt_ctx is not None))

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step) -> bool:
        """Every layer of this step, in place on h [T, E]; False (nothing changed) when the step's
        plan is not the stack's (`takes`). Tensors other than the runner's are a bug: ValueError."""
        if not self.takes(step.plan, getattr(step, "blocks", None)):
            return False
        t = h.shape[0]
        if (step.kv_cache is not self.kv_cache or h.dtype != self.dtype or not h.is_contiguous()
                or h.shape[1] != self.hidden or cos.dtype != self.dtype or sin.dtype != self.dtype
                or cos.shape != (t, self.head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride()
                or cos.stride(1) != 1):
            raise ValueError(f"the C layer stack was handed other tensors than the runner's: h {h.dtype} "
                             f"{tuple(h.shape)}, cos {cos.dtype} {tuple(cos.shape)} (stack: {self.dtype}, "
                             f"hidden {self.hidden}, head_dim {self.head_dim})")
        plan = step.plan
        pool = self.kv_cache[0][0]
        tables, lens = plan.stack_tables
        cpu_ext.step_layers(self.layers, h, cos, sin, plan.slots, tables, lens, plan.prompts, heads=self.heads,
                            kv_heads=self.kv_heads, head_dim=self.head_dim, intermediate=self.intermediate,
                            eps=self.eps, lanes=self.lanes, pool=pool, scale=self.scale, prompt_ctx=plan.prompt_ctx,
                            prompt_tables=plan.prompt_tables)
        return True


def build(model, kv_cache, *, tp_size: int = 1, lora: bool = False,
          arms: Arms = DEFAULT) -> tuple[DecodeStack | None, str]:
    """The model's DecodeStack, or None and why it does not apply."""
    from handler.model.llama import LlamaFamilyForCausalLM
    if not arms.decode_stack:
        return None, "the decode_stack=0 arm (handler/model/cpu.py Arms)"
    if not isinstance(model, LlamaFamilyForCausalLM):
        return None, "not our model"
    a = model.arch
    if tp_size > 1 or lora:
        return None, "tensor parallel" if tp_size > 1 else "LoRA"
    if a.gemma:
        return None, (f"{a.family}'s layer (1 + weight norms before and after each sublayer, a GELU-tanh MLP); "
                      "its layers run in Python over the per-op kernels")
    if a.post_norms or a.residual_scale != 1.0:
        return None, f"{a.family}'s layer (post-norms or residual multipliers)"
    pool = kv_cache[0][0]
    i8 = pool.int8     # option.kv_cache_dtype=int8: the layers' scales go with the pools
    dtype = model.model.layers[0].input_layernorm.weight.dtype if i8 else pool.dtype
    if dtype not in cpu_ext.KV_DTYPES or not cpu_ext.supports(pool) or cpu_ext.load() is None:
        return None, "the KV pools are not the C kernels'"
    if not cpu_ext.silu_exact(torch.get_num_threads()):
        return None, "torch's SiLU is not reproduced on this host"
    lanes = 0
    if dtype == torch.float32:
        lanes = cpu_ext.rms_norm_f32_lanes(a.hidden)
        if not lanes:
            return None, "torch's fp32 RMSNorm sums are not reproduced on this host"
    # q/k norms, Qwen3's per head or OLMoE's over the whole projection: the rows they norm, fp32's summing widths
    qk = {None: (cpu_ext.QK_NONE, 0, 0), "head": (cpu_ext.QK_HEAD, a.head_dim, a.head_dim),
          "full": (cpu_ext.QK_FULL, a.heads * a.head_dim, a.kv_heads * a.head_dim)}.get(a.qk_norm)
    if qk is None:
        return None, f"{a.family}'s q/k norms ({a.qk_norm})"
    qk_lanes = [cpu_ext.rms_norm_f32_lanes(n) if qk[0] and dtype == torch.float32 else 0 for n in qk[1:]]
    if qk[0] and dtype == torch.float32 and not all(qk_lanes):
        return None, "torch's fp32 RMSNorm sums over the q/k norms' rows are not reproduced on this host"
    layers, keep = (cpu_ext.Layer * a.layers)(), []
    for i, layer in enumerate(model.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if a.qk_norm:
            norms += (att.q_norm, att.k_norm)
        for n in norms:
            if n.style != "llama" or n.eps != a.eps or n.weight.dtype != dtype or not n.weight.is_contiguous():
                return None, f"layer {i}: a norm the C stack does not take"
        qkv = [att.qkv_proj, None, None] if att.qkv_proj is not None else [att.q_proj, att.k_proj, att.v_proj]
        sparse = isinstance(mlp, SparseMoe)
        # a sparse layer's experts and router are bound at load (moe.SparseMoe.bind_kernel): its MLP records empty
        if sparse and (mlp.cpu_experts is None or mlp.cpu_router is None):
            return None, f"layer {i}: experts not bound to the C kernels"
        lins = [cpu_ext.Lin() if m is None else cpu_lin(m, dtype, keep) for m in (*qkv, att.o_proj)]
        gud = [cpu_ext.Lin()] * 3 if sparse else mlp_lins(mlp, dtype, keep)
        lins += [gud] if isinstance(gud, str) else gud
        for lin in lins:
            if isinstance(lin, str):
                return None, f"layer {i}: {lin}"
        d, hid, inter = a.head_dim, a.hidden, a.intermediate
        got = [(sum(x.n for x in lins[:3]), hid), (lins[3].n, lins[3].k), (lins[4].n + lins[5].n, hid),
               (lins[6].n, lins[6].k)]
        want = [((a.heads + 2 * a.kv_heads) * d, hid), (hid, a.heads * d), (2 * inter, hid), (hid, inter)]
        if (got[:2] != want[:2] or (not sparse and got[2:] != want[2:])
                or any(x.k != hid for x in (*lins[:3], *lins[4:6]) if x.n)):
            return None, f"layer {i}: projections of other shapes than the config's"
        k_pool, v_pool = kv_cache[i]     # kernels/pool.py KVPool records
        if (k_pool.dtype != pool.dtype or k_pool.data.stride() != pool.data.stride()
                or v_pool.data.stride() != pool.data.stride()
                or (i8 and not (cpu_ext.supports(k_pool) and cpu_ext.supports(v_pool)))):
            return None, f"layer {i}: KV pools of different layouts"
        scales = dict(ksc=k_pool.scales.data_ptr(), vsc=v_pool.scales.data_ptr()) if i8 else {}
        if a.qk_norm:
            scales.update(qn=att.q_norm.weight.data_ptr(), kn=att.k_norm.weight.data_ptr(), qk_norm=qk[0],
                          q_lanes=qk_lanes[0], k_lanes=qk_lanes[1])
        if sparse:
            s, (xg, xu, xd, held) = mlp.spec, mlp.cpu_experts
            keep += [mlp.cpu_router, xg, xu, xd, held]
            if s.shared:    # Qwen2-MoE: the shared expert's packs and its gate's panels
                sl = mlp_lins(mlp.shared_expert, dtype, keep)
                if isinstance(sl, str) or mlp.cpu_shared_gate is None:
                    return None, f"layer {i}: a shared expert the C stack does not take"
                keep.append(mlp.cpu_shared_gate)
                scales.update(sgate=sl[0], sup=sl[1], sdown=sl[2], shared_gate=mlp.cpu_shared_gate.data_ptr())
            scales.update(router=mlp.cpu_router.data_ptr(), xgate=ctypes.addressof(xg), xup=ctypes.addressof(xu),
                          xdown=ctypes.addressof(xd), experts=s.experts, topk=s.top_k, route_norm=int(s.norm_topk),
                          route_bf16=int(mlp.cpu_round_bf16))
        layers[i] = cpu_ext.Layer(*lins, norm1=norms[0].weight.data_ptr(), norm2=norms[1].weight.data_ptr(),
                                  kc=k_pool.data.data_ptr(), vc=v_pool.data.data_ptr(), window=int(att.window or 0),
                                  **scales)
        keep += [n.weight for n in norms]
    return DecodeStack(model, kv_cache, layers, lanes, keep), "ok"
