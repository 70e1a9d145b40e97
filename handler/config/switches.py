"""The LMI_* environment switches, declared once: name, kind, default, allowed values, one line of
documentation, and who reads it. A/B arms that only benchmarks compare are not switches: a server
never reads them (handler/model/cpu.py `Arms`, a ModelRunner argument). `switch(NAME)` reads one from os.environ at call time (or from
the mapping given), so a test's monkeypatched environment is seen.

Kinds, and what `switch` returns:
  flag     its default (on unless declared off) when unset; False when set to 0 / false / no / off
           (any case, spaces ignored), True when set to anything else
  choice   the value stripped and lower-cased (the default when unset; an empty value stays "");
           the reader decides what an unlisted value does (most warn and keep the default)
  float    the value as a float; the default when unset or not a number
  text     the value as given; the default when unset or empty

docs/PROPERTIES.md's switches table is rendered from here (handler.config.docs). The switches of
kernels/ (which stands alone and reads its own) and of handler/tools are declared here too.
Plain data: no torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str                       # "flag" | "choice" | "float" | "text"
    default: object
    doc: str
    read_by: str
    allowed: tuple[str, ...] = ()   # choice: the values it takes
    values: str = ""                # docs: the values column, where not derived from kind/allowed
    default_doc: str | None = None  # docs: the default, where not `default` itself

    @property
    def default_shown(self) -> str:
        """The docs' default column."""
        if self.default_doc is not None:
            return self.default_doc
        if self.kind == "flag":
            return "`1`" if self.default else "`0`"
        return "" if self.default is None else f"`{self.default:g}`" if isinstance(self.default, float) \
            else f"`{self.default}`"

    @property
    def values_doc(self) -> str:
        if self.values:
            return self.values
        if self.kind == "flag":
            return "`1` (on), `0` / `false` / `no` / `off`"
        return ", ".join(f"`{a}`" for a in self.allowed)


_CPU = "handler/model/cpu.py"
_TP = "handler/model/distributed.py"

SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("LMI_CPU_MALLOC", "choice", "tcmalloc", "CPU: `serve` re-executes itself with tcmalloc preloaded "
           "(where installed); `system` keeps the C library's allocator", _CPU, allowed=("tcmalloc", "system")),
    Switch("LMI_CPU_KERNELS", "choice", "auto", "CPU: the C kernels' instruction set where no `option.cpu_kernels` "
           "is given (kernels used alone: tests, benchmarks); the server maps `option.cpu_kernels` onto it",
           "kernels/cpu/lib.py", allowed=("auto", "avx512", "avx2", "neon", "torch")),
    Switch("LMI_CPU_HUGEPAGES", "choice", "auto", "CPU: the packed weights a decode step streams (fp32/bf16/int8 "
           "panels, W8A16's codes, the output head; not GGUF/AWQ/GPTQ blocks, served slower so) in memory advised MADV_HUGEPAGE before it is written, so "
           "Linux's transparent huge pages (`madvise` or `always`) hold them in 2 MiB pages (fewer TLB misses "
           "per step; values unchanged); `0` leaves them to the allocator's 4 KiB pages; elsewhere, or where "
           "the kernel refuses the advice, it stays off (logged at load)", "kernels/cpu/memory.py",
           allowed=("auto", "0")),
    Switch("LMI_CPU_EXT_CACHE", "text", None, "where the CPU kernels are built and cached", "kernels/cpu/build.py",
           values="directory", default_doc="`~/.cache/lmi-serve/kernels`"),
    Switch("LMI_CGROUP_ROOT", "text", "/sys/fs/cgroup", "CPU: where the container's memory limit is read "
           "(`memory.max` / `memory.current`, or cgroup v1's) to size the default KV pool",
           "handler/config/hardware.py", values="directory"),
    Switch("LMI_MEMINFO", "text", "/proc/meminfo", "CPU: where `MemAvailable` is read (no cgroup limit set)",
           "handler/config/hardware.py", values="file"),
    Switch("LMI_HTTP_WORKER", "choice", "gevent", "gunicorn worker: requests as gevent greenlets, or gthread "
           "threads; another value stops `serve` with one line", "handler/server.py",
           allowed=("gevent", "gthread")),
    Switch("LMI_LOG_LEVEL", "text", "INFO", "log level of the server and of the tensor-parallel ranks",
           "handler/server.py, " + _TP, values="`DEBUG`, `INFO`, `WARNING`, `ERROR`"),
    Switch("LMI_MODEL_CACHE", "text", "/tmp/lmi-serve/models", "root of the cache an `s3://` model is "
           "downloaded to (`<root>/<bucket>/<prefix>`), a hub model id is fetched into (`<root>/hub`, the hub's "
           "cache layout) and a `.gguf` model is dequantized into (`<root>/gguf/<name>-<fingerprint>-<dtype>`)",
           "handler/model/s3.py, handler/model/hf_hub.py, handler/model/gguf.py",
           values="directory"),
    Switch("LMI_TP_MASTER_ADDR", "text", "127.0.0.1", "tensor parallelism: the address rank 0 listens on for "
           "the other ranks", _TP, values="host"),
    Switch("LMI_TP_MASTER_PORT", "text", None, "tensor parallelism: the port rank 0 listens on", _TP,
           values="port", default_doc="a free port"),
    Switch("LMI_TP_TIMEOUT_S", "float", 600.0, "tensor parallelism: a collective (or the start-up) that takes "
           "longer fails the rank group", _TP, values="seconds"),
    Switch("LMI_BENCH_EOS_AFTER", "flag", False, "requests may carry the benchmark knob `parameters.eos_after` "
           "(finish as if EOS came after K tokens); `bench` and `tune` start our servers with it",
           "handler/engine/request.py"),
    Switch("LMI_BENCH_VLLM_DIR", "text", None, "`bench`: the vllm_cpu peer's virtual environment",
           "handler/tools/bench/vllm_cpu.py", values="directory", default_doc="`<repo>/.cache/peers/vllm`"),
    Switch("LMI_BENCH_OPENVINO_DIR", "text", None, "`bench`: the openvino peer's virtual environment",
           "handler/tools/bench/openvino_peer.py", values="directory", default_doc="`<repo>/.cache/peers/openvino`"),
    Switch("LMI_BENCH_ONNX_DIR", "text", None, "`bench embed`: the onnx peer's virtual environment (ONNX Runtime, "
           "optimum-onnx)", "handler/tools/bench/embed.py", values="directory", default_doc="`<repo>/.cache/peers/onnx`"),
    Switch("LMI_BENCH_LLAMACPP_DIR", "text", None, "`bench`: the llamacpp peer's build directory",
           "handler/tools/bench/llamacpp_peer.py", values="directory", default_doc="`<repo>/.cache/peers/llamacpp`"),
)}


def switch(name: str, env: Mapping[str, str] | None = None):
    """The switch's value in `env` (default: os.environ, read now), as its kind says (module doc).
    An undeclared name is a KeyError: declare it in SWITCHES first."""
    s = SWITCHES[name]
    raw = (os.environ if env is None else env).get(name)
    if s.kind == "flag":
        return bool(s.default) if raw is None else raw.strip().lower() not in OFF
    if s.kind == "choice":
        return (s.default if raw is None else raw).strip().lower()
    if s.kind == "float":
        try:
            return float(raw) if raw is not None else s.default
        except ValueError:
            return s.default
    return raw if raw else s.default
