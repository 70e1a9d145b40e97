"""The decode-bound view: time per output token at one client against the memory floor.

    python -m handler bench floor --model-dir DIR [--dtype fp32] [--quantize int8_weight_only]
        [--results OUT/results.json] [--out floor.json]

At one client a decode step multiplies one row by every weight of the model, so it cannot take less
than the time to stream those weights from memory once:

    floor = weight bytes read per step / the host's copy bandwidth

weight bytes read per step  every tensor our server's linear layers multiply by (packed panels,
                            int8 / grouped codes with their scales, biases), the output head whole
                            and the norms, as the server holds them for `--dtype` / `--quantize`;
                            not the input embedding table (one row gathered per token)
copy bandwidth              a memcpy probe: torch's copy_ of a 512 MiB fp32 buffer over all the
                            process's threads, the best of 5, in bytes copied per second (each byte
                            is also written, so a step's read-only stream can run faster)

and beside it the tighter floor a decode step can approach, `floor_read_ms`, the smaller of two reads:
the same bytes at the host's read bandwidth (kernels/cpu_gemm.c's read-stream probe, the best of 5
passes at each of its software look-aheads: none, 1, 4 and 8 KiB), and the time that probe takes to
read the served model's own weight tensors once (the same best: `floor_weights_ms`), where they sit.
Both probes read memory placed as the served weights are: the probe buffers come from the weights'
allocator (kernels/cpu/memory.py, 2 MiB pages where the OS takes the advice), so a probe in 4 KiB
pages cannot put the floor above a step that runs in huge pages.
Where the C kernels do not load there is no read probe: twice the copy rate, as a bound.
`x_floor_read` is TPOT over it.

A mixture of experts (our MoE families, handler/model/moe.py) reads, per sparse layer, only the
top-k experts a token is routed to: `weight_bytes_per_step` counts the router, attention, norms,
dense layers, shared experts and the head whole, and of each sparse layer's experts k of them (the
experts of a layer hold equal bytes; the read probe streams experts 0..k-1 of each layer, where they
lie). `weight_bytes_held` is every byte held, `moe` says how many experts and how many read. This
is the active-bytes floor of one decode token; a step of several rows reads more (the union of
their experts).

`--results` (a `bench compare --clients 1,...` results.json): every server's TPOT p50 at one client
divided by this precision's floor (run once per precision: fp32, bf16, int8, ...; a peer's layout of
the same precision may read somewhat more or fewer bytes, so its ratio is an estimate).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

PROBE_MIB = 512


def _probe_buffer(mib: int):
    """An fp32 buffer of `mib` MiB of ones, in the memory the served weights use (huge-page advised
    where the OS takes it), every page faulted in."""
    import torch
    from kernels.cpu import memory
    t = memory.empty_hugepage(mib * 2 ** 20 // 4, torch.float32)
    return t.fill_(1.0)


def copy_bandwidth(mib: int = PROBE_MIB, reps: int = 5) -> dict:
    """Bytes copied per second by torch's copy_ over the process's threads (best of `reps`)."""
    import torch
    src = _probe_buffer(mib)
    dst = _probe_buffer(mib)
    n = src.numel()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return {"bytes": n * 4, "seconds": best, "copy_gbps": n * 4 / best / 1e9, "threads": torch.get_num_threads()}


# The read probe's software look-aheads, in floats (none, 1, 4 and 8 KiB): the best pass of any is the
# host's read rate (the 1-row GEMMs prefetch 4 KiB ahead; without it a probe read slower than they did).
AHEADS = (0, 256, 1024, 2048)


def _best_pass(words: list, reps: int) -> float:
    """Seconds of the fastest pass of the read probe over `words` (fp32 tensors), of `reps` passes at
    each look-ahead, the look-aheads interleaved."""
    from kernels import cpu as cpu_ext
    best = float("inf")
    for _ in range(reps):
        for ahead in AHEADS:
            t0 = time.perf_counter()
            for w in words:
                cpu_ext.stream_read(w, ahead)
            best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(mib: int = PROBE_MIB, reps: int = 5) -> float | None:
    """Bytes read per second by kernels/cpu_gemm.c's read-stream probe over the process's threads
    (the best pass of `reps` at each look-ahead); None where the C kernels do not load."""
    from kernels import cpu as cpu_ext
    if cpu_ext.load() is None:
        return None
    src = _probe_buffer(mib)
    return src.numel() * 4 / _best_pass([src], reps) / 1e9


def _idle_experts(model) -> tuple[set, dict | None]:
    """ids of the modules of experts a one-row step does not read (each sparse layer's experts past its
    top-k: all hold the same bytes), and the MoE figures (None for a dense model)."""
    from handler.model.moe import SparseMoe
    idle, sparse = set(), [m for m in model.modules() if isinstance(m, SparseMoe)]
    for m in sparse:
        for ex in list(m.experts)[m.spec.top_k:]:
            idle.update(id(x) for x in ex.modules())
    if not sparse:
        return idle, None
    return idle, {"sparse_layers": len(sparse), "experts": sparse[0].spec.experts, "top_k": sparse[0].spec.top_k}


def _tensors_of(m) -> list:
    import torch
    tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
    pack = getattr(m, "pack", None)      # a handler/model/linear.py CpuLinear: what its pack holds
    if pack is not None:
        tensors += [t for t in (*pack.held(), m.bias32) if isinstance(t, torch.Tensor)]
    return [t for t in tensors if t.is_floating_point() or t.dtype in (torch.int8, torch.uint8, torch.int32)]


def held_bytes(model) -> int:
    """Every byte of weights `model` holds (each tensor once), the embedding table included."""
    seen, total = set(), 0
    for m in model.modules():
        for t in _tensors_of(m):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def step_tensors(model) -> tuple[list, int]:
    """The tensors a one-row decode step reads of `model`'s weights, as held (see the module doc: of a
    mixture's experts, the top-k of each sparse layer), and the bytes of the input embedding table
    left out."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_reads_table = (head is not None and emb is not None and getattr(head, "weight", None) is emb.weight
                        and getattr(head, "pack", None) is None)      # a packed head reads its own copy
    idle, _ = _idle_experts(model)
    seen, read, table = set(), [], 0
    for m in model.modules():
        if id(m) in idle:
            continue
        for t in _tensors_of(m):
            if id(t) in seen:
                continue
            seen.add(id(t))
            if m is emb and not head_reads_table:
                table += t.numel() * t.element_size()
                continue
            read.append(t)
    return read, table


