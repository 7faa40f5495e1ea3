"""Factories for the tier conformance suite: every tier, small enough to fill in a test."""
from __future__ import annotations

import pytest
import torch

from kvtier.tiers import DeviceTier, DiskTier, HostTier


class Spec:
    """How to build one tier for the shared suite and what it can hold."""

    def __init__(self, name, make, max_value, fill_value):
        self.name, self.make, self.max_value, self.fill_value = name, make, max_value, fill_value


def _device(tmp_path):
    return DeviceTier((128,), num_slots=16, dtype=torch.uint8)


def _host(tmp_path):
    return HostTier(16 << 10, spill=None)


def _disk(tmp_path):
    return DiskTier(tmp_path / "l3", capacity_bytes=32 << 10, segment_bytes=8 << 10, durability="close")


SPECS = {
    # max_value: largest value the suite puts; fill_value: size used to fill the tier up
    "device": Spec("device", _device, 128, 100),
    "host": Spec("host", _host, 1024, 900),
    "disk": Spec("disk", _disk, 1024, 900),
}


@pytest.fixture(params=sorted(SPECS))
def spec(request):
    return SPECS[request.param]


@pytest.fixture
def tier(spec, tmp_path):
    t = spec.make(tmp_path)
    yield t
    t.close()
