"""Pre-quantized checkpoints -> the grouped format of handler/model/quant_int4.py, and back (for the
`quantize-checkpoint` tool and the tests).

AutoAWQ, GEMM version (what vLLM's awq.py and transformers' AWQ integration read), per linear layer
`<prefix>.qweight` int32 [K, N/8], `.qzeros` int32 [K/g, N/8], `.scales` fp16 [K/g, N]. Eight 4-bit
codes per int32 along N, nibble i (bits 4i..4i+3) holding column 8c + AWQ_ORDER[i] (AWQ's
interleaving for its CUDA dequantizer). w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n].

GPTQ (AutoGPTQ / GPTQModel, vLLM's gptq.py): `.qweight` int32 [K/8, N] packed along K (nibble i of
row r is k = 8r + i), `.qzeros` int32 [G, N/8] packed along N in order, `.scales` fp16 [G, N],
`.g_idx` int32 [K] (the group of each input k). checkpoint_format "gptq" (v1) stores each zero
minus one (a zero of 8, symmetric, is stored as 7); "gptq_v2" stores it as is. w = (q - z) * s.
desc_act (act-order) permutes g_idx; only the identity grouping (g_idx[k] = k // g) is served.

GGUF (llama.cpp): per 32-element block along K, Q4_0: fp16 d + 16 bytes (element j in the low
nibble of byte j, element j + 16 in its high nibble), w = d (q - 8); Q4_1: fp16 d, fp16 m + 16
bytes, w = d q + m; Q5_0 / Q5_1: as Q4_0 / Q4_1 with a fifth bit per element in a 32-bit field,
w = d (q - 16) / d q + m; Q8_0: fp16 d + 32 int8, w = d q. K-quants, per 256-element superblock:
Q4_K / Q5_K eight sub-blocks of 32 with 6-bit scales and mins under fp16 d and dmin, Q6_K
sixteen sub-blocks of 16 with int8 scales under fp16 d (gguf_blocks says how each maps to the
grouped format, exactly). llama.cpp's converter permutes the rows of llama's q and k projections
(rotary pairs interleaved); that is undone here as transformers' GGUF loader undoes it (the
`llama` architecture only).
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from handler.config.numerics import Numerics
from handler.config.quantization import CheckpointQuant, checkpoint_quant, gguf_source, read_quantization_config
from handler.model.quant_int4 import Grouped, QuantLoadError, Sub, install, use_kernel

log = logging.getLogger("lmi.quant")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble i of a packed int32 holds column 8c + AWQ_ORDER[i]
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
PARTS = ("qweight", "qzeros", "scales", "g_idx")
AT_LOAD = ("awq", "gptq", "gguf", "none")     # option.quantize values handled while loading


def _nibbles(t: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> uint8 [..., C, 8]: nibble i of each int32 at index i."""
    return ((t.to(torch.int32)[..., None] >> SHIFTS) & 0xF).to(torch.uint8)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C, 8] (values 0..15) -> int32 [..., C], code i in bits 4i..4i+3."""
    v = (codes.to(torch.int64) << SHIFTS.to(torch.int64)).sum(-1)
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


# ---------------------------------------------------------------------------- AWQ
def awq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> Grouped:
    k, n8 = qweight.shape
    order = torch.tensor(AWQ_ORDER).argsort()     # column j of a pack sits at nibble order[j]
    q = _nibbles(qweight)[..., order].reshape(k, n8 * 8)
    z = _nibbles(qzeros)[..., order].reshape(qzeros.shape[0], n8 * 8)
    s = scales.float()
    if group == -1:
        group = k
    return _from_zeros(q.T, z.T, s.T, group)


def awq_pack(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict:
    """Codes q [N, K], zeros z [N, G], scales s [N, G] -> AWQ GEMM tensors."""
    n, k = q.shape
    order = list(AWQ_ORDER)
    qt = q.T.reshape(k, n // 8, 8)[..., order]
    zt = z.T.reshape(z.shape[1], n // 8, 8)[..., order]
    return {"qweight": _pack_nibbles(qt), "qzeros": _pack_nibbles(zt), "scales": s.T.contiguous().half()}


# ---------------------------------------------------------------------------- GPTQ
def gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                group: int, zeros_plus_one: bool, name: str = "") -> Grouped:
    k8, n = qweight.shape
    k = k8 * 8
    if group == -1:
        group = k
    if g_idx is not None:
        expect = torch.arange(k, dtype=torch.int64) // group
        if g_idx.shape != (k,) or not torch.equal(g_idx.to(torch.int64), expect):
            raise QuantLoadError(f"{name}.g_idx is not k // group_size (act-order / desc_act=true GPTQ); "
                                 "not supported: re-quantize with desc_act=false")
    q = _nibbles(qweight).permute(0, 2, 1).reshape(k, n)            # [K, N]: row 8r + i from nibble i
    z = _nibbles(qzeros).reshape(qzeros.shape[0], -1)[:, :n].to(torch.int16)
    if zeros_plus_one:
        z = z + 1
    return _from_zeros(q.T, z.T, scales.float().T, group)


def gptq_pack(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int, v1: bool = True) -> dict:
    """Codes q [N, K], zeros z [N, G], scales s [N, G] -> GPTQ tensors (v1: zeros stored minus one)."""
    n, k = q.shape
    qk = q.T.reshape(k // 8, 8, n).permute(0, 2, 1)                  # [K/8, N, 8]
    zs = (z.to(torch.int16) - (1 if v1 else 0)).clamp(0, 15).to(torch.uint8)   # AutoGPTQ's v1 stores z - 1 (& 0xF)
    zt = zs.T.reshape(z.shape[1], n // 8, 8)
    return {"qweight": _pack_nibbles(qk), "qzeros": _pack_nibbles(zt), "scales": s.T.contiguous().half(),
            "g_idx": (torch.arange(k, dtype=torch.int32) // group)}


def _from_zeros(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> Grouped:
    """w = (q - z) * s -> the internal q * s + m, m = -z * s (exact: z * s has <= 16 significant bits)."""
    return Grouped(q.contiguous(), s.contiguous(), (-z.float() * s).contiguous(), 4, group)


# ---------------------------------------------------------------------------- loading AWQ / GPTQ into our model
class CheckpointLoader:
    """Collects `<prefix>.qweight/.qzeros/.scales/.g_idx` while llama.load reads the safetensors,
    then installs each layer as a grouped CpuLinear (sharded for this rank)."""

    def __init__(self, cq: CheckpointQuant):
        self.cq = cq
        self.parts: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def for_dir(cls, model_dir: str, quantize: str | None) -> "CheckpointLoader | None":
        cq = checkpoint_quant(read_quantization_config(model_dir))
        if cq is None:
            return None
        if quantize not in (None, cq.method, "none"):
            raise QuantLoadError(f"option.quantize={quantize} but the checkpoint is {cq.method.upper()}-quantized "
                                 f"(config.json quantization_config.quant_method={cq.method})")
        return cls(cq)

    def take(self, key: str, f) -> bool:
        prefix, _, part = key.rpartition(".")
        if part not in PARTS:
            return False
        self.parts.setdefault(prefix, {})[part] = f.get_tensor(key)
        return True

    def grouped(self, prefix: str) -> Grouped:
        p, cq = self.parts[prefix], self.cq
        missing = [x for x in ("qweight", "qzeros", "scales") if x not in p]
        if missing:
            raise QuantLoadError(f"{prefix}: the {cq.method} checkpoint lacks {', '.join(missing)} "
                                 "(a symmetric checkpoint without zeros is not supported)")
        if cq.method == "awq":
            return awq_unpack(p["qweight"], p["qzeros"], p["scales"], cq.group_size)
        return gptq_unpack(p["qweight"], p["qzeros"], p["scales"], p.get("g_idx"), cq.group_size,
                           cq.zeros_plus_one, prefix)

    def install(self, model: nn.Module, tp, arch, spec_of, numerics: Numerics = Numerics()) -> set[str]:
        """Every collected layer into `model` (fused phi3 q/k/v and gate/up split along N first);
        returns the parameter names now filled (each layer's `.weight`)."""
        kernel = use_kernel(next(model.parameters()).device)
        modules = dict(model.named_modules())
        q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
        filled = set()
        for prefix in sorted(self.parts):
            w = self.grouped(prefix)
            if prefix.endswith(".qkv_proj"):
                sizes, names = [q, kv, kv], ["q_proj", "k_proj", "v_proj"]
            elif prefix.endswith(".gate_up_proj"):
                sizes, names = [w.shape[0] // 2] * 2, ["gate_proj", "up_proj"]
            else:
                sizes, names = [w.shape[0]], [prefix.rpartition(".")[2]]
            start = 0
            for size, leaf in zip(sizes, names):
                part = Grouped(w.q[start:start + size], w.scales[start:start + size], w.mins[start:start + size],
                               w.bits, w.group)
                start += size
                name = prefix.rpartition(".")[0] + "." + leaf
                m = modules.get(name)
                if not isinstance(m, nn.Linear):
                    raise QuantLoadError(f"unexpected quantized layer {name!r} in the checkpoint")
                part = part.cut(spec_of(name + ".weight").kind, tp.rank, tp.size, name)
                install(model, name, part, self.cq.method, kernel, numerics)
                filled.add(name + ".weight")
        log.info("%s checkpoint: %d quantized tensors (4-bit, group %d) loaded without dequantizing",
                 self.cq.method, len(self.parts), self.cq.group_size)
        return filled


# ---------------------------------------------------------------------------- GGUF
GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


# MoE (qwen2moe / qwen3moe): 3-D [experts, N, K] tensors, one grouped layer per expert; the
# shared expert's are 2-D. The routers (ffn_gate_inp, ffn_gate_inp_shexp) stay as llama.load read them.
GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
GGUF_LINEARS.update({"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                     "ffn_down_shexp": "mlp.shared_expert.down_proj"})

GGUF_SERVED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
QK_K = 256      # a K-quant superblock


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] fp32 (an fp16 field of each block)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins per superblock -> ([..., 8], [..., 8])."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale, mins


def gguf_blocks(kind: str, raw: np.ndarray, n: int, k: int) -> Grouped:
    """Raw GGUF rows [N, bytes] of type `kind` (GGUF_SERVED) -> Grouped, the weight gguf.quants
    dequantizes bit for bit (each format's value is one rounding of an exact product, see below).

    32-element blocks: Q4_0 d (q - 8), Q4_1 d q + m (4-bit codes); Q5_0 d (q - 16), Q5_1 d q + m
    (5-bit codes: the 8-bit kernel); Q8_0 d q (codes q + 128). 256-element superblocks: Q4_K and
    Q5_K, eight sub-blocks of 32 with 6-bit scale sc and min mn: w = (d sc) q - (dmin mn), i.e.
    group 32 with scale d sc and min -dmin mn, both exact in fp32 (11 + 6 bits); Q6_K, sixteen
    sub-blocks of 16 with int8 scales: w = (d sc)(q - 32), group 16, 6-bit codes (8-bit kernel)."""
    a = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        b = a.reshape(n, k // QK_K, -1)
        if kind == "Q6_K":
            ql, qh = b[..., :128], b[..., 128:192]
            sc = b[..., 192:208].view(np.int8).astype(np.float32)                        # [N, nb, 16]
            d = _f16(b[..., 208:210])
            lo = (ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0xF
            hi = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
            q = lo.reshape(n, -1, 8, 32) | (hi.reshape(n, -1, 8, 32) << 4)
            s = d[..., None] * sc                                                         # exact: 11 + 8 bits
            sub = _sub(d, sc, -32.0 * d, sc, 16)                      # min -32 d sc: the same sub-scale
            return _grouped(q.reshape(n, k), s.reshape(n, -1), -32.0 * s.reshape(n, -1), 8, 16, sub)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scale_min(b[..., 4:16])
        if kind == "Q4_K":
            qs, bits = b[..., 16:144], 4
            q = (qs.reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0xF
            q = q.reshape(n, -1, 8, 32)
        else:
            qh, qs, bits = b[..., 16:48], b[..., 48:176], 8
            lo = (qs.reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0xF
            hi = (qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            q = lo.reshape(n, -1, 8, 32) | (hi << 4)
        s = d[..., None] * sc.astype(np.float32)
        m = -(dmin[..., None] * mn.astype(np.float32))
        return _grouped(q.reshape(n, k), s.reshape(n, -1), m.reshape(n, -1), bits, 32, _sub(d, sc, -dmin, mn, 8))
    nb = k // 32
    b = a.reshape(n, nb, -1)
    d = _f16(b[..., 0:2])                                                                 # [N, nb]
    if kind == "Q8_0":
        q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return _grouped(q.reshape(n, k), d, -128.0 * d, 8, 32)
    off = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[kind]
    qs = b[..., off:off + 16]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)                                     # j < 16 low nibbles, then high
    if kind in ("Q5_0", "Q5_1"):
        qh = np.ascontiguousarray(b[..., off - 4:off]).view(np.uint32)                    # [N, nb, 1], bit j: element j
        q = q | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    bits = 4 if kind in ("Q4_0", "Q4_1") else 8
    if kind in ("Q4_1", "Q5_1"):
        return _grouped(q.reshape(n, k), d, _f16(b[..., 2:4]), bits, 32)
    return _grouped(q.reshape(n, k), d, (-8.0 if kind == "Q4_0" else -16.0) * d, bits, 32)


def _grouped(q: np.ndarray, s: np.ndarray, m: np.ndarray, bits: int, group: int, sub: Sub | None = None) -> Grouped:
    return Grouped(torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)),
                   torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)),
                   torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32)), bits, group, sub)


def _sub(d: np.ndarray, a: np.ndarray, e: np.ndarray, b: np.ndarray, sg: int) -> Sub:
    """A K-quant's two levels: superblock scales d, e [N, nb] and integer sub-scales a, b [N, nb, sg]."""
    n = d.shape[0]

    def f32(x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32).reshape(n, -1))

    def i8(x):
        return torch.from_numpy(np.ascontiguousarray(x).astype(np.int8).reshape(n, -1))

    return Sub(f32(d), i8(a), f32(e), i8(b), sg)


