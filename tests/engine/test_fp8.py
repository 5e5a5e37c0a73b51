"""FP8 KV caches in the engine: scales calibrated on the first prefill, or read from the checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.layer import KV_SCALE_HEADROOM, Attention, kv_scale_calibration_paused

from .conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _load(folder, device, backend_name, kv_cache_dtype="fp8"):
    from pagedattn.models.loader import load_model

    return load_model(folder, dtype=torch.float32, device=device, attention_backend=backend_name,
                      kv_cache_dtype=kv_cache_dtype)


def _layers(loaded) -> list[Attention]:
    return [m for m in loaded.model.modules() if isinstance(m, Attention)]


def _scales(loaded) -> list[tuple[float, float]]:
    return [(float(a.k_scale), float(a.v_scale)) for a in _layers(loaded)]


def test_first_prefill_calibrates_the_scales_then_they_stay(tiny, device, backend_name, make_engine):
    loaded = _load(tiny.folder, device, backend_name)
    assert _scales(loaded) == [(1.0, 1.0)] * 2 and all(a.calibrating == {"k": True, "v": True} for a in _layers(loaded))
    # Capture the K/V of each layer's calibrating call (the first after start-up after which it
    # stopped calibrating) to recompute the scales here.
    first_kv = {}

    def hook(layer, args, output):
        if id(layer) not in first_kv and not layer.calibrating["k"]:
            first_kv[id(layer)] = (args[1].detach().clone(), args[2].detach().clone())

    engine = make_engine(loaded, kv_cache_dtype="fp8")
    # start-up (profiling, warm-up steps on CUDA, graph capture) calibrates nothing
    assert _scales(loaded) == [(1.0, 1.0)] * 2 and all(a.calibrating == {"k": True, "v": True} for a in _layers(loaded))
    handles = [a.register_forward_hook(hook) for a in _layers(loaded)]
    engine.generate(random_prompts((12, 30), seed=20), [GREEDY] * 2)
    for h in handles:
        h.remove()
    scales = _scales(loaded)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for layer, (k_scale, v_scale) in zip(_layers(loaded), scales):
        assert layer.calibrating == {"k": False, "v": False}
        k, v = first_kv[id(layer)]
        assert k_scale != 1.0 and v_scale != 1.0 and k_scale != v_scale
        assert k_scale == pytest.approx(float(k.abs().max()) * KV_SCALE_HEADROOM / fp8_max, rel=1e-6)
        assert v_scale == pytest.approx(float(v.abs().max()) * KV_SCALE_HEADROOM / fp8_max, rel=1e-6)
    # Frozen: later prefills (other prompts, larger values or not) leave them as they are.
    engine.generate(random_prompts((40,), seed=21), [GREEDY])
    assert _scales(loaded) == scales


def _logits(loaded, backend, device, cache_dtype, tokens: list[int], prefill: int) -> torch.Tensor:
    """Logits float32 [1 + decodes, V]: the last row of a prefill of `tokens[:prefill]`, then
    one decode step per remaining token, over a paged cache of `cache_dtype`."""
    import pagedattn

    spec, bs = loaded.spec, 4
    builder = backend.get_builder_cls()(bs, device)
    shape = backend.get_kv_cache_shape(24, bs, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(spec.num_layers)]
    table = list(range(23, 23 - (len(tokens) + bs - 1) // bs, -1))  # blocks in reverse order
    rows = []
    steps = [(0, prefill)] + [(p, 1) for p in range(prefill, len(tokens))]
    for context_len, query_len in steps:
        seq_len = context_len + query_len
        md = builder.build([pagedattn.ScheduledSeq(seq_len, query_len, table)])
        ids = torch.tensor(tokens[context_len:seq_len], device=device)
        pos = torch.arange(context_len, seq_len, device=device)
        with torch.inference_mode(), pagedattn.forward_context(md, caches):
            rows.append(loaded.model.compute_logits(loaded.model(ids, pos))[-1])
    return torch.stack(rows)


def test_fp8_logits_stay_close_to_full_precision(tiny, device, backend, backend_name, loaded):
    """FP8 e4m3 keeps 3 mantissa bits (relative rounding <= 1/16 per K/V element); through two
    layers of this deliberately peaked model the logits move by 8-18% (relative L2), whatever
    the scale in the unsaturated range: bound it at 30%. Scales that saturate the cache break it."""
    tokens = random_prompts((40,), seed=22)[0]
    full = _logits(loaded, backend, device, torch.float32, tokens, 33)

    def fp8_error(scale=None) -> torch.Tensor:
        fp8_loaded = _load(tiny.folder, device, backend_name)
        for layer in _layers(fp8_loaded):
            layer.set_kv_scales(scale, scale)
        fp8 = _logits(fp8_loaded, backend, device, torch.float8_e4m3fn, tokens, 33)
        if scale is None:
            assert all(s != 1.0 for pair in _scales(fp8_loaded) for s in pair)  # calibrated by the prefill
        return (fp8 - full).norm(dim=-1) / full.norm(dim=-1)  # [steps]

    error = fp8_error()
    # Step 0 is the prompt's prefill: a backend may attend a fresh prompt over the step's own
    # K/V (as the seeds' FlashAttention prefill does), exactly as in full precision. Every
    # decode step reads the FP8 cache, so it must move.
    assert 0 < float(error[1:].min()) and float(error.max()) < 0.3, error.tolist()
    saturated = fp8_error(1e-3)  # |K|, |V| up to ~7 stored as up to 7000: clamped at 448
    assert float(saturated.max()) > 0.3, saturated.tolist()


def _with_scales(src: str, dst, extra: dict[str, float]) -> str:
    """A copy of the checkpoint folder `src` with scalar tensors `extra` added to its weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    weights.update({name: torch.tensor(value, dtype=torch.float32) for name, value in extra.items()})
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize(
    "names",
    [
        ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale"),
        ("model.layers.{i}.self_attn.k_proj.output_scale", "model.layers.{i}.self_attn.v_proj.output_scale"),
        ("model.layers.{i}.self_attn.k_proj.k_scale", "model.layers.{i}.self_attn.v_proj.v_scale"),
    ],
    ids=["k_scale", "output_scale", "modelopt"],
)
def test_checkpoint_scales_are_loaded_and_kept(tiny, tmp_path, device, backend_name, make_engine, names):
    values = {0: (0.03125, 0.0625), 1: (0.25, 0.5)}
    extra = {names[w].format(i=i): values[i][w] for i in values for w in (0, 1)}
    folder = _with_scales(tiny.folder, tmp_path / "ckpt", extra)
    loaded = _load(folder, device, backend_name)
    assert _scales(loaded) == [values[0], values[1]]
    assert all(a.calibrating == {"k": False, "v": False} for a in _layers(loaded))
    make_engine(loaded, kv_cache_dtype="fp8").generate(random_prompts((20,), seed=23), [GREEDY])
    assert _scales(loaded) == [values[0], values[1]]  # never calibrated over


