"""The interface tests' numeric cases against Dao-AILab's flash_attn (FlashAttention 2).

Runs only where `flash_attn` imports and `--device cuda` is given; otherwise every test is
skipped with the reason. FlashAttention 2's paged path needs a block size that is a multiple
of 256 and 16-bit dtypes, so the cases use block size 256 and bfloat16; everything else (heads,
soft caps, windows, ALiBi, lengths, a shuffled pool) is the interface tests' grid.
"""

import pytest
import torch

flash_attn_dao = pytest.importorskip(
    "flash_attn", reason="Dao-AILab's flash_attn does not import here (pip install flash-attn)")

from test_flash_attn_interface import (HEADS, SOFT_CAPS, VARIANTS,  # noqa: E402
                                       check_kvcache_paged, check_varlen_contiguous,
                                       check_varlen_paged)


@pytest.fixture
def dao(device):
    if device.type != "cuda":
        pytest.skip("Dao-AILab's flash_attn runs on CUDA only; pass --device cuda")
    return flash_attn_dao


COMMON = dict(head_size=128, block_size=256, dtype=torch.bfloat16, num_blocks=64)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_dao_varlen_paged(dao, device, heads, soft_cap, variant):
    check_varlen_paged(dao, device, heads=heads, soft_cap=soft_cap, variant=variant,
                       lens=[(1, 1328), (5, 18), (129, 463)], **COMMON)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_dao_kvcache_paged(dao, device, heads, soft_cap, variant):
    for kv_lens in ([1328, 18, 463], [1, 54, 293, 70]):
        check_kvcache_paged(dao, device, heads=heads, soft_cap=soft_cap, variant=variant,
                            kv_lens=kv_lens, **COMMON)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_dao_varlen_contiguous(dao, device, heads, causal):
    check_varlen_contiguous(dao, device, heads=heads, head_size=128, soft_cap=10.0,
                            causal=causal, lens=[(1, 1328), (5, 18), (129, 463)],
                            dtype=torch.bfloat16)