def _unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation: out[h, i, j] = in[h, j, i] over [heads, 2, n/heads/2]."""
    return torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)


def install_gguf(model: nn.Module, model_dir: str, tp, arch, spec_of, numerics: Numerics = Numerics()) -> int:
    """Serve the GGUF file's linear weights of GGUF_SERVED types grouped (replacing the dequantized
    ones llama.load read), the output head's too when the file has its own (`output.weight`, an
    untied head); tensors of other types stay dequantized (one log line), as do the embeddings
    (a row gather, not a GEMM). Returns how many layers are served grouped.

    llama.cpp permutes q/k rows only for the `llama` architecture (Llama, Mistral, SmolLM: its
    LlamaModel converter); qwen2 and others are stored in the checkpoint's order (as transformers'
    GGUF loader reads them)."""
    from gguf import GGUFReader

    path = gguf_source(model_dir)
    if path is None:
        raise QuantLoadError(f"option.quantize=gguf: {model_dir} was not converted from a .gguf file "
                             "(no converted_from.json naming one)")
    kernel = use_kernel(next(model.parameters()).device)
    modules = dict(model.named_modules())
    reader = GGUFReader(path)
    permuted = gguf_arch(reader) == "llama"
    done, other = 0, {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_EXPERTS and parts[3] == "weight":
            kind = t.tensor_type.name
            if kind not in GGUF_SERVED:
                other[kind] = other.get(kind, 0) + 1
                continue
            k, n, count = (int(x) for x in t.shape)
            moe = getattr(arch, "moe", None)
            if moe is None or count != moe.experts:
                raise QuantLoadError(f"GGUF tensor {t.name} holds {count} experts; config.json's experts count "
                                     f"(num_experts) is {moe.experts if moe else 0}")
            data = np.asarray(t.data).reshape(count, n, -1)
            for e in range(count):      # each expert its own grouped layer, its blocks as the file has them
                name = f"model.layers.{parts[1]}.mlp.experts.{e}.{GGUF_EXPERTS[parts[2]]}"
                m = modules.get(name)
                if not isinstance(m, nn.Linear):
                    raise QuantLoadError(f"GGUF tensor {t.name} has no layer {name} in the model")
                w = gguf_blocks(kind, data[e], n, k)
                install(model, name, w.cut(spec_of(name + ".weight").kind, tp.rank, tp.size, name), f"gguf {kind}",
                        kernel, numerics)
                done += 1
            continue
        if t.name == "output.weight" and not arch.tied:
            name, leaf = "lm_head", None
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LINEARS and parts[3] == "weight":
            name, leaf = f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}", parts[2]
        else:
            continue
        kind = t.tensor_type.name
        if kind not in GGUF_SERVED:
            other[kind] = other.get(kind, 0) + 1
            continue
        k, n = (int(x) for x in t.shape)
        w = gguf_blocks(kind, t.data, n, k)
        if permuted and leaf == "attn_q":
            w = w.rows(_unpermute_rows(n, arch.heads))
        elif permuted and leaf == "attn_k":
            w = w.rows(_unpermute_rows(n, arch.kv_heads))
        m = modules.get(name)
        if not isinstance(m, nn.Linear):
            raise QuantLoadError(f"GGUF tensor {t.name} has no layer {name} in the model")
        install(model, name, w.cut(spec_of(name + ".weight").kind, tp.rank, tp.size, name), f"gguf {kind}", kernel,
                numerics)
        done += 1
    if other:
        log.info("gguf: %s linear tensors of types our kernel does not take stay dequantized (%s)",
                 sum(other.values()), ", ".join(f"{v} {k}" for k, v in sorted(other.items())))
    return done


def gguf_arch(reader) -> str | None:
    """general.architecture of an open GGUFReader (e.g. llama, qwen2)."""
    f = reader.fields.get("general.architecture")
    if f is None or not f.data:
        return None
    return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
