"""A GPU pool's cpu tier pins exactly its budget, not torch's power-of-two rounding of it.

``torch.empty(..., pin_memory=True)`` goes through the caching host allocator, which rounds
an allocation up to the next power of two (a 5-page budget of 3 MiB pages pinned 16 MiB
for 15); the tier registers an anonymous mapping with ``cudaHostRegister`` instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kvconnector.tier.cpu_tier import CpuTier

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"
)
PAGE_BYTES = 3 << 20


def test_a_pinned_cpu_tier_pins_exactly_its_budget_and_copies_to_the_device():
    tier = CpuTier(5 * PAGE_BYTES, PAGE_BYTES, block_size=16, pinned=True)
    assert tier.pinned_bytes == 5 * PAGE_BYTES == tier.snapshot().pinned_bytes
    slab = torch.from_numpy(tier._slab)
    assert slab.is_pinned()
    page = np.arange(PAGE_BYTES, dtype=np.uint64).astype(np.uint8)
    tier.store(b"h" * 16, lambda dst: np.copyto(dst, page))
    on_device = slab[0].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), torch.from_numpy(page))
