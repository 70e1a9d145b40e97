"""CPU-only speed-ups, applied behind the device check (a CUDA runner never calls them).
What each one gains, measured: docs/PERFORMANCE.md, "CPU fast paths".

Linear layers: a decode step multiplies 1-64 rows by every weight, so it streams all the weights
from memory. Each replacement stays an `nn.Linear` (its class is swapped: LoRA's wrapping and
`in_features` keep working); without LoRA the original weight is dropped once packed, unless
another module shares it (a tied output head keeps the embedding's).
  PackedLinear   oneDNN's blocked layout, packed once (`mkldnn._linear_pointwise`, as vLLM's
                 `onednn_mm` and inductor's freezing do): the same GEMM without a per-call reorder.
  PanelLinear    fp32 (and widened bf16) weights in 32-column panels for kernels/cpu_gemm.c where
                 it runs (AVX-512F, a C compiler; LMI_CPU_GEMM=onednn keeps oneDNN): the next panel
                 streams into L2 while the current one multiplies, so the weight stream hides
                 under the multiplications instead of preceding them. A row's output is its
                 k-ordered FMA sum, independent of the rows beside it.
  WidenedLinear  bf16 values multiplied in fp32 where the CPU's bf16 GEMM is the slower one
                 (AVX-512 BF16 without AMX), chosen by timing both at load (`bf16_gemm_mode`):
                 bf16 products are exact in fp32, so only the sum's order differs from a bf16 GEMM.
  Bf16PanelLinear  bf16 weights in pair-interleaved 32-column panels for kernels/cpu_gemm_bf16.c,
                 at half the widened panels' bytes: `widen` (the widened GEMM's values bit for bit,
                 the weight widened in registers, fp32 FMAs; AVX-512F/BW) replaces PanelLinear's fp32
                 copy of a bf16 weight; without it AVX512-BF16 vdpbf16ps (another summation order),
                 a third candidate of the same timing where the CPU runs it.

Our own models (handler/model/llama.py) run their RMSNorm and rotary through kernels/cpu_ext.py
themselves; transformers' models (the general path) run their own forwards with these linears.

Allocator: `python -m handler serve` on a CPU host re-executes itself once with tcmalloc in
LD_PRELOAD when the system has it (as vLLM's CPU recipe): a step allocates thousands of
short-lived tensors.

Escape hatches (also the A/B switches of benchmarks/step_floor.py): LMI_CPU_PREPACK=0,
LMI_CPU_KV_LAYOUT=token
(token-major CPU KV pool, like the GPU's), LMI_CPU_MALLOC=system, LMI_CPU_BF16_GEMM=panels | bf16 | fp32
(instead of timing), LMI_CPU_GEMM=onednn.
"""
from __future__ import annotations

import functools
import glob
import logging
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from handler.config.switches import switch
from kernels import cpu_ext

