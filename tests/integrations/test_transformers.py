"""pagedattn inside transformers (`pagedattn.integrations.transformers`): the registered attention
function against the dense oracle, greedy tokens of tiny random Llama, Qwen2 and Gemma 2 models
(window every other layer, soft cap, 4:1 GQA) against transformers' own attention, for
`generate` and, where the installed transformers allows it, `generate_batch`; and the refusals.

CI runs the installed transformers; other versions are checked by running this file in a
virtual environment that has them (docs/API.md names the versions checked).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pagedattn  # noqa: E402
import pagedattn.integrations.transformers as pa_hf  # noqa: E402
from oracle import Tolerance, assert_attention_close, assert_outputs_differ, dense_attention  # noqa: E402
from pagedattn.integrations.ragged import BACKENDS, RaggedAttention  # noqa: E402
from pagedattn.models.dummy import load_dummy_model, transformers_model  # noqa: E402

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-gemma2")
NEW_TOKENS = 12
TOL = Tolerance(atol=1e-4, rtol=1e-4, rel_l2=1e-5)


def _attention(name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


class _Layer(torch.nn.Module):
    """What transformers' attention functions read of their module."""

    is_causal = True
    layer_idx = 0


def _padded_batch(num_heads=4, num_kv_heads=2, head_size=32, lengths=(11, 6), q_len=None, seed=0):
    """Left-padded q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] and the 2D mask [B, Sk]."""
    gen = torch.Generator().manual_seed(seed)
    b, sk = len(lengths), max(lengths)
    sq = sk if q_len is None else q_len
    q = torch.randn(b, num_heads, sq, head_size, generator=gen)
    k, v = (torch.randn(b, num_kv_heads, sk, head_size, generator=gen) for _ in range(2))
    mask = torch.zeros(b, sk, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, sk - n:] = True
    return q, k, v, mask


@pytest.mark.parametrize("q_len", [None, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 4}, {"softcap": 2.0}], ids=["plain", "window", "softcap"])
def test_attention_matches_oracle(backend_name, options, q_len):
    if backend_name not in BACKENDS:
        pytest.skip(f"the transformers integration runs on {BACKENDS}, not {backend_name}")
    attend = _attention(pa_hf.register(backend_name))
    q, k, v, mask = _padded_batch(q_len=q_len)
    scale = 0.3
    with torch.no_grad():
        out, weights = attend(_Layer(), q, k, v, mask, scaling=scale, **options)
    assert weights is None and out.shape == (2, q.shape[2], 4, 32)
    for i, valid in enumerate(mask):
        n_q = min(int(valid.sum()), q.shape[2])
        ref = dense_attention(q[i, :, -n_q:].transpose(0, 1), k[i, :, valid].transpose(0, 1),
                              v[i, :, valid].transpose(0, 1), scale=scale,
                              sliding_window=options.get("sliding_window"), logits_soft_cap=options.get("softcap"))
        assert_attention_close(out[i, -n_q:], ref, TOL, what=f"sequence {i}")
    if options:  # an option that changes nothing is a bug
        with torch.no_grad():
            plain, _ = attend(_Layer(), q, k, v, mask, scaling=scale)
        assert_outputs_differ(out, plain, 1e-3, str(options))


def _reference(model) -> str:
    return "sdpa" if model._supports_sdpa else "eager"  # Gemma 2 has no sdpa in transformers 5.x


def _prompts(n_prompts: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 20, (n_prompts,), generator=gen).tolist()
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(params=FAMILIES)
def model(request):
    """A fresh model per test: generate_batch leaves state on the model it ran on."""
    return transformers_model(load_dummy_model(request.param, seed=0))


def test_generate_matches_transformers(model):
    from transformers import GenerationConfig

    name = pa_hf.register("torch")
    prompts = _prompts(3)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None,
                              output_scores=True, return_dict_in_generate=True)
    runs = {}
    for impl in (_reference(model), name):
        model.set_attn_implementation(impl)
        runs[impl] = model.generate(ids, attention_mask=mask, generation_config=config)
    ref, ours = runs.values()
    assert torch.equal(ours.sequences, ref.sequences)
    # 1e-2: under this suite, transformers 5.18's eager Gemma 2 differs from ours by up to 5e-3 in its
    # first step's logits (the same run outside pytest: 3e-6, as 5.24 here); the tokens are equal
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(ref.scores), atol=1e-2, rtol=1e-4)