def step_bytes(model, held: tuple[list, int] | None = None) -> dict:
    """Bytes a one-row decode step reads of `model`'s weights, as held (see the module doc); `held`:
    step_tensors(model) when the caller has it already."""
    read, table = held if held is not None else step_tensors(model)
    return {"weight_bytes_per_step": sum(t.numel() * t.element_size() for t in read), "embedding_table_bytes": table}


def weights_read(tensors, reps: int = 5) -> dict | None:
    """The read-stream probe over the weight tensors themselves, where they lie: {"bytes" it read (each
    contiguous tensor's bytes as fp32 words; a tail of under 4 bytes or a non-contiguous tensor is
    skipped), "ms": the best pass over all of them (`_best_pass`)}; None without the C kernels."""
    import torch
    from kernels import cpu as cpu_ext
    if cpu_ext.load() is None:
        return None
    words = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() % 4:
            continue
        b = t.detach().reshape(-1).view(torch.uint8)
        n = b.numel() // 4 * 4
        if n:
            words.append(b[:n].view(torch.float32))
    if not words:
        return None
    return {"bytes": sum(w.numel() * 4 for w in words), "ms": _best_pass(words, reps) * 1e3}


def floor_of(model_dir: str, dtype: str, quantize: str | None, extra: dict | None = None) -> dict:
    """Build the server's engine for the precision (handler/tools/quality.py's; `extra` properties, e.g.
    the packed code layout, which changes what a step reads), measure its bytes and the read probe's pass
    over them (`weights_read`)."""
    from handler.tools import quality
    engine = quality.engine_for(model_dir, dtype, quantize, extra=extra)
    try:
        model = engine.runner.model
        held = step_tensors(model)
        out = step_bytes(model, held)
        moe = _idle_experts(model)[1]
        if moe is not None:
            out.update(weight_bytes_held=held_bytes(model), moe=moe)
        w = weights_read(held[0])
        if w is not None:   # scaled to every byte counted (a skipped tail or strided tensor: a few KiB)
            out["floor_weights_ms"] = round(w["ms"] * out["weight_bytes_per_step"] / w["bytes"], 3)
        return out
    finally:
        engine.shutdown()


