"""The CPU's LoRA kernel (``model/lora/lora_kernel.py``) adds what the batched matmuls add
(``lora_step.py``'s torch path) within float32 rounding: adapters of unequal rows (padding
skipped), more rows than a register block, ranks and column counts that are not multiples of
16, parts an adapter lacks, and rows of the base model left as they were."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.lora import lora_kernel
from pdserve.model.lora.lora_step import LoRAStacks, LoRAStep, active, add_lora
from pdserve.model.lora.peft_adapter import LoRAAdapter, LoRAPart

IN = 40
PARTS = {"q_proj": (0, 24), "k_proj": (24, 40), "v_proj": (40, 56)}  # 24 and 16 columns


def adapter(seed: int, ranks: dict[str, int]) -> LoRAAdapter:
    generator = torch.Generator().manual_seed(seed)
    parts = tuple(
        LoRAPart(
            target,
            columns,
            torch.randn(rank, IN, generator=generator),
            torch.randn(columns[1] - columns[0], rank, generator=generator),
        )
        for target, columns in PARTS.items()
        if (rank := ranks.get(target))
    )
    return LoRAAdapter(f"a{seed}", f"digest-{seed}", {(0, "qkv"): parts})


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if lora_kernel.build() is None:
        pytest.skip("the LoRA kernel cannot be built here (no C++ compiler)")


@pytest.mark.parametrize(
    "rows_of",
    [[[0, 3], [1]], [list(range(11)), [11, 12]], [[5], [2, 4, 6]]],
    ids=["unequal", "past a register block", "base rows between"],
)
def test_the_kernel_adds_what_the_batched_matmuls_add(rows_of, monkeypatch) -> None:
    adapters = [
        adapter(1, {"q_proj": 3, "k_proj": 20, "v_proj": 5}),
        adapter(2, {"q_proj": 7, "v_proj": 2}),  # no k_proj
    ]
    num_rows = 14
    x = torch.randn(num_rows, IN)
    base = torch.randn(num_rows, 56)
    groups = list(zip(adapters, rows_of))
    step = LoRAStep(groups, num_rows, LoRAStacks(), torch.device("cpu"))
    assert lora_kernel.serves(x, base, step.shape[1])
    with active(step):
        by_kernel = add_lora(base.clone(), x, 0, "qkv")
        monkeypatch.setattr(lora_kernel, "serves", lambda *args: False)
        by_matmuls = add_lora(base.clone(), x, 0, "qkv")
    torch.testing.assert_close(by_kernel, by_matmuls, rtol=1e-5, atol=1e-5)
    untouched = sorted(set(range(num_rows)) - {row for rows in rows_of for row in rows})
    assert torch.equal(by_kernel[untouched], base[untouched])
    assert not torch.equal(by_kernel, base)


def test_it_leaves_other_dtypes_and_a_prompts_rows_to_the_matmuls() -> None:
    rows = torch.randn(4, IN)
    out = torch.randn(4, 56)
    assert not lora_kernel.serves(rows.bfloat16(), out, 4)
    assert not lora_kernel.serves(rows, out, lora_kernel.MAX_ROWS_PER_ADAPTER + 1)
