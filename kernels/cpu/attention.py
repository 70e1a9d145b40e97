"""Attention over the paged KV pool in C (kernels/cpu_decode.c, cpu_layer.c), and a whole decode
step's layers in one call. Decode rows read the pool in place instead of gathering their blocks
into a copy that a batched matmul then reads again (kernels/torch_paged.py)."""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu.args import KV_DTYPES, plain as _plain
from kernels.cpu.bindings import ENUM, STRUCTS
from kernels.cpu.lib import load
from kernels.pool import KVPool, as_pool
from kernels.step import prompt_table


def supports(key_cache: KVPool | torch.Tensor) -> bool:
    """Whether the kernels read this pool: on the CPU, fp32/bf16, or int8 with its row scales, the
    head dim contiguous."""
    pool = as_pool(key_cache)
    return (pool.device.type == "cpu" and pool.data.stride(-1) == 1
            and (pool.dtype in KV_DTYPES or pool.int8))


def write_kv(key_cache: KVPool | torch.Tensor, value_cache: KVPool | torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Store key/value [T, Hkv, D] at slot_mapping [T] (< 0: skip) in place, as
    torch_paged.write_kv does; False (nothing written) when the kernel cannot take these tensors.
    An int8 pool stores each (token, head) row quantized with its scale (kernels/cpu_kv.c)."""
    fn = load()
    kp, vp = as_pool(key_cache), as_pool(value_cache)
    kc, vc = kp.data, vp.data
    if (fn is None or not supports(kp) or kp.int8 != vp.int8 or key.dtype not in KV_DTYPES
            or (not kp.int8 and key.dtype != kc.dtype) or not _kv_rows_fit(kc, vc, key, value)):
        return False
    t, hkv, d = key.shape
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (t,):
        return False
    nb, bs = kc.shape[:2]
    if kp.int8:
        rc = fn.write_kv_i8(kc.data_ptr(), vc.data_ptr(), kp.scales.data_ptr(), vp.scales.data_ptr(), key.data_ptr(),
                            value.data_ptr(), KV_DTYPES[key.dtype], kc.stride(0), kc.stride(1), kc.stride(2),
                            key.stride(0), key.stride(1), value.stride(0), value.stride(1), slots.data_ptr(),
                            t, hkv, d, bs, nb * bs)
    else:
        rc = fn.write_kv(kc.data_ptr(), vc.data_ptr(), key.data_ptr(), value.data_ptr(),
                         kc.element_size(), kc.stride(0), kc.stride(1), kc.stride(2),
                         key.stride(0), key.stride(1), value.stride(0), value.stride(1), slots.data_ptr(),
                         t, hkv, d, bs, nb * bs)
    if rc != 0:
        raise IndexError(f"write_kv: a slot is past the pool's {nb * bs} slots")
    return True


def _kv_rows_fit(key_cache, value_cache, key, value) -> bool:
    """The checks every KV write makes: pools laid out alike, CPU rows of one dtype, contiguous
    in the head dimension, shaped [tokens, kv_heads, head_dim] to fit the pool's rows."""
    return (key_cache.stride() == value_cache.stride() and value.dtype == key.dtype
            and key.device.type == "cpu" and key.stride(-1) == 1 and value.stride(-1) == 1
            and key.shape == value.shape and key.shape[1:] == key_cache.shape[2:])


def decode_attention(query: torch.Tensor, key_cache: KVPool | torch.Tensor, value_cache: KVPool | torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """query [B, H, D] (one row per sequence), pools [NB, bs, Hkv, D], tables [B, W] (block ids,
    entries past a sequence's last block unused), lens [B] -> fp32 [B, H, D]."""
    fn = load()
    if fn is None:
        raise RuntimeError("the CPU decode-attention kernel is not available")
    kp, vp = as_pool(key_cache), as_pool(value_cache)
    kc, vc = kp.data, vp.data
    b, h, d = query.shape
    nb, bs, hkv, _ = kc.shape
    if kc.stride() != vc.stride() or kc.dtype != vc.dtype:
        raise ValueError("key and value pools must share dtype and layout")
    q = query.to(torch.float32).contiguous()
    tbl = tables.to(torch.int32).contiguous()
    ln = lens.to(torch.int32).contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    if kp.int8:
        rc = fn.decode_attention_i8(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), kp.scales.data_ptr(),
                                    vp.scales.data_ptr(), kc.stride(0), kc.stride(1), kc.stride(2),
                                    tbl.data_ptr(), tbl.shape[1], ln.data_ptr(), b, h, hkv, d, bs, float(scale),
                                    int(sliding_window or 0), float(soft_cap or 0.0), out.data_ptr(),
                                    torch.get_num_threads())
    else:
        rc = fn.decode_attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), KV_DTYPES[kc.dtype],
                                 kc.stride(0), kc.stride(1), kc.stride(2),
                                 tbl.data_ptr(), tbl.shape[1], ln.data_ptr(), b, h, hkv, d, bs, float(scale),
                                 int(sliding_window or 0), float(soft_cap or 0.0), out.data_ptr(),
                                 torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU decode attention: scratch allocation failed")
    return out


