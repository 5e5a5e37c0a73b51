"""Capabilities and tiles per device (`DeviceProfile`): what a GPU cannot run is refused at
construction with the reason; the tiles planned for a GPU fit its shared memory. Devices other
than this machine's are faked with `PRESETS` (datasheet facts)."""

import pytest
import torch

from pagedattn.device_profile import CPU, PRESETS, DeviceProfile


@pytest.fixture
def on(monkeypatch):
    """Make `DeviceProfile.of` answer with a preset (this process's device, as the impl sees it)."""
    def use(name: str) -> None:
        monkeypatch.setattr(DeviceProfile, "of", staticmethod(lambda device=None: PRESETS[name]))
    return use


def _triton_impl(**options):
    from pagedattn.backends.triton_backend import TritonBackend

    return TritonBackend.get_impl_cls()(8, 128, 128 ** -0.5, 2, **options)


@pytest.mark.parametrize("name", ["a100", "a10", "rtx3090"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_triton_refuses_fp8_e4m3_before_sm89(on, name, kv_cache_dtype):
    on(name)
    with pytest.raises(NotImplementedError, match=r"kv_cache_dtype=.*FP8 e4m3 needs sm_89 or later.*sm_8[06]"):
        _triton_impl(kv_cache_dtype=kv_cache_dtype)
    _triton_impl(kv_cache_dtype="fp8_e5m2")  # e5m2 converts through fp16 anywhere


@pytest.mark.parametrize("name", ["l4", "l40s", "rtx4090", "h100", "h200"])
def test_triton_takes_fp8_e4m3_from_sm89(on, name):
    on(name)
    _triton_impl(kv_cache_dtype="fp8")


def test_this_machine_profile():
    profile = DeviceProfile.of()
    if not torch.cuda.is_available():
        assert profile is CPU and profile.fp8_e4m3 and not profile.wgmma
    else:
        assert profile.num_sms >= 1 and profile.smem_per_block >= 48 * 1024
    assert PRESETS["h100"].bandwidth_per_sm_gbs == pytest.approx(3352.0 / 132)
    assert PRESETS["h200"].wgmma and PRESETS["h200"].tma and not PRESETS["l40s"].wgmma


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("shape", ["decode", "long_decode", "prefill", "long_prefill", "mixed"])
def test_planned_tiles_fit_the_device(name, head_size, shape):
    """Every launch the policy plans for a GPU (16-bit queries, 16-bit and FP8 caches) stays
    within the shared memory a program may hold there, by the bound `smem_bytes`; the compiled
    kernels' real use is checked against the same limits in tests/kernels/test_compile_targets.py."""
    pytest.importorskip("triton")
    from pagedattn.kernels.attention_plan import LaunchFacts, plan_attention
    from pagedattn.kernels.paged_attention_config import smem_bytes

    profile = PRESETS[name]
    lens = {"decode": (64, 1, 1024, 0), "long_decode": (1, 1, 16384, 0), "prefill": (4, 512, 1536, 0),
            "long_prefill": (1, 2048, 8192, 0), "mixed": (33, 512, 2048, 32)}[shape]
    num_seqs, max_query_len, max_seq_len, num_decodes = lens
    for kv_dtype in (torch.bfloat16, torch.float8_e5m2):
        f = LaunchFacts(profile, max_query_len * (num_seqs - num_decodes) + num_decodes, num_seqs, max_query_len,
                        max_seq_len, num_decodes, 1, 32, 8, head_size, torch.bfloat16, kv_dtype, 16, True, True,
                        False, False, False, False, 64, 0, True, False, False, (1, 1, 1, 1, 1, 1, 1, 1))
        plan = plan_attention(f)
        for tile in (plan.tile, plan.decode_tile):
            if tile is not None:
                need = smem_bytes(tile, head_size=head_size, q_bytes=2, kv_bytes=kv_dtype.itemsize)
                assert need <= profile.smem_per_block, (tile, need)