def test_generate_batch_matches_paged_eager(model, monkeypatch):
    why = pa_hf.generate_batch_unavailable_reason()
    if why:
        pytest.skip(why)
    from pagedattn.benchmarks.transformers_runner import TransformersRunner

    calls = []
    real = RaggedAttention.__call__
    monkeypatch.setattr(RaggedAttention, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    name = pa_hf.register("torch")
    prompts = _prompts(5, seed=2)
    tokens = {}
    for impl in ("paged|eager", name):
        model.set_attn_implementation(impl)
        tokens[impl] = TransformersRunner(model, num_blocks=64, max_batch_tokens=64,
                                          persistent=False).generate(prompts, NEW_TOKENS)
    assert tokens[name] == tokens["paged|eager"]
    assert all(len(t) == NEW_TOKENS for t in tokens[name])
    # prefills and decodes both ran on our attention, every layer of every step
    assert len(calls) >= NEW_TOKENS * model.config.num_hidden_layers


def test_refusals():
    name = pa_hf.register("torch")
    attend = _attention(name)
    q, k, v, mask = _padded_batch()
    layer = _Layer()
    with pytest.raises(ValueError, match="dropout"):
        attend(layer, q, k, v, mask, dropout=0.1)
    with pytest.raises(ValueError, match="non-causal"):
        attend(layer, q, k, v, mask, is_causal=False)
    with pytest.raises(ValueError, match="attention sinks"):
        attend(layer, q, k, v, mask, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="value head size 16"):
        attend(layer, q, k, v[..., :16], mask)
    with pytest.raises(ValueError, match="2D padding mask"):
        attend(layer, q, k, v, torch.zeros(2, 1, 11, 11))
    with pytest.raises(ValueError, match="packed"):
        attend(layer, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 11], dtype=torch.int32))
    with torch.enable_grad(), pytest.raises(ValueError, match="requires_grad"):
        attend(layer, q.requires_grad_(), k, v, mask)
    with pytest.raises(ValueError, match="expected backend in"):  # outside BACKENDS, wherever it runs
        pa_hf.register("xformers")