def decode_fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, key_cache: KVPool | torch.Tensor, value_cache: KVPool | torch.Tensor,
                 slots: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor | None:
    """One decode step's attention for one layer, in one call: rotary_(query, key, cos, sin) in
    place, write_kv(key, value at slots), decode_attention over the pools -> [B, H, D] in the
    activations' dtype (the values of those three calls). query [B, H, D], key/value [B, Hkv, D]
    (each row's heads contiguous: views of one q/k/v product will do), cos/sin [B, D], everything
    fp32 or everything bf16 (the pools too); slots int64 [B], tables int32 [B, W], lens int32 [B].
    None (nothing changed) where the kernel cannot take these tensors."""
    fn = load()
    dt = query.dtype
    kp, vp = as_pool(key_cache), as_pool(value_cache)
    kc, vc = kp.data, vp.data
    if (fn is None or dt not in KV_DTYPES or vc.dtype != kc.dtype or kp.int8 != vp.int8
            or (kc.dtype != dt and not kp.int8)):
        return None
    b, h, d = query.shape
    nb, bs, hkv, _ = kc.shape
    if (not all(_plain(x, dt) for x in (query, key, value, cos, sin)) or kc.stride() != vc.stride()
            or key.shape != (b, hkv, d) or value.shape != key.shape or cos.shape != (b, d) or sin.shape != (b, d)
            or cos.stride() != sin.stride() or cos.stride(1) != 1 or d % 2 or h % hkv
            or any(x.stride()[1:] != (d, 1) for x in (query, key, value))
            or slots.dtype != torch.int64 or slots.shape != (b,) or not slots.is_contiguous()
            or tables.dtype != torch.int32 or tables.dim() != 2 or tables.shape[0] != b or not tables.is_contiguous()
            or lens.dtype != torch.int32 or lens.shape != (b,) or not lens.is_contiguous()):
        return None
    out = torch.empty(b, h, d, dtype=dt)
    if kp.int8:
        rc = fn.decode_fused_i8(query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0), key.stride(0),
                                value.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), KV_DTYPES[dt],
                                kc.data_ptr(), vc.data_ptr(), kp.scales.data_ptr(), vp.scales.data_ptr(),
                                kc.stride(0), kc.stride(1), kc.stride(2), slots.data_ptr(), nb * bs, tables.data_ptr(), tables.shape[1],
                                lens.data_ptr(), b, h, hkv, d, bs, float(scale), int(sliding_window or 0), 0.0,
                                out.data_ptr(), torch.get_num_threads())
    else:
        rc = fn.decode_fused(query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0), key.stride(0),
                             value.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), KV_DTYPES[dt],
                             kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1),
                             kc.stride(2), slots.data_ptr(), nb * bs, tables.data_ptr(), tables.shape[1],
                             lens.data_ptr(), b, h, hkv, d, bs, float(scale), int(sliding_window or 0), 0.0,
                             out.data_ptr(), torch.get_num_threads())
    if rc == -1:
        raise IndexError(f"decode_fused: a slot is past the pool's {nb * bs} slots")
    if rc != 0:
        raise MemoryError("CPU decode attention: scratch allocation failed")
    return out