log = logging.getLogger("lmi.cpu")


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward reads `packed` (oneDNN's layout of the weight)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.packed.dtype:   # e.g. a float32 caller of a bf16 model: as F.linear would refuse
            raise RuntimeError(f"PackedLinear: input dtype {x.dtype} != weight dtype {self.packed.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class WidenedLinear(nn.Linear):
    """A bf16 nn.Linear multiplied by oneDNN's fp32 GEMM: `packed` holds the weight widened to
    fp32 (exact), the input is widened (exact), each product of two bf16 values is exact in fp32
    and the sum accumulates in fp32, as a bf16 GEMM does; the output is rounded to bf16 once.
    The same values as the bf16 GEMM up to the order of the fp32 sum, at twice its weight memory;
    chosen where the CPU's bf16 GEMM is the slower one (see bf16_gemm_mode)."""

    packed: torch.Tensor
    bias32: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise RuntimeError(f"WidenedLinear: input dtype {x.dtype} != weight dtype torch.bfloat16")
        y = torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.bias32, "none", [], "")
        return y.to(torch.bfloat16)


class PanelLinear(nn.Linear):
    """An nn.Linear multiplied by kernels/cpu_gemm.c from `panels` (the weight in 32-column
    panels, fp32): an fp32 weight as it is, a bf16 weight widened to fp32 (`widen`, exact, as
    WidenedLinear: the input widened, the output rounded to bf16 once)."""

    panels: torch.Tensor
    bias32: torch.Tensor | None
    widen: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        want = torch.bfloat16 if self.widen else torch.float32
        if x.dtype != want:
            raise RuntimeError(f"PanelLinear: input dtype {x.dtype} != weight dtype {want}")
        y = cpu_ext.gemm(x.float() if self.widen else x, self.panels, self.out_features, self.bias32)
        return y.to(torch.bfloat16) if self.widen else y


class Bf16PanelLinear(nn.Linear):
    """A bf16 nn.Linear multiplied by kernels/cpu_gemm_bf16.c from `panels` (the bf16 weight in
    pair-interleaved 32-column panels): the products of the same bf16 values summed in fp32 (+ the
    bias, fp32), rounded to bf16 once. `widen`: fp32 FMAs in k order, PanelLinear's widened values
    bit for bit at half its weight memory; else vdpbf16ps (pairs of products per instruction)."""

    panels: torch.Tensor
    bias32: torch.Tensor | None
    widen: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise RuntimeError(f"Bf16PanelLinear: input dtype {x.dtype} != weight dtype torch.bfloat16")
        return cpu_ext.gemm_bf16(x, self.panels, self.out_features, self.bias32, widen=self.widen)


def _switched_off(name: str) -> bool:
    """An on-by-default switch (LMI_CPU_PREPACK, ...; handler/config/switches.py) set to 0 / false / no / off."""
    return not switch(name)


def head_major_kv() -> bool:
    """The CPU KV pool's layout: head-major (default) or token-major (LMI_CPU_KV_LAYOUT=token)."""
    return switch("LMI_CPU_KV_LAYOUT") != "token"


TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")


def find_tcmalloc(dirs=TCMALLOC_DIRS) -> str | None:
    for d in dirs:
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            hits = sorted(glob.glob(os.path.join(d, name)))
            if hits:
                return hits[0]
    return None


def preload_env(env, dirs=TCMALLOC_DIRS) -> dict | None:
    """The environment to re-execute the server with (tcmalloc first in LD_PRELOAD), or None:
    opted out (LMI_CPU_MALLOC=system), already preloaded, or no tcmalloc on this system."""
    if switch("LMI_CPU_MALLOC", env) == "system":
        return None
    preload = env.get("LD_PRELOAD", "")
    if "tcmalloc" in preload:
        return None
    lib = find_tcmalloc(dirs)
    if lib is None:
        return None
    return dict(env, LD_PRELOAD=f"{lib}:{preload}" if preload else lib)


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


def _gemm_seconds(m: int, k: int, n: int, mode: str, reps: int = 5) -> float:
    """The best of `reps` timed calls of an [m, k] bf16 input through a bf16 k -> n linear layer
    packed as a model's would be for `mode`: "fp32" widened, "bf16" oneDNN's bf16 (or the plain
    layer's F.linear on a CPU without it), "panels" kernels/cpu_gemm_bf16.c's."""
    lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    prepack_linears(nn.Sequential(lin), widen_bf16=mode == "fp32", bf16_panels=mode == "panels")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    best, calls, start = float("inf"), 0, time.perf_counter()
    with torch.inference_mode():
        lin(x)
        # At least `reps` calls and 20 ms: a small GEMM takes tens of microseconds, and one
        # preempted call must not decide.
        while calls < reps or time.perf_counter() - start < 0.02:
            t = time.perf_counter()
            lin(x)
            best = min(best, time.perf_counter() - t)
            calls += 1
    return best


@functools.lru_cache(maxsize=None)
def _bf16_gemm_times(k: int, n: int, rows: tuple, modes: tuple) -> dict:
    """{mode: (seconds per row count)}, measured once per process, shape and set of modes (the
    CPU does not change: every runner of a process decides alike). Each mode's best of three
    rounds, the modes alternating, so a burst of other load falls on all."""
    out = {mode: [] for mode in modes}
    for r in rows:
        best = {mode: float("inf") for mode in modes}
        for _ in range(3):
            for mode in modes:
                best[mode] = min(best[mode], _gemm_seconds(r, k, n, mode))
        for mode in modes:
            out[mode].append(best[mode])
    return {mode: tuple(v) for mode, v in out.items()}


BF16_GEMM_MARGIN = 1.15     # fp32 must be this much faster to be worth twice the weight memory


def bf16_panels_available() -> bool:
    """Whether bf16 GEMMs may go to kernels/cpu_gemm_bf16.c: panels are wanted (LMI_CPU_GEMM) and
    the CPU runs its AVX512-BF16 instructions."""
    return panels_wanted() and cpu_ext.gemm_bf16_available()


def widen_in_registers() -> bool:
    """Whether widened bf16 GEMMs keep the bf16 weights (kernels/cpu_gemm_bf16.c widens them in
    registers, AVX-512F/BW) instead of an fp32 copy: panels are wanted and the kernel runs here."""
    return panels_wanted() and cpu_ext.gemm_bf16w_available()


# The row counts a bf16 model's GEMMs are timed at: one sequence decoding, a busy decode step (a
# count that is no multiple of a library's blocking, as the engine's steps mostly are) and a
# prompt chunk. On the EPYC host oneDNN's bf16 GEMM was level with the panels at 64 and 512 rows
# but 1.5x slower at 1 row and 1.06x at 50 (hot in cache; from memory, as serving reads the
# weights, 1.8x and 1.2x): timed at 64 and 512 alone it was chosen, and decoding ran 1.5x slower.
BF16_TIMING_ROWS = (1, 50, 512)


def bf16_gemm_mode(model: nn.Module, rows=BF16_TIMING_ROWS) -> tuple[str, str]:
    """How this bf16 model's linears multiply (one of BF16_MODES), and why: "panels"
    (Bf16PanelLinear by vdpbf16ps), "bf16" (oneDNN's bf16 GEMM, PackedLinear) or "fp32" (widened:
    Bf16PanelLinear with widen where widen_in_registers(), else PanelLinear or WidenedLinear on an
    fp32 copy, twice the weight memory).

    LMI_CPU_BF16_GEMM=panels | bf16 | fp32 decides (panels where the CPU lacks the kernel: bf16);
    auto (the default) times the model's widest linear shape (the output head aside) every
    eligible way at BF16_TIMING_ROWS (decode-sized and prefill-sized row counts). oneDNN's bf16
    is taken over a panel way only when it is BF16_GEMM_MARGIN faster at every row count (the
    panel ways also run the one-call decode stack). Where fp32 keeps the bf16 weights, the way with
    the smallest product of the times. Else, of the two that keep bf16
    weights (panels where the kernel runs, oneDNN's) the faster that way, then fp32 only when it
    beats that one at every row count by BF16_GEMM_MARGIN and the fp32 copies fit in a quarter
    of the memory available. CPUs with AMX multiply bf16 ~2x faster than fp32 in oneDNN; on
    AVX-512 BF16 without AMX the dev machine's oneDNN bf16 GEMM ran at 0.55-0.65x fp32's speed,
    vdpbf16ps at about 0.8x the fp32 FMAs' products per second (docs/PERFORMANCE.md)."""
    if _switched_off("LMI_CPU_PREPACK"):
        return "bf16", "LMI_CPU_PREPACK=0: the linear layers stay as the model built them"
    choice = switch("LMI_CPU_BF16_GEMM")
    if choice in ("bf16", "fp32"):
        return choice, f"LMI_CPU_BF16_GEMM={choice}"
    if choice == "panels":
        if bf16_panels_available():
            return "panels", "LMI_CPU_BF16_GEMM=panels"
        return "bf16", ("LMI_CPU_BF16_GEMM=panels, but kernels/cpu_gemm_bf16.c does not run here "
                        "(AVX512-BF16 and LMI_CPU_GEMM=panels needed): oneDNN's bf16")
    ignored = "" if choice == "auto" else f"; LMI_CPU_BF16_GEMM={choice!r} ignored (auto, panels, bf16 or fp32)"
    lin = [m for _, m in _linears(model) if m.weight.dtype == torch.bfloat16]
    if not lin:
        return "bf16", "no bf16 linear layers" + ignored
    modes = ["bf16"] + (["panels"] if bf16_panels_available() else [])
    notes = []
    extra = 4 * sum(m.weight.numel() for m in lin)
    avail = _mem_available()
    free_widen = widen_in_registers()
    if free_widen:
        modes.append("fp32")
    elif not can_prepack(torch.float32):
        notes.append("oneDNN cannot take fp32 here: not widened")
    elif avail is not None and extra > avail // 4:
        notes.append(f"fp32 copies of the linear weights ({extra / 2**30:.1f} GiB) would take more "
                     f"than a quarter of the memory available ({avail / 2**30:.1f} GiB)")
    else:
        modes.append("fp32")
    if len(modes) == 1:
        return "bf16", "; ".join(notes) + ignored
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = [m for m in lin if m is not head] or lin
    widest = max(body, key=lambda m: m.weight.numel())
    n, k = widest.weight.shape
    try:
        times = _bf16_gemm_times(k, n, tuple(rows), tuple(modes))
    except RuntimeError as e:       # a build or CPU oneDNN refuses: keep the model as it is
        return "bf16", f"the GEMMs could not be timed ({e})" + ignored
    def beats(a: str, b: str) -> bool:     # way a faster than way b by the margin at every row count
        return all(x * BF16_GEMM_MARGIN <= y for x, y in zip(times[a], times[b]))

    # oneDNN's bf16 only where it beats the panel ways by the margin: those also let a decode step
    # run as one C call (handler/model/cpu_stack.py; 1.46x a one-row bf16 step), which a GEMM
    # timing does not see.
    narrow = "bf16"
    if "panels" in times and not beats("bf16", "panels"):
        narrow = "panels"
    pick = narrow
    if free_widen:      # the same weight memory every way: the fastest
        pick = min(modes, key=lambda mode: math.prod(times[mode]))
        ours = [m for m in modes if m != "bf16"]
        if pick == "bf16" and not all(beats("bf16", m) for m in ours):
            pick = min(ours, key=lambda mode: math.prod(times[mode]))
    elif "fp32" in times and all(t >= BF16_GEMM_MARGIN * f for t, f in zip(times[narrow], times["fp32"])):
        pick = "fp32"
    shown = "; ".join(f"{r} rows " + ", ".join(f"{mode} {1e3 * times[mode][i]:.2f} ms" for mode in modes)
                      for i, r in enumerate(rows))
    why = f"GEMM times on a {k}x{n} weight: {shown}"
    return pick, "; ".join([why, *notes]) + ignored


def panels_wanted() -> bool:
    """Whether fp32 GEMMs (and widened bf16 ones) go to kernels/cpu_gemm.c: it runs on this CPU
    and LMI_CPU_GEMM is not `onednn` (which keeps bf16 ones off kernels/cpu_gemm_bf16.c too)."""
    choice = switch("LMI_CPU_GEMM")
    if choice == "onednn":
        return False
    if choice != "panels":
        log.warning("LMI_CPU_GEMM=%r ignored (allowed: panels, onednn); using panels where the CPU runs them",
                    choice)
    return cpu_ext.gemm_available()


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


def prepack_linears(model: nn.Module, keep_weights: bool = False, widen_bf16: bool = False,
                    bf16_panels: bool = False) -> int:
    """Swap every plain nn.Linear on CPU for a PanelLinear where kernels/cpu_gemm.c serves (fp32
    weights, and bf16 ones when widen_bf16 where the bf16 panels cannot widen them), a
    Bf16PanelLinear for bf16 weights where kernels/cpu_gemm_bf16.c serves (widened in registers
    when widen_bf16, by vdpbf16ps when bf16_panels), else a PackedLinear (WidenedLinear for bf16
    weights when widen_bf16); returns how many were packed. keep_weights: leave the original weights in place
    (LoRA reads their shape and dtype)."""
    tied = {id(p) for name, m in model.named_modules() if not isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)}
    if _switched_off("LMI_CPU_PREPACK"):
        return 0
    panels = panels_wanted()
    dot = bf16_panels and not widen_bf16 and panels and cpu_ext.gemm_bf16_available()
    in_registers = widen_bf16 and panels and cpu_ext.gemm_bf16w_available()
    done = 0
    for name, m in _linears(model):
        widen = widen_bf16 and m.weight.dtype == torch.bfloat16
        if m.weight.dtype == torch.bfloat16 and (dot or (widen and in_registers)):
            with torch.no_grad():
                m.panels = cpu_ext.pack_bf16(m.weight.detach())
            m.widen, cls = widen, Bf16PanelLinear
        elif panels and (widen or m.weight.dtype == torch.float32):
            with torch.no_grad():
                m.panels = cpu_ext.pack_panels(m.weight.detach().float())
            m.widen, cls = widen, PanelLinear
        else:
            packed = _onednn_pack(name, m.weight, widen)
            if packed is None:
                continue
            m.packed, cls = packed, WidenedLinear if widen else PackedLinear
        if cls is not PackedLinear:     # an fp32 GEMM: the bias in fp32
            m.bias32 = None if m.bias is None else m.bias.detach().float().contiguous()
        m.__class__ = cls
        if not keep_weights and id(m.weight) not in tied:
            # The packed copy replaces it; an empty tensor keeps dtype/device for readers.
            m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        done += 1
    return done
