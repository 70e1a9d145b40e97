"""The KV pool: one record per layer's keys or values, made once by the runner and passed to every
reader (the attention backends, the C kernels, the block copies), and the one definition of the int8
pool format (the C side's is kernels/cpu_kv.h, whose bytes `quantize_rows` gives).

Layout (docs/ARCHITECTURE.md, "KV pool and kernels"):
  data    [num_blocks, block_size, Hkv, D]; slot = block_table[pos // bs] * bs + pos % bs.
          On CPU a view of a head-major [NB, Hkv, bs, D] allocation (`head_major`), so that a gather
          of a batch's blocks is one copy into the [B, Hkv, L, D] attention multiplies.
  scales  int8 pools only (option.kv_cache_dtype=int8): fp32 [NB, bs, Hkv], laid out as `data` with
          D collapsed (its strides data's / D): row = int8 row * scale, one symmetric scale per
          (token, head) row.

A float pool may be given as a bare tensor wherever a pool is taken (`as_pool`); an int8 one cannot:
its scales are part of it.
"""
from __future__ import annotations

import dataclasses
import math
import mmap

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class KVPool:
    """One layer's keys or values (see the module's docstring for the layout)."""
    data: torch.Tensor
    scales: torch.Tensor | None = None

    def __post_init__(self):
        if self.data.dim() != 4:
            raise ValueError(f"a KV pool is [num_blocks, block_size, kv_heads, head_dim], not {tuple(self.data.shape)}")
        if (self.data.dtype == torch.int8) != (self.scales is not None):
            raise ValueError("an int8 KV pool carries its row scales, and only an int8 pool does")
        if self.scales is not None and (self.scales.dtype != torch.float32 or self.scales.shape != self.data.shape[:3]
                                        or any(a * self.data.shape[3] != b for a, b in
                                               zip(self.scales.stride(), self.data.stride()[:3]))):
            raise ValueError("an int8 pool's scales are fp32 [NB, bs, Hkv] laid out as the pool (strides / D)")

    @property
    def int8(self) -> bool:
        return self.scales is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    def head_major(self) -> bool:
        """True for a [NB, bs, Hkv, D] view of a [NB, Hkv, bs, D] allocation (the CPU pool)."""
        return self.data.transpose(1, 2).is_contiguous()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the pool holds (its bytes: data, then the scales of an int8 pool)."""
        return (self.data,) if self.scales is None else (self.data, self.scales)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Blocks src[i] copied onto dst[i] (copy-on-write of shared prompt blocks), scales with them."""
        for t in self.tensors():
            t[dst] = t[src]

    def clone(self) -> KVPool:
        return KVPool(self.data.clone(), None if self.scales is None else self.scales.clone())

    def equal(self, other: KVPool) -> bool:
        """The same bytes (rows and, for int8, scales)."""
        return len(self.tensors()) == len(other.tensors()) and all(
            torch.equal(a, b) for a, b in zip(self.tensors(), other.tensors()))


def as_pool(cache: KVPool | torch.Tensor) -> KVPool:
    """A pool record for `cache` (a record, or a float pool tensor)."""
    if isinstance(cache, KVPool):
        return cache
    if cache.dtype == torch.int8:
        raise ValueError("an int8 KV pool needs its row scales: pass a kernels.pool.KVPool (kernels.pool.allocate)")
    return KVPool(cache)


def _zero_pages(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros backed by an anonymous mapping (pages committed on first write)."""
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, n * dtype.itemsize)
    return torch.frombuffer(buf, dtype=dtype, count=n).view(shape)   # the tensor keeps `buf` alive


def allocate(shape: tuple[int, int, int, int], dtype: torch.dtype, *, head_major: bool = False,
             device=None, lazy: bool = False) -> KVPool:
    """A zeroed pool [NB, bs, Hkv, D] of `dtype` (torch.int8: with zeroed scales, laid out alike), a view
    of [NB, Hkv, bs, D] when head_major. `lazy` (CPU): anonymous zero pages, committed as blocks are
    first written, so that a pool sized from the memory available costs only what is used."""
    nb, bs, hkv, d = shape
    device = torch.device(device or "cpu")

    def zeros(dims, dt):
        if lazy and device.type == "cpu":
            return _zero_pages(dims, dt)
        return torch.zeros(dims, dtype=dt, device=device)

    def laid_out(dims_tok, dt):
        if head_major:
            return zeros((dims_tok[0], dims_tok[2], dims_tok[1], *dims_tok[3:]), dt).transpose(1, 2)
        return zeros(dims_tok, dt)

    data = laid_out((nb, bs, hkv, d), dtype)
    return KVPool(data, laid_out((nb, bs, hkv), torch.float32) if dtype == torch.int8 else None)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (int8 [..., D], fp32 scales [...]): symmetric per row,
    scale = max|x| / 127, q = round_half_even(x * (127 / max|x|)), zeros for a zero row; in fp32,
    the bytes kernels/cpu_kv.c's lmi_write_kv_i8 stores."""
    xf = x.float()
    m = xf.abs().amax(-1)
    inv = torch.where(m > 0, torch.full_like(m, 127.0) / m, torch.zeros_like(m))
    q = (xf * inv[..., None]).round().clamp_(-127, 127).to(torch.int8)
    return q, m / 127.0


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D] and their scales [...] -> fp32 [..., D]."""
    return q.float() * scale[..., None]


def as_stored(pool: KVPool, rows: torch.Tensor) -> torch.Tensor:
    """rows [T, Hkv, D] as `pool` gives them back: themselves, or for an int8 pool each row quantized
    and dequantized (in rows' dtype), so that a prompt's own attention reads the values its later
    steps (and a prefix-cache hit, or a recompute after preemption) read."""
    if not pool.int8:
        return rows
    return dequantize_rows(*quantize_rows(rows)).to(rows.dtype)


def from_rows(rows: torch.Tensor, head_major: bool = True) -> KVPool:
    """An int8 pool holding float rows [NB, bs, Hkv, D] as the pool stores them (tests and tools)."""
    pool = allocate(tuple(rows.shape), torch.int8, head_major=head_major, device=rows.device)
    q, sc = quantize_rows(rows)
    pool.data.copy_(q)
    pool.scales.copy_(sc)
    return pool