def prefill_attention_available(dtype: torch.dtype) -> bool:
    """Whether prefill_attention's kernels run here for activations of `dtype` (fp32: the panel GEMM;
    bf16: the vdpbf16ps and widened panels)."""
    fn = load()
    if fn is None or dtype not in KV_DTYPES:
        return False
    return bool(fn.gemm_bf16_available and fn.gemm_bf16w_available if dtype == torch.bfloat16 else fn.gemm_available)


def encoder_attention_available(dtype: torch.dtype) -> bool:
    """Whether encoder_attention runs here for activations of `dtype` (fp32 or bf16, every build: its
    short sequences' products are fp32 FMAs on rows widened in registers; long ones go to the panel
    GEMMs where the build has them, else the same rows)."""
    return load() is not None and dtype in KV_DTYPES


KvCtx = STRUCTS["lmi_kv_ctx"]     # the keys before a prompt chunk's rows, in the pools (kernels/cpu_api.h)


def _kv_ctx(key_cache: KVPool | torch.Tensor, value_cache: KVPool | torch.Tensor, dtype: torch.dtype,
            tables: torch.Tensor, before: torch.Tensor) -> KvCtx | None:
    """The lmi_kv_ctx of prompt chunks (prefill_attention's `ctx`) for activations of `dtype`; None where
    the kernel cannot read the pools (another dtype than the activations', other layouts, not the CPU)."""
    kp, vp = as_pool(key_cache), as_pool(value_cache)
    if (not (supports(kp) and supports(vp)) or kp.int8 != vp.int8 or kp.data.stride() != vp.data.stride()
            or (not kp.int8 and not kp.dtype == vp.dtype == dtype)):
        return None
    kc = kp.data
    return KvCtx(kc=kc.data_ptr(), vc=vp.data.data_ptr(), ksc=kp.scales.data_ptr() if kp.int8 else None,
                 vsc=vp.scales.data_ptr() if kp.int8 else None, kv=ENUM["KV_I8"] if kp.int8 else KV_DTYPES[dtype],
                 s_blk=kc.stride(0), s_tok=kc.stride(1), s_head=kc.stride(2), bs=kc.shape[1], tw=tables.shape[1],
                 tables=tables.data_ptr(), ctx=before.data_ptr())


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: list[int],
                      lens: list[int], scale: float, out: torch.Tensor, ctx: tuple | None = None) -> bool:
    """Causal attention of prompts, all of them in one call by the panel GEMMs (kernels/cpu_decode.c
    lmi_prefill_attention): query / out [T, H, D], key / value [T, Hkv, D] (any token and head strides,
    D contiguous), rows starts[i] .. starts[i] + lens[i] - 1 of prompt i; each prompt's context is its
    own rows, or with `ctx` = (key_cache, value_cache, tables [P, W], before [P]) also the before[i]
    positions ahead of them, read from the pools through prompt i's block table (a chunk after cached
    rows; the step plan's prompt_tables and prompt_ctx, int32 and int64, as they are). out's rows of
    the prompts written in place. fp32 (kernels/cpu_gemm.c) or bf16 (kernels/cpu_gemm_bf16.c: Q K^T by
    vdpbf16ps, P V in fp32 over V widened in registers); False (nothing written) where the kernels
    cannot take them."""
    fn = load()
    pc = before = None
    if ctx is not None:
        key_cache, value_cache, tables, held = ctx
        tables = tables.to(torch.int32).contiguous()       # no copy when the plan's
        held = torch.as_tensor(held, dtype=torch.int64).contiguous()
        pc = _kv_ctx(key_cache, value_cache, query.dtype, tables, held)
        if pc is None:
            return False
        before = held.tolist()
    return _prompts(fn and fn.prefill_attention, prefill_attention_available, query, key, value, starts, lens,
                    scale, out, (None if pc is None else ctypes.addressof(pc),), before)


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: list[int],
                      lens: list[int], scale: float, out: torch.Tensor) -> bool:
    """prefill_attention's contract, bidirectional: an encoder's packed sequences (no padding), each
    row attending to every row of its own sequence and none of another's (lmi_encoder_attention)."""
    fn = load()
    return _prompts(fn and fn.encoder_attention, encoder_attention_available, query, key, value, starts, lens,
                    scale, out)


