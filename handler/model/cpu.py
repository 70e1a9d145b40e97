"""CPU-only speed-ups, applied behind the device check (a CUDA runner never calls them).
What each one gains, measured: docs/PERFORMANCE.md, "CPU fast paths".

Linear layers: a decode step multiplies 1-64 rows by every weight, so it streams all the weights
from memory. prepack_linears puts a handler/model/linear.py CpuLinear in each plain nn.Linear's place,
holding one of these packs (an nn.Linear still: LoRA's wrapping and `in_features` keep working);
without LoRA the original weight is dropped once packed, unless another module shares it (a tied
output head keeps the embedding's).
  OneDnnPack     oneDNN's blocked layout, packed once (`mkldnn._linear_pointwise`, as vLLM's
                 `onednn_mm` and inductor's freezing do): the same GEMM without a per-call reorder.
                 `widen` (bf16_gemm=fp32 where no widening panel kernel runs): bf16 values multiplied
                 in fp32 over an fp32 copy: bf16 products are exact in fp32, so only the sum's order
                 differs from a bf16 GEMM. Which way a bf16 model multiplies is a rule on the CPU's
                 instructions (`bf16_gemm_mode`), never a timing.
  PanelPack      fp32 (and widened bf16) weights in 32-column panels for kernels/cpu_gemm.c where
                 it runs (the avx512, avx2 or neon backend, kernels/isa.py; the gemm=onednn arm keeps
                 oneDNN): the next panel streams into L2 while the current one multiplies, so the
                 weight stream hides under the multiplications instead of preceding them. A row's
                 output is its k-ordered FMA sum, independent of the rows beside it.
  Bf16PanelPack  bf16 weights in pair-interleaved 32-column panels for kernels/cpu_gemm_bf16.c,
                 at half the widened panels' bytes: `widen` (the widened GEMM's values bit for bit,
                 the weight widened in registers, fp32 FMAs) replaces PanelPack's fp32 copy of a
                 bf16 weight; or AVX512-BF16 vdpbf16ps (another summation order) where the CPU has it.

Placement: every packed weight (the panels above, quantized codes, scales and mins) is allocated by
kernels/cpu/'s empty_hugepage: its whole 2 MiB pages advised MADV_HUGEPAGE before they are
written, so Linux's transparent huge pages hold what a 1-row step streams with 512x fewer TLB
entries (LMI_CPU_HUGEPAGES=0: torch's allocator; benchmarks/results/hugepages/). `hugepage_report`
is the load log's line.

Our own models (handler/model/llama.py) run their RMSNorm and rotary through kernels/cpu/
themselves; transformers' models (the general path) run their own forwards with these linears.

Allocator: `python -m handler serve` on a CPU host re-executes itself once with tcmalloc in
LD_PRELOAD when the system has it (as vLLM's CPU recipe): a step allocates thousands of
short-lived tensors.

A/B arms (`Arms`, benchmark-only: a ModelRunner constructor argument that benchmarks/step_floor.py
--arm and tests pass; no module state and never read from the environment, so every server runs the
defaults): prepack=0 (plain `nn.Linear`), gemm=onednn, bf16_gemm=
panels | bf16 | fp32 (instead of the rule), kv_layout=token (token-major KV pool, like the GPU's),
decode_stack=0 (handler/model/cpu_stack.py off), moe_kernel=0 (a mixture's experts one by one in
Python, handler/model/moe.py). The server's own CPU settings are option.cpu_kernels and
LMI_CPU_MALLOC=system.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os

import torch
from torch import nn

from handler.config.switches import switch
from handler.model.linear import CpuLinear, Pack, packs, replace
from kernels import cpu as cpu_ext

log = logging.getLogger("lmi.cpu")


@dataclasses.dataclass(eq=False)
class OneDnnPack(Pack):
    """oneDNN's blocked layout (`packed`), multiplied by `mkldnn._linear_pointwise`. `widen`: a bf16
    layer whose `packed` holds the weight widened to fp32 (exact), the input widened (exact), each
    product of two bf16 values exact in fp32 and summed in fp32 as a bf16 GEMM does, the output
    rounded to bf16 once: the bf16 GEMM's values up to the order of the fp32 sum, at twice its weight
    memory; chosen where the CPU's bf16 GEMM is the slower one (see bf16_gemm_mode)."""
    packed: torch.Tensor
    widen: bool

    def forward(self, x: torch.Tensor, layer: CpuLinear) -> torch.Tensor:
        if self.widen:
            if x.dtype != torch.bfloat16:
                raise RuntimeError(f"widened oneDNN linear: input dtype {x.dtype} != weight dtype torch.bfloat16")
            y = torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, layer.bias32, "none", [], "")
            return y.to(torch.bfloat16)
        if x.dtype != self.packed.dtype:   # e.g. a float32 caller of a bf16 model: as F.linear would refuse
            raise RuntimeError(f"oneDNN linear: input dtype {x.dtype} != weight dtype {self.packed.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, layer.bias, "none", [], "")

    def held(self) -> list[torch.Tensor]:
        return [self.packed]


@dataclasses.dataclass(eq=False)
class PanelPack(Pack):
    """The weight in 32-column fp32 panels, multiplied by kernels/cpu_gemm.c: an fp32 weight as it
    is, a bf16 weight widened to fp32 (`widen`, exact, as OneDnnPack's: the input widened, the output
    rounded to bf16 once)."""
    panels: torch.Tensor
    widen: bool

    def forward(self, x: torch.Tensor, layer: CpuLinear) -> torch.Tensor:
        want = torch.bfloat16 if self.widen else torch.float32
        if x.dtype != want:
            raise RuntimeError(f"fp32 panel linear: input dtype {x.dtype} != weight dtype {want}")
        y = cpu_ext.gemm(x.float() if self.widen else x, self.panels, layer.out_features, layer.bias32)
        return y.to(torch.bfloat16) if self.widen else y

    def tensors(self) -> list[torch.Tensor]:
        return [self.panels]

    def lin(self, dtype):
        if self.widen or dtype != torch.float32:
            return super().lin(dtype)
        return cpu_ext.LIN_F32, {"panels": self.panels.data_ptr()}, [self.panels]


@dataclasses.dataclass(eq=False)
class Bf16PanelPack(Pack):
    """The bf16 weight in pair-interleaved 32-column panels, multiplied by kernels/cpu_gemm_bf16.c:
    the products of the same bf16 values summed in fp32 (+ the bias, fp32), rounded to bf16 once.
    `widen`: fp32 FMAs in k order, PanelPack's widened values bit for bit at half its weight memory;
    else vdpbf16ps (pairs of products per instruction)."""
    panels: torch.Tensor
    widen: bool

    def forward(self, x: torch.Tensor, layer: CpuLinear) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise RuntimeError(f"bf16 panel linear: input dtype {x.dtype} != weight dtype torch.bfloat16")
        return cpu_ext.gemm_bf16(x, self.panels, layer.out_features, layer.bias32, widen=self.widen)

    def tensors(self) -> list[torch.Tensor]:
        return [self.panels]

    def lin(self, dtype):
        if dtype != torch.bfloat16:
            return super().lin(dtype)
        return (cpu_ext.LIN_BF16W if self.widen else cpu_ext.LIN_BF16), {"panels": self.panels.data_ptr()}, \
            [self.panels]


@dataclasses.dataclass(frozen=True)
class Arms:
    """The CPU paths' A/B arms (module doc): a ModelRunner's `arms`, passed down to what it builds."""
    prepack: bool = True        # linears packed for the panel kernels or oneDNN; False: plain nn.Linear
    gemm: str = "panels"        # panels: kernels/cpu_gemm*.c where the CPU runs them; onednn: oneDNN's
    bf16_gemm: str = "auto"     # bf16 models: auto (the rule, bf16_gemm_mode) | panels | bf16 | fp32
    kv_layout: str = "head"     # CPU KV pool: head-major, or token-major like the GPU's
    decode_stack: bool = True   # our models: a step's layers in one C call (handler/model/cpu_stack.py)
    moe_kernel: bool = True     # our MoE models: a step's rows through the experts in one C call (moe.py)

    CHOICES = {"gemm": ("panels", "onednn"), "bf16_gemm": ("auto", "panels", "bf16", "fp32"),
               "kv_layout": ("head", "token")}

    def with_(self, **arms) -> "Arms":
        """These arms with some set by name (strings as a command line gives them: 0/1 for the
        flags); ValueError naming the arm and its values for anything else."""
        got = {}
        for name, value in arms.items():
            if name not in {f.name for f in dataclasses.fields(self)}:
                raise ValueError(f"no A/B arm {name!r} (arms: {', '.join(f.name for f in dataclasses.fields(self))})")
            allowed = self.CHOICES.get(name, ("0", "1"))
            v = str(value).strip().lower()
            if isinstance(value, bool):
                v = str(int(value))
            if v not in allowed:
                raise ValueError(f"A/B arm {name}={value!r}: allowed {', '.join(allowed)}")
            got[name] = v if name in self.CHOICES else v == "1"
        return dataclasses.replace(self, **got)

    @classmethod
    def parse(cls, specs: list[str]) -> "Arms":
        """Arms from NAME=VALUE strings (a command line's --arm flags); ValueError naming the bad one."""
        arms = {}
        for spec in specs:
            name, sep, value = spec.partition("=")
            if not sep:
                raise ValueError(f"--arm {spec!r}: expected NAME=VALUE")
            arms[name.strip()] = value
        return cls().with_(**arms)


DEFAULT = Arms()    # what every server runs


def head_major_kv(arms: Arms = DEFAULT) -> bool:
    """The CPU KV pool's layout: head-major (default) or token-major (the kv_layout=token arm)."""
    return arms.kv_layout != "token"


TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")


def find_tcmalloc(dirs=TCMALLOC_DIRS) -> str | None:
    for d in dirs:
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            hits = sorted(glob.glob(os.path.join(d, name)))
            if hits:
                return hits[0]
    return None


def preload_env(env, dirs=TCMALLOC_DIRS, cpu_kernels: str = "auto", flags: set[str] | None = None) -> dict | None:
    """The environment to re-execute the server with, or None when nothing changes:
    - tcmalloc first in LD_PRELOAD, unless opted out (LMI_CPU_MALLOC=system), already preloaded,
      or the system has none;
    - ATEN_CPU_CAPABILITY=avx2 where option.cpu_kernels=avx2 on a CPU with AVX-512 (unless set):
      torch's own vector kernels at the C kernels' width, so the one-call layer stack reproduces
      torch's SiLU and the server computes what it computes on an AVX2-only host (one fleet of
      mixed hosts, one answer)."""
    new = dict(env)
    preload = env.get("LD_PRELOAD", "")
    if switch("LMI_CPU_MALLOC", env) != "system" and "tcmalloc" not in preload:
        lib = find_tcmalloc(dirs)
        if lib is not None:
            new["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    flags = cpu_ext.cpu_flags() if flags is None else flags
    if cpu_kernels == "avx2" and "avx512f" in flags and not env.get("ATEN_CPU_CAPABILITY"):
        new["ATEN_CPU_CAPABILITY"] = "avx2"
    return None if new == dict(env) else new


def can_prepack(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


def _linears(model: nn.Module):
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m.weight.device.type == "cpu"]


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


BF16_MODES = ("panels", "bf16", "fp32")   # how a bf16 model's linears multiply (bf16_gemm_mode)


def bf16_panels_available(arms: Arms = DEFAULT) -> bool:
    """Whether bf16 GEMMs may go to kernels/cpu_gemm_bf16.c: panels are wanted (the gemm arm) and
    the CPU runs its AVX512-BF16 instructions."""
    return panels_wanted(arms) and cpu_ext.gemm_bf16_available()


def widen_in_registers(arms: Arms = DEFAULT) -> bool:
    """Whether widened bf16 GEMMs keep the bf16 weights (kernels/cpu_gemm_bf16.c widens them in
    registers, AVX-512F/BW) instead of an fp32 copy: panels are wanted and the kernel runs here."""
    return panels_wanted(arms) and cpu_ext.gemm_bf16w_available()


def bf16_gemm_mode(model: nn.Module, arms: Arms = DEFAULT) -> tuple[str, str]:
    """How this bf16 model's linears multiply (one of BF16_MODES), and why: "panels"
    (Bf16PanelPack by vdpbf16ps), "bf16" (oneDNN's bf16 GEMM, OneDnnPack) or "fp32" (widened:
    Bf16PanelPack with widen where widen_in_registers(), else PanelPack or a widened OneDnnPack on an
    fp32 copy, twice the weight memory).

    A rule on what the CPU has, never a timing: the numerics (and so the greedy text) of every
    replica of an endpoint on one kind of instance are the same whatever the load at start-up.
    The bf16_gemm arm (`arms`, A/B runs) forces one. `auto`:
      AMX (amx_bf16)                 oneDNN's bf16: AMX tiles multiply bf16 about twice as fast as fp32
      AVX512-BF16 (kernels built)    panels: vdpbf16ps, half the weight bytes of fp32 per step
      widening kernels built         fp32 over the bf16 weights, widened in registers (no copy)
      otherwise                      oneDNN's bf16 (its own widening where the CPU has no bf16)"""
    if not arms.prepack:
        return "bf16", "the prepack=0 arm: the linear layers stay as the model built them"
    choice = arms.bf16_gemm
    if choice in ("bf16", "fp32"):
        return choice, f"the bf16_gemm={choice} arm"
    if choice == "panels":
        if bf16_panels_available(arms):
            return "panels", "the bf16_gemm=panels arm"
        return "bf16", ("the bf16_gemm=panels arm, but kernels/cpu_gemm_bf16.c does not run here "
                        "(AVX512-BF16 and the panels needed): oneDNN's bf16")
    if not any(m.weight.dtype == torch.bfloat16 for _, m in _linears(model)):
        return "bf16", "no bf16 linear layers"
    if "amx_bf16" in cpu_ext.cpu_flags() and can_prepack(torch.bfloat16):
        return "bf16", "the CPU has AMX: oneDNN's bf16"
    if bf16_panels_available(arms):
        return "panels", "the CPU has AVX512-BF16: vdpbf16ps panels"
    if widen_in_registers(arms):
        return "fp32", "no bf16 dot product here: the bf16 weights widened in registers, fp32 FMAs"
    return "bf16", "no bf16 panel kernel here: oneDNN's bf16"


def panels_wanted(arms: Arms = DEFAULT) -> bool:
    """Whether fp32 GEMMs (and widened bf16 ones) go to kernels/cpu_gemm.c: it runs on this CPU
    and the gemm arm is not `onednn` (which keeps bf16 ones off kernels/cpu_gemm_bf16.c too)."""
    return arms.gemm != "onednn" and cpu_ext.gemm_available()


def _onednn_pack(name: str, weight: torch.Tensor, widen: bool) -> torch.Tensor | None:
    """The weight in oneDNN's layout (widened to fp32 when `widen`), or None where oneDNN cannot
    take it (its dtype on this CPU, or a shape or build it refuses: the layer stays as it was)."""
    if not can_prepack(torch.float32 if widen else weight.dtype):
        return None
    try:
        with torch.no_grad():
            w = weight.detach()
            return torch.ops.mkldnn._reorder_linear_weight(w.float() if widen else w)
    except RuntimeError as e:
        log.debug("not prepacking %s: %s", name, e)
        return None


def streamed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The packed weights a 1-row step streams (panels of every kind, grouped codes, scales and mins)."""
    return [t for p in packs(model) for t in p.tensors() if t.device.type == "cpu"]


def hugepage_report(model: nn.Module) -> str:
    """One line for the load log: how the packed weights sit in memory (kernels/cpu/'s
    empty_hugepage; LMI_CPU_HUGEPAGES)."""
    ts = streamed_tensors(model)
    if not ts:
        return "huge pages: no packed weights"
    p = cpu_ext.hugepage_placement(ts)
    mb = p["bytes"] / 1e6
    if not cpu_ext.hugepages_wanted():
        why = "LMI_CPU_HUGEPAGES=0" if switch("LMI_CPU_HUGEPAGES") in ("0", "false", "no", "off") else \
            "madvise unavailable or refused"
        return f"huge pages: off ({why}); {mb:,.0f} MB of packed weights in 4 KiB pages"
    return (f"huge pages: {p['advised_bytes'] / 1e6:,.0f} of {mb:,.0f} MB of packed weights advised MADV_HUGEPAGE, "
            f"{p['huge_kib'] / 1024:,.0f} MiB of them in 2 MiB pages (THP {cpu_ext.thp_mode() or 'unknown'}; "
            "LMI_CPU_HUGEPAGES=0 turns it off)")


def prepack_linears(model: nn.Module, keep_weights: bool = False, widen_bf16: bool = False,
                    bf16_panels: bool = False, arms: Arms = DEFAULT) -> int:
    """Replace every plain nn.Linear on CPU by a CpuLinear whose pack is PanelPack where
    kernels/cpu_gemm.c serves (fp32 weights, and bf16 ones when widen_bf16 where the bf16 panels cannot
    widen them), Bf16PanelPack for bf16 weights where kernels/cpu_gemm_bf16.c serves (widened in
    registers when widen_bf16, by vdpbf16ps when bf16_panels), else OneDnnPack (widened for bf16
    weights when widen_bf16); returns how many were packed. keep_weights: leave the original weights in
    place (LoRA reads their shape and dtype); a weight another module shares (a tied head) stays too.
    arms: the prepack and gemm A/B arms."""
    tied = {id(p) for name, m in model.named_modules() if not isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)}
    if not arms.prepack:
        return 0
    panels = panels_wanted(arms)
    dot = bf16_panels and not widen_bf16 and panels and cpu_ext.gemm_bf16_available()
    in_registers = widen_bf16 and panels and cpu_ext.gemm_bf16w_available()
    done = 0
    for name, m in _linears(model):
        widen = widen_bf16 and m.weight.dtype == torch.bfloat16
        with torch.no_grad():
            w = m.weight.detach()
            if w.dtype == torch.bfloat16 and (dot or (widen and in_registers)):
                pack = Bf16PanelPack(cpu_ext.pack_bf16(w), widen)
            elif panels and (widen or w.dtype == torch.float32):
                pack = PanelPack(cpu_ext.pack_panels(w.float()), widen)
            else:
                packed = _onednn_pack(name, m.weight, widen)
                if packed is None:
                    continue
                pack = OneDnnPack(packed, widen)
        replace(model, name, CpuLinear(m, pack, keep_weight=keep_weights or id(m.weight) in tied))
        done += 1
    return done


def prepack_by_rule(model: nn.Module, dtype: torch.dtype, keep_weights: bool = False,
                    arms: Arms = DEFAULT) -> tuple[int, str, str | None]:
    """prepack_linears as this CPU's rule has it for a model of `dtype`: bf16 layers as bf16_gemm_mode
    says (vdpbf16ps panels, widened to fp32, or oneDNN's bf16), others as prepack_linears packs them.
    Returns (layers packed, the bf16 mode, why; why is None for another dtype)."""
    mode, why = bf16_gemm_mode(model, arms) if dtype == torch.bfloat16 else ("bf16", None)
    n = prepack_linears(model, keep_weights, widen_bf16=mode == "fp32", bf16_panels=mode == "panels", arms=arms)
    return n, mode, why