def tpot_vs_floor(results: dict, floors: dict[str, float]) -> list[dict]:
    """Per server of a load curve: TPOT p50 at one client and its ratio to `floors` (ms, by server
    name; '*' for any other)."""
    out = []
    for name, points in (results.get("curve") or {}).items():
        one = next((p for p in points if p.get("clients") == 1), None)
        if one is None or one.get("tpot_p50") is None:
            continue
        fl = floors.get(name, floors.get("*"))
        tpot_ms = one["tpot_p50"] * 1e3
        out.append({"server": name, "tpot_p50_ms": round(tpot_ms, 2), "floor_ms": round(fl, 2) if fl else None,
                    "x_floor": round(tpot_ms / fl, 2) if fl else None})
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m handler bench floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--quantize", help="the precision served (int8, int8_weight_only, gguf, awq, gptq)")
    p.add_argument("--results", help="a `bench compare --clients 1,...` results.json: TPOT at 1 client vs the floor")
    p.add_argument("--out", help="write the figures to this JSON file")
    p.add_argument("--prop", action="append", default=[], metavar="option.key=value",
                   help="a property of the served file that changes what a step reads "
                        "(option.grouped_code_layout=packed); repeatable")
    a = p.parse_args(argv)
    extra = {}
    for kv in a.prop:
        k, eq, v = kv.partition("=")
        if not eq or not k.startswith("option.") or not v:
            p.error(f"--prop {kv!r}: option.key=value")
        extra[k] = v
    bw = copy_bandwidth()
    read_gbps = read_bandwidth()
    held = floor_of(a.model_dir, a.dtype, a.quantize, extra)
    nbytes = held["weight_bytes_per_step"]
    floor_ms = nbytes / (bw["copy_gbps"] * 1e9) * 1e3
    probe_ms = nbytes / (read_gbps * 1e9) * 1e3 if read_gbps else floor_ms / 2
    read_ms = min(probe_ms, held.get("floor_weights_ms", probe_ms))
    out = {"model_dir": a.model_dir, "dtype": a.dtype, "quantize": a.quantize, "properties": extra, **held, **bw,
           "read_gbps": read_gbps, "floor_ms": round(floor_ms, 3), "floor_read_probe_ms": round(probe_ms, 3),
           "floor_read_ms": round(read_ms, 3)}
    said = f"read bandwidth {read_gbps:.1f} GB/s" if read_gbps else "no read probe (C kernels absent): 2x copy"
    if "floor_weights_ms" in held:
        said += f", the weights themselves read in {held['floor_weights_ms']:.1f} ms"
    if "moe" in held:
        m = held["moe"]
        print(f"mixture of experts: top-{m['top_k']} of {m['experts']} experts in {m['sparse_layers']} sparse layers: "
              f"{nbytes / 2 ** 20:.0f} MiB of the {held['weight_bytes_held'] / 2 ** 20:.0f} MiB held are read per "
              "token (the active bytes)")
    print(f"weights read per step {nbytes / 2 ** 20:.0f} MiB ({a.quantize or a.dtype}); copy bandwidth "
          f"{bw['copy_gbps']:.1f} GB/s over {bw['threads']} threads, {said}; floor {floor_ms:.1f} ms per token "
          f"at the copy rate, {read_ms:.1f} ms at the read rate")
    if a.results:
        with open(a.results) as f:
            res = json.load(f)
        out["servers"] = tpot_vs_floor(res, {"*": floor_ms})
        for r in out["servers"]:
            r["x_floor_read"] = round(r["tpot_p50_ms"] / read_ms, 2)
            print(f"  {r['server']:>16}: TPOT p50 {r['tpot_p50_ms']:.1f} ms = {r['x_floor']:.2f}x the floor, "
                  f"{r['x_floor_read']:.2f}x the read floor")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