def test_steps_with_calibration_paused_leave_the_scales_to_the_next_prefill(tiny, device, backend_name,
                                                                            make_engine):
    """What the engine's start-up warm-up relies on: its dummy prefills set no scale."""
    loaded = _load(tiny.folder, device, backend_name)
    engine = make_engine(loaded, kv_cache_dtype="fp8")
    with kv_scale_calibration_paused(loaded.model):
        engine.generate(random_prompts((12,), seed=25), [GREEDY])
    assert _scales(loaded) == [(1.0, 1.0)] * 2 and all(a.calibrating == {"k": True, "v": True} for a in _layers(loaded))
    engine.generate(random_prompts((12,), seed=26), [GREEDY])
    assert all(1.0 not in pair for pair in _scales(loaded))


def test_old_kv_scale_sets_both_and_the_other_layer_calibrates(tiny, tmp_path, device, backend_name, make_engine):
    folder = _with_scales(tiny.folder, tmp_path / "ckpt", {"model.layers.0.self_attn.kv_scale": 0.125})
    loaded = _load(folder, device, backend_name)
    first, second = _layers(loaded)
    assert _scales(loaded)[0] == (0.125, 0.125) and second.calibrating == {"k": True, "v": True}
    make_engine(loaded, kv_cache_dtype="fp8").generate(random_prompts((20,), seed=24), [GREEDY])
    assert _scales(loaded)[0] == (0.125, 0.125) and 1.0 not in _scales(loaded)[1]


def test_bad_checkpoint_scale_is_refused(tiny, tmp_path, device, backend_name):
    from safetensors.torch import load_file, save_file

    folder = _with_scales(tiny.folder, tmp_path / "ckpt", {})
    weights = load_file(f"{folder}/model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.full((2,), 0.5)  # per head: not supported
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="expected k_scale to be one finite number > 0"):
        _load(folder, device, backend_name)
