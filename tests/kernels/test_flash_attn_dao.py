"""The interface tests' numeric cases against Dao-AILab's flash_attn: FA4 (`flash_attn.cute`,
through the flash_attn backend's adapter, `flash_attn_providers.FA4Api`) and FA2
(`flash_attn.flash_attn_interface`), each where it imports; skipped with the reason otherwise.

Runs only with `--device cuda`. FA2's paged path needs a block size that is a multiple of 256;
FA4 takes any. Both take 16-bit dtypes only, so the cases use bfloat16; FA4 has no ALiBi, so
its "alibi" variant is skipped. Everything else (heads, soft caps, windows, lengths, a shuffled
pool) is the interface tests' grid. FA4 compiles each new variant on its first call (seconds).
"""

import importlib

import pytest
import torch

from pagedattn.backends import flash_attn_providers as providers
from test_flash_attn_interface import (HEADS, SOFT_CAPS, VARIANTS,
                                       check_kvcache_paged, check_varlen_contiguous,
                                       check_varlen_paged)

BLOCK_SIZES = {"fa4": [16, 256], "fa2": [256]}


def _dao(name):
    """The FlashAttention-2-style API of Dao-AILab's build `name`, or a skip saying why not."""
    if not providers.installed(name):
        pytest.skip(f"Dao-AILab's {providers.MODULES[name]} is not installed here")
    try:
        module = importlib.import_module(providers.MODULES[name])
    except Exception as e:  # noqa: BLE001 - a wheel for another torch can fail in many ways
        pytest.skip(f"{providers.MODULES[name]} does not import: {type(e).__name__}: {e}")
    return providers.FA4Api(module.flash_attn_varlen_func) if name == "fa4" else module


@pytest.fixture(params=["fa4", "fa2"])
def dao(request, device):
    if device.type != "cuda":
        pytest.skip("Dao-AILab's flash_attn runs on CUDA only; pass --device cuda")
    return request.param, _dao(request.param)


def _skip_unsupported(name, variant):
    if name == "fa4" and VARIANTS[variant][1]:
        pytest.skip("FA4 takes no ALiBi slopes")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_dao_varlen_paged(dao, device, heads, soft_cap, variant):
    name, fa = dao
    _skip_unsupported(name, variant)
    for block_size in BLOCK_SIZES[name]:
        check_varlen_paged(fa, device, heads=heads, soft_cap=soft_cap, variant=variant,
                           lens=[(1, 1328), (5, 18), (129, 463)], head_size=128, block_size=block_size,
                           dtype=torch.bfloat16, num_blocks=4096 // block_size * 4)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_dao_kvcache_paged(dao, device, heads, soft_cap, variant):
    name, fa = dao
    _skip_unsupported(name, variant)
    for block_size in BLOCK_SIZES[name]:
        for kv_lens in ([1328, 18, 463], [1, 54, 293, 70]):
            check_kvcache_paged(fa, device, heads=heads, soft_cap=soft_cap, variant=variant, kv_lens=kv_lens,
                                head_size=128, block_size=block_size, dtype=torch.bfloat16,
                                num_blocks=4096 // block_size * 4)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_dao_varlen_contiguous(dao, device, heads, causal):
    check_varlen_contiguous(dao[1], device, heads=heads, head_size=128, soft_cap=10.0,
                            causal=causal, lens=[(1, 1328), (5, 18), (129, 463)],
                            dtype=torch.bfloat16)


def test_the_backend_chooses_fa4_where_it_runs(device):
    """On CUDA with FA4 importable, the flash_attn backend's provider is FA4 (unless pinned)."""
    if device.type != "cuda" or not providers.installed("fa4"):
        pytest.skip("needs --device cuda and flash_attn.cute")
    choice = providers.choose("cuda")
    if choice.pinned:
        pytest.skip(f"{providers.ENV_VAR}={choice.pinned} pins the provider")
    assert choice.provider is not None and choice.provider.name in ("fa3", "fa4"), choice.describe()
