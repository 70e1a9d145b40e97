"""The serving.properties keys that change the numbers a CPU endpoint returns, beside option.quantize
and option.dtype: one record (`Numerics`) the runner takes at load and puts into each packed layer,
so two replicas started with the same file answer alike whatever their environments.

  option.cpu_grouped_activations  exact | int8   grouped weights (GGUF blocks, AWQ/GPTQ, W8A16) times
                                                  fp32 activations, or int8 ones quantized per group
                                                  as llama.cpp's Q8 blocks (kernels/cpu_gemm_q4.c)
  option.quantize_head            auto | true | false   option.quantize=int8 / int8_weight_only: the
                                                  output head quantized too, or kept in option.dtype
  option.grouped_code_layout      bytes | packed  5/6-bit grouped codes streamed one a byte or packed

Named to read beside option.quantize: the head is a part of what is quantized (quantize_head), the
layout a property of the grouped weights (grouped_code_layout); the activations' format is a CPU
kernel's choice (cpu_grouped_activations, as option.cpu_kernels), ignored on a GPU. The environment
variables that used to set them (LEGACY_ENV) are only warned about. Plain data: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

GROUPED_ACTIVATIONS = ("exact", "int8")
QUANTIZE_HEAD = ("auto", "true", "false")
CODE_LAYOUTS = ("bytes", "packed")

# The environment variables that chose these before they were properties: read once, to warn.
LEGACY_ENV = {"LMI_CPU_Q_ACT8": "option.cpu_grouped_activations=int8|exact",
              "LMI_QUANT_HEAD": "option.quantize_head=auto|true|false",
              "LMI_QUANT_PACKED_CODES": "option.grouped_code_layout=packed|bytes"}


@dataclass(frozen=True)
class Numerics:
    """The numerics keys' values (module doc), as the runner and the packers read them."""
    grouped_activations: str = "exact"
    quantize_head: str = "auto"
    grouped_code_layout: str = "bytes"

    def __post_init__(self):
        for field, allowed, key in (("grouped_activations", GROUPED_ACTIVATIONS, "option.cpu_grouped_activations"),
                                    ("quantize_head", QUANTIZE_HEAD, "option.quantize_head"),
                                    ("grouped_code_layout", CODE_LAYOUTS, "option.grouped_code_layout")):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{key}={getattr(self, field)!r}: allowed {', '.join(allowed)}")

    @classmethod
    def of(cls, cfg) -> "Numerics":
        """From a ServingConfig (a field it lacks: the default)."""
        d = cls()
        return cls(getattr(cfg, "cpu_grouped_activations", d.grouped_activations),
                   getattr(cfg, "quantize_head", d.quantize_head),
                   getattr(cfg, "grouped_code_layout", d.grouped_code_layout))

    @property
    def act8(self) -> bool:
        return self.grouped_activations == "int8"

    @property
    def packed_codes(self) -> bool:
        return self.grouped_code_layout == "packed"

    def describe(self) -> str:
        return (f"option.cpu_grouped_activations={self.grouped_activations}, option.quantize_head="
                f"{self.quantize_head}, option.grouped_code_layout={self.grouped_code_layout}")


def legacy_env_warnings(env: Mapping[str, str]) -> list[str]:
    """One warning per old variable set in `env`: it no longer changes anything."""
    return [f"{name}={env[name]!r} is no longer read (an endpoint's numbers follow serving.properties); "
            f"use {key}" for name, key in LEGACY_ENV.items() if name in env]