def _prompts(entry, available, query, key, value, starts, lens, scale, out, extra=(), before=None) -> bool:
    dt = query.dtype
    if entry is None or not lens or not available(dt):
        return False
    t, h, d = query.shape
    if (not all(_plain(x, dt) for x in (query, key, value, out)) or key.dim() != 3 or key.shape != value.shape
            or key.shape[0] != t or key.shape[2] != d or h % key.shape[1] or out.shape != query.shape or d % 2
            or any(x.stride(2) != 1 for x in (query, key, value, out))):
        return False
    se = prompt_table(starts, lens, before)
    rc = entry(query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0), key.stride(0),
               value.stride(0), query.stride(1), key.stride(1), value.stride(1), out.data_ptr(), out.stride(0),
               out.stride(1), KV_DTYPES[dt], se[0].data_ptr(),
               se[1].data_ptr(), se[2].data_ptr(), len(lens), h, key.shape[1], d, float(scale), *extra,
               torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU prompt attention: scratch allocation failed")
    return True


def step_layers(layers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                tables: torch.Tensor, lens: torch.Tensor, prompts: torch.Tensor, *, heads: int, kv_heads: int,
                head_dim: int, intermediate: int, eps: float, lanes: int, pool: KVPool | torch.Tensor,
                scale: float, prompt_ctx: torch.Tensor | None = None,
                prompt_tables: torch.Tensor | None = None) -> None:
    """Every decoder layer of one step, in place on the residual stream h [T, E] (kernels/cpu_layer.c):
    B = tables.shape[0] decoding sequences in rows 0 .. B-1 (one row each) and prompts or prompt chunks
    after them. `layers` a ctypes array of Layer, cos/sin [T, D], slots int64 [T], tables int32 [B, W],
    lens int32 [B] (decode_fused's), prompts int64 [3, P] (first rows, lengths, the order costliest
    first: prefill_attention's), prompt_ctx int64 [P] / prompt_tables int32 [P, W'] (None: every
    prompt whole; else the positions before each one's rows, read from each layer's pools through its
    table), `pool` one of the layers' KV pools (their shared layout), `lanes` rms_norm_f32's summing
    width (fp32). The caller checked every shape and dtype."""
    fn = load()
    pool = as_pool(pool).data
    t, e = h.shape
    nb, bs = pool.shape[:2]
    rc = fn.step_layers(ctypes.addressof(layers), len(layers), h.data_ptr(), t, tables.shape[0], e, heads, kv_heads,
                        head_dim, intermediate, float(eps), lanes, int(h.dtype == torch.bfloat16), cos.data_ptr(),
                        sin.data_ptr(), cos.stride(0), slots.data_ptr(), nb * bs, tables.data_ptr(), tables.shape[1],
                        lens.data_ptr(), prompts.shape[1], prompts[0].data_ptr(), prompts[1].data_ptr(),
                        prompts[2].data_ptr(), None if prompt_ctx is None else prompt_ctx.data_ptr(),
                        None if prompt_tables is None else prompt_tables.data_ptr(),
                        0 if prompt_tables is None else prompt_tables.shape[1], pool.stride(0), pool.stride(1),
                        pool.stride(2), bs, float(scale), torch.get_num_threads())
    if rc == -1:
        raise IndexError(f"step_layers: a slot is past the pool's {nb * bs} slots")
    if rc != 0:
        raise MemoryError("CPU step layers: scratch allocation failed")
