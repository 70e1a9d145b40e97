"""One linear layer type for every packed weight: `CpuLinear`, an `nn.Linear` holding a `Pack` chosen
once at load, built new and put in its parent's place (`replace`, as gpt-fast's quantize.py does),
never a class swapped in under a live module.

The packs (each module owns its own):
  handler/model/cpu.py        PanelPack (fp32 panels, a bf16 weight widened), Bf16PanelPack (bf16
                              panels, widened in registers or by vdpbf16ps), OneDnnPack (oneDNN's
                              blocked layout, a bf16 weight widened to fp32 or not)
  handler/model/quant.py      Int8Pack (W8A8: kernels/cpu_gemm_i8.c's panels, or int8 rows for the
                              torch reference where no kernel runs)
  handler/model/quant_int4.py GroupedPack (grouped 4/5/6/8-bit codes: kernels/cpu_gemm_q4.c's QPack,
                              which carries its int8-activation choice), and its stand-ins where that
                              kernel does not run: TritonGroupedPack (CUDA), TorchGroupedPack
                              (dequantized per call)
A pack says how it multiplies (`forward`), what a step streams (`tensors`), everything it holds
(`held`), and the lmi_lin the C layer stack takes for it (`lin`: handler/model/cpu_stack.py reads
the code from the pack, not from the class). The torch and Triton stand-ins make the name a slight
misnomer on a GPU: the type is one, the forms are many.

The layer stays an `nn.Linear` (in_features, out_features, `weight` kept as an empty tensor of the
original dtype and device unless shared or asked for, `bias`): LoRA's wrapper and the loaders'
checks see a linear layer.
"""
from __future__ import annotations

import torch
from torch import nn

# Attributes a layer carries into its replacement: smoothing's input scale (handler/model/quant.py),
# which LoRA reads.
CARRIED = ("input_scale",)


class Pack:
    """A weight in the form one kernel multiplies (subclasses: the module doc)."""

    def forward(self, x: torch.Tensor, layer: "CpuLinear") -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """What a one-row step streams (the huge-page report counts these)."""
        return []

    def held(self) -> list[torch.Tensor]:
        """Every tensor the pack keeps (weight-memory accounting)."""
        return self.tensors()

    def lin(self, dtype: torch.dtype) -> tuple[int, dict, list[torch.Tensor]] | str:
        """For the C layer stack with activations of `dtype`: (lmi_lin kind, its fields, the tensors
        they point into), or why this pack cannot go there."""
        return f"a {type(self).__name__} with {dtype} activations"


class CpuLinear(nn.Linear):
    """y = x @ W^T + b with W held as `pack` (module doc)."""

    pack: Pack
    bias32: torch.Tensor | None     # the bias in fp32, contiguous (the panel and quantized kernels add it)

    def __init__(self, like: nn.Linear, pack: Pack, keep_weight: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = like.in_features, like.out_features
        w = like.weight
        self.weight = w if keep_weight else nn.Parameter(w.new_empty(0), requires_grad=False)
        self.bias = like.bias
        self.bias32 = None if like.bias is None else like.bias.detach().float().contiguous()
        self.pack = pack
        for a in CARRIED:
            if hasattr(like, a):
                setattr(self, a, getattr(like, a))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pack.forward(x, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, pack={type(self.pack).__name__}"


def replace(root: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put `new` where `root`'s submodule `name` is; returns `new`."""
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)
    return new


def plain(like: nn.Linear, weight: torch.Tensor) -> nn.Linear:
    """A plain nn.Linear of `like`'s shape and bias holding `weight` (no initialisation pass)."""
    m = nn.Linear(like.in_features, like.out_features, bias=False, device="meta")
    m.weight = nn.Parameter(weight, requires_grad=False)
    m.bias = like.bias
    return m


def cpu_lin(m: nn.Module, dtype: torch.dtype, keep: list):
    """The kernels' lmi_lin (kernels.cpu.Lin) of a packed linear layer for activations of `dtype`
    (the kind its pack says), its tensors and bias appended to `keep` (the caller holds them while
    C points into them); or why not (a str). The C layer stack (handler/model/cpu_stack.py) and the
    experts' call (handler/model/moe.py) both take their layers through this."""
    from kernels import cpu as cpu_ext
    if not isinstance(m, CpuLinear):
        return f"a {type(m).__name__} with {dtype} activations"
    bias = m.bias32
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        return "a bias not in fp32"
    got = m.pack.lin(dtype)
    if isinstance(got, str):
        return got
    kind, fields, tensors = got
    keep += [*tensors, bias]
    return cpu_ext.Lin(kind=kind, n=m.out_features, k=m.in_features, bias=None if bias is None else bias.data_ptr(),
                       **fields)


def mlp_lins(mlp: nn.Module, dtype: torch.dtype, keep: list) -> list | str:
    """A gated MLP's (layers.GatedMlp: a dense layer's, an expert's, a shared expert's) gate, up and down
    as lmi_lin records for activations of `dtype` (gate|up fused: gate holds both, up an empty record),
    or why one cannot go to C (cpu_lin's reason)."""
    from kernels import cpu as cpu_ext
    fused = mlp.gate_up_proj is not None
    parts = (mlp.gate_up_proj, None) if fused else (mlp.gate_proj, mlp.up_proj)
    lins = [cpu_ext.Lin() if m is None else cpu_lin(m, dtype, keep) for m in (*parts, mlp.down_proj)]
    return next((x for x in lins if isinstance(x, str)), lins)


def packs(model: nn.Module) -> list[Pack]:
    return [m.pack for m in model.modules() if isinstance(m, CpuLinear)]