def _bad_calls():
    q, k, v, mask = _padded_batch()  # q [2, 4, 11, 32], k/v [2, 2, 11, 32], mask [2, 11]
    return {
        "query rank": (ValueError, r"query\.shape \[B, H, S, D\]", (q[0], k, v, mask), {}),
        "key batch": (ValueError, r"key\.shape \[2, Hkv, Sk, 32\]", (q, k[:1], v[:1], mask), {}),
        "key head size": (ValueError, r"key\.shape", (q, k[..., :16], v, mask), {}),
        "value length": (ValueError, r"value\.shape\[:3\]", (q, k, v[:, :, :9], mask), {}),
        "more queries than keys": (ValueError, r"key\.shape\[2\] >= the query length 11",
                                   (q, k[:, :, :5], v[:, :, :5], None), {}),
        "empty query": (ValueError, "zero dimension", (q[:, :, :0], k, v, mask[:, :0]), {}),
        "key not a tensor": (TypeError, "expected key a torch.Tensor", (q, k.tolist(), v, mask), {}),
        "scaling str": (TypeError, "expected scaling a float", (q, k, v, mask), {"scaling": "0.3"}),
        "float mask": (ValueError, "bool or integer mask", (q, k, v, mask.float()), {}),
        "additive mask": (ValueError, "bool or integer mask", (q, k, v, torch.zeros(2, 11)), {}),
        "mask wider than keys": (ValueError, "kv_len between", (q, k, v, torch.ones(2, 12, dtype=torch.bool)), {}),
        "mask narrower than queries": (ValueError, "kv_len between", (q, k, v, mask[:, :4]), {}),
        "mask batch": (ValueError, r"2D padding mask \[2, kv_len\]", (q, k, v, mask[:1]), {}),
        "mask list": (TypeError, "expected attention_mask None or a torch.Tensor", (q, k, v, mask.tolist()), {}),
        "packed position_ids": (ValueError, "position_ids restart", (q[:1], k[:1], v[:1], None),
                                {"position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])}),
        "packed cu_seq_lens_k": (ValueError, "cu_seq_lens_k outside generate_batch", (q, k, v, None),
                                 {"cu_seq_lens_k": torch.tensor([0, 11], dtype=torch.int32)}),
        "packed max_length_q": (ValueError, "max_length_q outside generate_batch", (q, k, v, None),
                                {"max_length_q": 11}),
        "window 0": (ValueError, "sliding_window", (q, k, v, mask), {"sliding_window": 0}),
        "softcap 0": (ValueError, "soft_cap", (q, k, v, mask), {"softcap": 0.0}),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_calls_raise_clear_errors(case):
    """Odd inputs a caller (or another transformers version) may hand the attention function: a
    clear error naming what was expected, never an index past a tensor or a wrong silent answer."""
    error, match, args, kwargs = _bad_calls()[case]
    attend = _attention(pa_hf.register("torch"))
    with torch.no_grad(), pytest.raises(error, match=match):
        attend(_Layer(), *args, **kwargs)


def test_unpacked_position_ids_run():
    """One row of increasing positions (a prompt continuing at any offset) is not packed."""
    attend = _attention(pa_hf.register("torch"))
    q, k, v, _ = _padded_batch(lengths=(11,))
    with torch.no_grad():
        plain, _ = attend(_Layer(), q, k, v, None)
        offset, _ = attend(_Layer(), q, k, v, None, position_ids=torch.arange(7, 18)[None])
    torch.testing.assert_close(offset, plain, atol=0, rtol=0)


@pytest.mark.parametrize("name, error, match", [
    ("nope", ValueError, r"expected backend in \['auto', 'triton', 'torch'\], got 'nope'"),
    ("TRITON", ValueError, "got 'TRITON'"),
    (" torch", ValueError, "got ' torch'"),
    ("flash_attn", ValueError, "got 'flash_attn'"),
    (None, TypeError, "expected backend a str"),
    (3, TypeError, "got int 3"),
])
def test_register_refuses_bad_backend_names(name, error, match):
    with pytest.raises(error, match=match):
        pa_hf.register(name)


def test_register_refuses_auto_resolving_elsewhere(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_BACKEND", "flash_attn")
    with pytest.raises((ValueError, pagedattn.BackendUnavailableError), match="resolved to 'flash_attn'|cannot run"):
        pa_hf.register("auto")


def test_refuses_old_transformers(monkeypatch):
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ValueError, match=r"expected transformers >= 5\.1"):
        pa_hf.register("torch")


def test_generate_on_interpreted_triton_kernels(tmp_path):
    """The kernels' path (flash_attn_interface) on the CPU: TRITON_INTERPRET must be set before
    they are imported, so in a process of its own."""
    pytest.importorskip("triton")
    script = tmp_path / "run.py"
    script.write_text(
        "import torch\n"
        "from transformers import GenerationConfig\n"
        "import pagedattn.integrations.transformers as pa_hf\n"
        "from pagedattn.models.dummy import load_dummy_model, transformers_model\n"
        "model = transformers_model(load_dummy_model('tiny-gemma2', seed=0))\n"
        "ids = torch.tensor([[0, 0, 0] + list(range(10, 19)), list(range(30, 42))])\n"
        "mask = (ids != 0).long()\n"
        "config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)\n"
        "out = {}\n"
        "for impl in ('eager', pa_hf.register('triton')):\n"
        "    model.set_attn_implementation(impl)\n"
        "    out[impl] = model.generate(ids, attention_mask=mask, generation_config=config).tolist()\n"
        "a, b = out.values()\n"
        "assert a == b, out\n"
        "print('ok', list(out))\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parents[2]))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pagedattn_triton" in done.stdout


def test_host_reads_once_per_step(monkeypatch):
    """Every layer of a step passes the same mask (`generate`) or cu_seq_lens (`generate_batch`):
    rows and lengths are read on the host (a synchronisation on a GPU) once for the step, not
    per layer; a new or rewritten tensor is read again, an inference tensor (no version) always."""
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
    attend = _attention(pa_hf.register("torch"))
    q, k, v, mask = _padded_batch(lengths=(11, 6, 9))
    layer = _Layer()
    with torch.no_grad():
        outs = [attend(layer, q, k, v, mask, sliding_window=w)[0] for w in (None, 4, None, 4)]
        per_step = len(reads)  # the mask's rows and maxima; the torch backend's cu_seqlens
        assert per_step <= 3, f"{per_step} host reads for 4 layers of one step"
        torch.testing.assert_close(outs[2], outs[0], atol=0, rtol=0)
        mask[0, 5] = False  # rewritten in place: read again, and the answer follows it
        rewritten = attend(layer, q, k, v, mask)[0]
        assert len(reads) > per_step
        fresh = attend(layer, q, k, v, mask.clone())[0]
        torch.testing.assert_close(rewritten, fresh, atol=0, rtol=0)
        assert not torch.equal(rewritten, outs[0])
    with torch.inference_mode():
        inference_mask = mask.clone()
        first = attend(layer, q, k, v, inference_mask)[0]
        inference_mask[1, -1] = False
        before = len(reads)
        second = attend(layer, q, k, v, inference_mask)[0]
        assert len(reads) > before and not torch.equal(first[1], second[1])


def test_ragged_lengths_read_once_per_step(monkeypatch):
    """The torch backend's ragged call (generate_batch's path) reads the step's cu_seqlens once
    for all its layers, windowed or not, and again when they are rewritten."""
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
    layers = [RaggedAttention("torch", num_heads=4, head_size=16, num_kv_heads=2, scale=0.25, sliding_window=w)
              for w in (None, 3)]
    cu_q = torch.tensor([0, 5, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = torch.randn(6, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    with torch.no_grad():
        outs = [layers[i % 2](q, k, v, cu_q, cu_k, 5, 7) for i in range(4)]
        assert len(reads) == 2 and torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])
        cu_q[1:] = torch.tensor([4, 6], dtype=torch.int32)  # in place: 4 queries of 5 keys, 2 of 7
        again = layers[0](q, k, v, cu_q, cu_k, 4, 7)
        assert len(reads) == 4 and not torch.equal(again, outs[0])
