"""Mixture-of-experts layers of our own model (handler/model/llama.py): Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE, each routing as its transformers reference does.

  family      experts / top-k fields                 weights of the top-k            shared expert
  qwen3_moe   num_experts, num_experts_per_tok       softmax (fp32), norm_topk_prob   -
  qwen2_moe   num_experts, num_experts_per_tok       softmax (fp32), norm_topk_prob   sigmoid(gate(x)) * MLP(x)
  mixtral     num_local_experts, num_experts_per_tok softmax (fp32), always renormalised, kept fp32
  olmoe       num_experts, num_experts_per_tok       softmax (fp32), norm_topk_prob (off: no renormalisation)
The Qwen families keep a dense MLP in `mlp_only_layers` and where (i + 1) % decoder_sparse_step != 0.

A step's rows [T, E] (prefill and decode rows together) are routed at once: the router's logits
[T, X] (X experts) by F.linear as transformers computes them, top-k over the probabilities
(torch.topk: deterministic given the logits; ties go to the lower index). The T*k (token, slot)
pairs are grouped by expert (slot-major, then token, as transformers' loop visits them), and each
active expert multiplies all its rows at once: gate/up, SiLU x up, down, times the routing weight,
added into the output rows (a token's experts in ascending expert order, as transformers adds
them). On CPU that is one C call per layer (kernels/cpu_layer.c lmi_moe_experts, bound at load by
`bind_kernel` over the experts' packs); elsewhere, or where a pack has no C form, the loop below
(index_select, the expert, index_put_ with accumulate: index_add_'s sums), the same values bit
for bit. Each expert is a `layers.GatedMlp` of plain nn.Linear layers, so the CPU packing
(handler/model/cpu.py), int8 / W8A16 (handler/model/quant.py) and GGUF's grouped blocks
(quant_formats.install_gguf) apply to experts as to a dense MLP; the routers (`Router`) stay as
loaded (F.linear: a quantized router could change which experts run). Tensor parallelism cuts
every expert's intermediate dimension (gate/up by rows, down by columns) as the dense MLP's; the
block's output (experts + shared expert) is all-reduced once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from handler.model import layers
from handler.model.linear import mlp_lins
from kernels import cpu as cpu_ext

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@dataclass(frozen=True)
class MoeSpec:
    experts: int            # X
    top_k: int
    intermediate: int       # each expert's width
    norm_topk: bool         # renormalise the top-k weights to sum 1
    fp32_weights: bool      # mixtral: the weights stay fp32 (the others round them to the logits' dtype)
    shared: int             # qwen2_moe: the shared expert's width (0: none)
    sparse: tuple           # per layer: True where the layer's MLP is the experts

    def active_fraction(self) -> float:
        return self.top_k / self.experts


def _field(config, name: str, unsupported):
    v = getattr(config, name, None)
    if v is None:
        raise unsupported(f"config.json lacks {name} for a {config.model_type} model")
    return v


def spec_of(config, unsupported) -> MoeSpec | None:
    """The MoE settings of a config of MOE_FAMILIES (None for a dense family); `unsupported`
    (llama.Unsupported) names the field where the config is outside what we route."""
    mt = getattr(config, "model_type", None)
    if mt not in MOE_FAMILIES:
        return None
    n = config.num_hidden_layers
    if mt == "mixtral":
        experts = _field(config, "num_local_experts", unsupported)
        width, norm, shared, sparse = config.intermediate_size, True, 0, (True,) * n
    else:
        experts = _field(config, "num_experts", unsupported)
        norm = bool(getattr(config, "norm_topk_prob", False))
        if mt == "olmoe":
            width, shared, sparse = config.intermediate_size, 0, (True,) * n
            if getattr(config, "clip_qkv", None) is not None:
                raise unsupported("olmoe clip_qkv (our attention does not clamp q/k/v)")
        else:
            width = _field(config, "moe_intermediate_size", unsupported)
            shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if mt == "qwen2_moe" else 0
            step = int(getattr(config, "decoder_sparse_step", 1) or 1)
            only = set(getattr(config, "mlp_only_layers", None) or ())
            sparse = tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(n))
    top_k = _field(config, "num_experts_per_tok", unsupported)
    if any(sparse) and not 0 < top_k <= experts:
        raise unsupported(f"num_experts_per_tok={top_k} with {experts} experts")
    return MoeSpec(int(experts), int(top_k), int(width), norm, mt == "mixtral", shared, sparse)


class Router(nn.Linear):
    """The router's (or the shared expert's gate's) weight, applied by F.linear as transformers does;
    its own type keeps it out of the CPU packing and quantization (both take plain nn.Linear)."""


# One expert (or the shared expert): gate/up/down as the dense MLP, without the all-reduce.
Expert = layers.GatedMlp


class SparseMoe(nn.Module):
    """`mlp` of a sparse layer: `gate` (router [X, E]), `experts.<j>`, qwen2_moe's `shared_expert`
    and `shared_expert_gate` (names as the checkpoints'; Mixtral's are renamed at load)."""

    def __init__(self, hidden: int, spec: MoeSpec, tp, dtype, device):
        super().__init__()
        self.spec, self.tp = spec, tp
        self.gate = Router(hidden, spec.experts, bias=False, dtype=dtype, device=device).requires_grad_(False)
        self.experts = nn.ModuleList(Expert(hidden, spec.intermediate // tp.size, dtype, device)
                                     for _ in range(spec.experts))
        if spec.shared:
            self.shared_expert = Expert(hidden, spec.shared // tp.size, dtype, device)
            self.shared_expert_gate = Router(hidden, 1, bias=False, dtype=dtype, device=device).requires_grad_(False)
        self.cpu_experts = None     # bind_kernel(), at load: the experts' lmi_lin arrays for the C call
        self.cpu_router = None      # bind_kernel(): the router's fp32 panels (lmi_gemm), routed by lmi_moe_route
        self.cpu_shared_gate = None  # bind_kernel(): the shared expert gate's fp32 panels (lmi_moe_shared adds it)
        self.cpu_round_bf16 = False  # bind_kernel(): lmi_moe_route rounds the weights to bf16 (the logits' dtype)

    def route(self, x: torch.Tensor, xf: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, E] -> (weights [T, k], expert ids [T, k]) as the family's transformers router. Bound to
        the C kernels (bind_kernel): the logits by our fp32 panel GEMM on the rows widened to fp32, the
        softmax / top-k / renormalisation by lmi_moe_route, the C layer stack's own calls, so both paths
        route alike; the same choices as transformers' router but for ulp-close ties. `xf`: x in fp32,
        contiguous, where the caller has it."""
        if self.cpu_router is not None:
            s = self.spec
            logits = cpu_ext.gemm(x.float().contiguous() if xf is None else xf, self.cpu_router, s.experts, None)
            weights, ids = cpu_ext.moe_route(logits, s.top_k, s.norm_topk, self.cpu_round_bf16)
            return (weights if s.fp32_weights else weights.to(x.dtype)), ids
        logits = self.gate(x)                     # [T, X]: F.linear, as transformers' router
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights if self.spec.fp32_weights else weights.to(logits.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().contiguous() if self.cpu_router is not None else None    # bound: the GEMMs' fp32 rows
        weights, ids = self.route(x, xf)
        out = self.experts_forward(x, weights, ids)
        if self.spec.shared:
            s = self.shared_expert(x)
            if self.cpu_shared_gate is not None:    # bound: the gate's fp32 GEMM, added by the C stack's own call
                g = cpu_ext.gemm(xf, self.cpu_shared_gate, 1, None)
                out = cpu_ext.moe_shared(out, s.contiguous(), g)
            else:
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * s
        return self.tp.reduce(out)

    def bind_kernel(self) -> str | None:
        """At load, once the experts are packed (handler/model/cpu.py prepack): whether the step's
        rows go through all the experts in one C call (kernels/cpu_layer.c lmi_moe_experts, over the
        packs' own weights); None where they do, else why not (then the Python loop below serves)."""
        self.cpu_experts = self.cpu_router = self.cpu_shared_gate = None
        dtype = self.gate.weight.dtype
        if self.gate.weight.device.type != "cpu" or cpu_ext.load() is None:
            return "no C kernels here"
        if dtype not in cpu_ext.KV_DTYPES:
            return f"{dtype} activations"
        if not cpu_ext.silu_exact(torch.get_num_threads()):
            return "torch's SiLU is not reproduced on this host"
        n = self.spec.experts
        gate, up, down, keep = (cpu_ext.Lin * n)(), (cpu_ext.Lin * n)(), (cpu_ext.Lin * n)(), []
        for j, ex in enumerate(self.experts):
            got = mlp_lins(ex, dtype, keep)
            if isinstance(got, str):
                return f"expert {j}: {got}"
            gate[j], up[j], down[j] = got
        self.cpu_experts = (gate, up, down, keep)
        self.cpu_router = cpu_ext.pack_panels(self.gate.weight.detach().float().contiguous())
        self.cpu_round_bf16 = dtype == torch.bfloat16 and not self.spec.fp32_weights
        if self.spec.shared:
            self.cpu_shared_gate = cpu_ext.pack_panels(self.shared_expert_gate.weight.detach().float().contiguous())
        return None

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.cpu_experts is not None and x.is_contiguous() and x.dtype == self.gate.weight.dtype:
            gate, up, down, _ = self.cpu_experts
            return cpu_ext.moe_experts(x, ids, weights, gate, up, down)
        t, k = ids.shape
        flat = ids.t().reshape(-1)                       # [k*T], slot-major: pair p = slot * T + token
        order = torch.argsort(flat, stable=True)         # by expert, then slot, then token
        counts = torch.bincount(flat, minlength=self.spec.experts).tolist()
        tokens = order % t
        w = weights.t().reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            rows = tokens[start:start + c]
            h = self.experts[e](x.index_select(0, rows)) * w[start:start + c, None]
            # out[rows] += h: index_add_'s values (each row once per expert: one addition), but
            # torch's CPU index_add_ takes ~50 ms a call (a scatter_add over the expanded index)
            out.index_put_((rows,), h.to(out.dtype), accumulate=True)
            start += c
        return out

    def fuse(self) -> None:
        for e in self.experts:
            e.fuse()
        if self.spec.shared:
            self.shared_expert.fuse()


# ---------------------------------------------------------------------------- checkpoint names
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def our_name(key: str) -> str:
    """A checkpoint key -> ours: Mixtral's block_sparse_moe.experts.j.w1/w3/w2 -> mlp.experts.j.
    gate_proj/up_proj/down_proj; other keys unchanged."""
    if ".block_sparse_moe." in key:
        key = key.replace(".block_sparse_moe.", ".mlp.")
        m = re.match(r"^(.*\.experts\.\d+\.)(w[123])(\..*)$", key)
        if m:
            key = m.group(1) + _MIXTRAL[m.group(2)] + m.group(3)
    return key


def split_fused(key: str, t: torch.Tensor, spec: MoeSpec) -> list[tuple[str, torch.Tensor]] | None:
    """transformers 5's fused 3-D expert tensors (`mlp.experts.gate_up_proj` [X, 2I, E], gate rows
    first; `mlp.experts.down_proj` [X, E, I]) -> per-expert (name, weight) pairs; None for any other key."""
    m = _FUSED.match(key)
    if m is None:
        return None
    layer, what = m.groups()
    if t.dim() != 3 or t.shape[0] != spec.experts:
        raise ValueError(f"tensor {key}: {list(t.shape)} holds {t.shape[0] if t.dim() == 3 else '?'} experts; "
                         f"config.json's experts count (num_experts / num_local_experts) is {spec.experts}")
    out = []
    for e in range(spec.experts):
        base = f"model.layers.{layer}.mlp.experts.{e}."
        if what == "down_proj":
            out.append((base + "down_proj.weight", t[e]))
        else:
            gate, up = t[e].chunk(2, 0)
            out += [(base + "gate_proj.weight", gate), (base + "up_proj.weight", up)]
    return out


def expert_index(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a per-expert tensor name of ours."""
    m = _EXPERT.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_experts(seen: dict[int, set[int]], spec: MoeSpec) -> None:
    """Every sparse layer's experts were in the checkpoint, no more and no fewer than the config says."""
    for layer, sparse in enumerate(spec.sparse):
        got = seen.get(layer, set())
        if sparse and got != set(range(spec.experts)):
            raise ValueError(f"layer {layer} of the checkpoint has {len(got)} experts (ids {min(got, default=0)}.."
                             f"{max(got, default=-1)}); config.json's experts count (num_experts / "
                             f"num_local_experts) is {spec.experts}")
        if not sparse and got:
            raise ValueError(f"layer {layer} of the checkpoint has experts but config.json makes it dense "
                             "(mlp_only_layers / decoder_sparse_step)")


def check_dense(name: str, spec: MoeSpec) -> None:
    """A dense MLP tensor where the config makes the layer sparse: the error names the fields."""
    m = re.match(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.", name)
    if m and spec.sparse[int(m.group(1))]:
        raise ValueError(f"layer {m.group(1)} of the checkpoint has a dense MLP ({name}); config.json makes it "
                         "sparse (mlp_only_layers / decoder_sparse_step)")


def sizes(spec: MoeSpec, hidden: int, dense_intermediate: int, layers: int) -> tuple[int, int]:
    """(all, active per token) parameters of the MLPs: every expert's vs the top-k's (plus the routers,
    the shared experts and the dense layers' MLPs, which every token reads)."""
    per_expert = 3 * hidden * spec.intermediate
    total = active = 0
    for sparse in spec.sparse[:layers]:
        if sparse:
            common = hidden * spec.experts + (3 * hidden * spec.shared + hidden if spec.shared else 0)
            total += spec.experts * per_expert + common
            active += spec.top_k * per_expert + common
        else:
            total += 3 * hidden * dense_intermediate
            active += 3 * hidden * dense_intermediate
    return total, active
