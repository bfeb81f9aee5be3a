"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from radixgen.kernels import CpuKernels, cpu_kernels


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    """The native CPU ops (the test is skipped where they do not build)."""
    ops = cpu_kernels()
    if ops is None:
        pytest.skip("the CPU kernels do not build here")
    return ops
