"""The compute dtype by machine: bf16 only on a CPU with native bf16 matmul, else float32."""
import platform

import pytest
import torch

from kvtier import hardware


def test_native_bf16_is_read_from_the_cpus_flags(monkeypatch):
    assert hardware.cpu_has_native_bf16(frozenset({"avx2", "avx512f", "amx_bf16"}))
    assert hardware.cpu_has_native_bf16(frozenset({"avx512f", "avx512_bf16"}))
    # AVX-512 without bf16 instructions (Skylake) and AVX2 (the EPYC): emulated
    assert not hardware.cpu_has_native_bf16(frozenset({"avx2", "avx512f", "avx512bw"}))
    assert not hardware.cpu_has_native_bf16(frozenset({"avx2", "fma"}))
    assert not hardware.cpu_has_native_bf16(frozenset())  # flags unreadable: the safe side
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert hardware.cpu_has_native_bf16(frozenset({"fp", "asimd", "bf16"}))


@pytest.mark.parametrize("native, want", [(True, torch.bfloat16), (False, torch.float32)])
def test_cpu_rule(monkeypatch, native, want):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda flags=None: native)
    assert hardware.compute_dtype("cpu") == want
    assert hardware.compute_dtype("cpu", preferred=torch.bfloat16) == want
    assert hardware.compute_dtype("cpu", preferred=torch.float32) == torch.float32
    assert hardware.parse_dtype("auto") == want
    assert hardware.parse_dtype("bf16") == hardware.parse_dtype("bfloat16") == torch.bfloat16


def test_cuda_keeps_the_models_dtype():
    assert hardware.compute_dtype("cuda", preferred=torch.float16) == torch.float16


def test_this_machine_is_described():
    assert hardware.cpu_name()
    assert hardware.compute_dtype("cpu") in (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="--dtype must be one of auto, bfloat16"):
        hardware.parse_dtype("half")
