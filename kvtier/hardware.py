"""Which dtype a model computes in, by machine.

The rule (stated in docs/transformers.md, "Compute dtype by machine"):

- CUDA: the model's own dtype (``preferred``), else bfloat16 where the GPU supports it, else float16.
- CPU with native bf16 matrix instructions (x86 ``avx512_bf16`` or ``amx_bf16``; Arm ``bf16``):
  bfloat16, which halves the bytes of weights and KV and runs at least as fast as float32.
- Any other CPU: float32. Without those instructions a bf16 matmul is emulated (converted to
  float32 and back around each kernel), several times slower than float32 itself; half the KV
  bytes are not worth that on the machine that computes them.

``torch.backends.cpu.get_cpu_capability()`` names only the vector ISA level torch dispatches to
("AVX2", "AVX512"), not whether bf16 is native: an AVX-512 Skylake has no bf16 instructions while
a Sapphire Rapids has AVX512_BF16 and AMX, both "AVX512". So the CPU's own flags decide, read from
``/proc/cpuinfo`` (Linux); where they cannot be read the rule takes float32, the safe side.
"""
from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

__all__ = ["DTYPE_CHOICES", "compute_dtype", "cpu_flags", "cpu_has_native_bf16", "cpu_name", "parse_dtype"]

# Spellings every command accepts for --dtype ("auto": compute_dtype's rule).
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32")
_BY_NAME = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
            "float32": torch.float32, "fp32": torch.float32}
_X86_BF16 = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty where they cannot be read."""
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_name() -> str:
    """The CPU's model name as the OS reports it (for reports), else the platform's processor string."""
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model name", "Hardware"):
            return value.strip()
    return platform.processor() or platform.machine()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU multiplies bf16 matrices natively (x86 AVX512_BF16 or AMX-BF16, Arm BF16)."""
    flags = cpu_flags() if flags is None else flags
    if any(f in flags for f in _X86_BF16):
        return True
    return platform.machine().lower() in ("aarch64", "arm64") and "bf16" in flags


def compute_dtype(device: str | torch.device = "cpu", preferred: torch.dtype | None = None) -> torch.dtype:
    """The dtype to run a model in on ``device`` (the module docstring's rule).

    Args:
        device: where the model runs.
        preferred: the model's own dtype (its checkpoint's), used on CUDA; on CPU it is taken
            when it is float32, or bfloat16 on a CPU with native bf16.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if preferred is not None:
            return preferred
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if preferred == torch.float32:
        return torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def parse_dtype(name: str, device: str | torch.device = "cpu", option: str = "--dtype") -> torch.dtype:
    """A ``--dtype`` value (one of :data:`DTYPE_CHOICES`) as a torch dtype; ``auto`` applies the rule."""
    if name == "auto":
        return compute_dtype(device)
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"{option} must be one of {', '.join(DTYPE_CHOICES)}; got {name!r}") from None
