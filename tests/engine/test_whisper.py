"""End to end on a tiny random Whisper: the engine's greedy tokens equal transformers' `generate`
on the same features and decoder start, whatever the scheduling (prefix caching, chunked
prefill, preemption by recompute or swap, batch composition), and bad audio input fails per
request.

An audio request's encoder prompt is log-mel features (given, or made from a waveform by the
model folder's feature extractor); its encoder length is the model's rule (half the frames,
rounded up). Features shorter than the window run as they are: their reference is
transformers' encoder modules (`whisper_encoder_reference`), its forward refusing them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from schedule_counter import count_schedule
from tiny_models import TINY_WHISPER_CONFIG, tiny_bart, tiny_whisper, whisper_encoder_reference

from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.sequence import EncoderFeatures, Sequence
from pagedattn.models.whisper import encoder_len

from .conftest import engine_factory

START = TINY_WHISPER_CONFIG["decoder_start_token_id"]
MELS = TINY_WHISPER_CONFIG["num_mel_bins"]
WINDOW = 2 * TINY_WHISPER_CONFIG["max_source_positions"]  # frames: 1 s at 16 kHz
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_whisper")
    return str(folder), tiny_whisper(folder)


@pytest.fixture(scope="module")
def whisper_loaded(whisper, device, backend_name):
    from pagedattn.models.loader import load_model

    return load_model(whisper[0], dtype=torch.float32, device=device, attention_backend=backend_name)


@pytest.fixture
def make_whisper_engine(whisper_loaded, device, backend_name):
    return engine_factory(whisper_loaded, device, backend_name, block_size=4)


def _features(frames: int, seed: int) -> torch.Tensor:
    return torch.randn(MELS, frames, generator=torch.Generator().manual_seed(seed))


def _wave(seconds: float, pitch: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds), dtype=np.float32) / 16000
    return (0.3 * np.sin(2 * np.pi * pitch * t) + 0.05 * np.sin(2 * np.pi * 3.1 * pitch * t)).astype(np.float32)


def _prompts() -> list[dict]:
    """Full windows and shorter features, some with a decoder prompt of their own, two sharing
    a decoder prompt over different features, one repeated (prefix-cache hits), one batch of
    one ([1, mels, frames]), one waveform, one text decoder prompt."""
    dec = [START, 152, 153, 154, 5, 6, 7, 8, 9, 10]  # 10 tokens: two full blocks of 4
    f = [_features(WINDOW, s) for s in range(4)] + [_features(37, 4), _features(12, 5)]
    return [
        {"encoder_prompt": {"input_features": f[0]}},
        {"encoder_prompt": {"input_features": f[1]}, "decoder_prompt": dec},
        {"encoder_prompt": {"input_features": f[4]}},
        {"encoder_prompt": {"input_features": f[2]}, "decoder_prompt": dec},
        {"encoder_prompt": {"input_features": f[3][None]}, "decoder_prompt": dec[1:5]},  # start prepended
        {"encoder_prompt": {"audio": (_wave(0.6, 440.0), 16000)}},
        {"encoder_prompt": {"input_features": f[5]}, "decoder_prompt": "<|startoftranscript|> <|en|> w3 w4"},
        {"encoder_prompt": {"input_features": f[1].clone()}, "decoder_prompt": dec},
    ]


def _reference_input(whisper_folder, encoder_prompt: dict) -> torch.Tensor:
    """The features [mels, frames] transformers gets: given, or its feature extractor's."""
    from transformers import WhisperFeatureExtractor

    if "audio" in encoder_prompt:
        wave, rate = encoder_prompt["audio"]
        extractor = WhisperFeatureExtractor.from_pretrained(whisper_folder)
        return torch.from_numpy(extractor(wave, sampling_rate=rate, return_tensors="np")["input_features"][0])
    return encoder_prompt["input_features"].reshape(MELS, -1)


def _hf_generate(whisper, prompt: dict, max_tokens: int, decoder_ids: list[int] | None = None) -> list[int]:
    """transformers' greedy continuation (GenerationMixin's, without Whisper's own rules:
    no forced or suppressed tokens), from `decoder_ids` (default: the decoder start token)."""
    from transformers.generation.utils import GenerationMixin

    folder, reference = whisper
    features = _reference_input(folder, prompt["encoder_prompt"])
    decoder = list(decoder_ids or prompt.get("decoder_prompt") or [START])
    if decoder[0] != START:
        decoder.insert(0, START)
    if features.shape[1] == WINDOW:
        encoder = {"input_features": features[None]}
    else:
        encoder = {"encoder_outputs": whisper_encoder_reference(reference, features)}
    out = GenerationMixin.generate(
        reference, decoder_input_ids=torch.tensor([decoder]), do_sample=False, max_new_tokens=max_tokens,
        num_beams=1, eos_token_id=None, pad_token_id=150, **encoder,
    )
    return out[0, len(decoder) :].tolist()


@pytest.fixture(scope="module")
def greedy_refs(whisper, whisper_loaded):
    tokenizer = whisper_loaded.tokenizer
    refs = []
    for p in _prompts():
        text = p.get("decoder_prompt")
        ids = tokenizer.encode(text, add_special_tokens=False) if isinstance(text, str) else None
        refs.append(_hf_generate(whisper, p, MAX_TOKENS, ids))
    return refs


def _greedy(engine, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = engine.generate(prompts, [params] * len(prompts))
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


def _encoder_len(prompt: dict, whisper_folder) -> int:
    return encoder_len(_reference_input(whisper_folder, prompt["encoder_prompt"]).shape[1])


CONFIGS = {
    "default": {},
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "no_chunking": dict(enable_chunked_prefill=False),
    "small_step_budget": dict(max_num_batched_tokens=64, max_num_seqs=3),
    "block_size_16": dict(block_size=16, num_kv_blocks=40),
    "max_num_seqs_1": dict(max_num_seqs=1),
    "multi_step_4": dict(num_scheduler_steps=4),
}


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_greedy_matches_transformers(make_whisper_engine, whisper, greedy_refs, config):
    engine = make_whisper_engine(**CONFIGS[config])
    counts = count_schedule(engine)
    assert _greedy(engine, _prompts()) == greedy_refs
    assert counts["encoder_tokens"] == sum(_encoder_len(p, whisper[0]) for p in _prompts())  # once per request
    assert engine.block_manager.num_free_cross_blocks == engine.runner.num_cross_blocks  # all freed


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(make_whisper_engine, whisper, mode):
    """Short features (3 to 6 encoder positions), long outputs, a pool of 10 blocks of 4:
    decoders outgrow it."""
    prompts = [{"encoder_prompt": {"input_features": _features(n, 9 + n)}} for n in (6, 12, 8, 10)]
    refs = [_hf_generate(whisper, p, 24) for p in prompts]
    engine = make_whisper_engine(num_kv_blocks=10, preemption_mode=mode, swap_space_gib=0.01)
    counts = count_schedule(engine)
    assert _greedy(engine, prompts, max_tokens=24) == refs
    assert counts["preempted"] > 0
    encoder_tokens = sum(_encoder_len(p, whisper[0]) for p in prompts)
    if mode == "swap":  # swapped cross K/V come back: each encoder runs once
        assert counts["cross_swap_out"] > 0 and counts["cross_swap_in"] > 0
        assert counts["encoder_tokens"] == encoder_tokens
    else:  # a recomputed request runs its encoder again
        assert counts["encoder_tokens"] > encoder_tokens
    assert engine.block_manager.num_free_cross_blocks == engine.runner.num_cross_blocks


def test_requests_alone_match_the_batch(make_whisper_engine, greedy_refs):
    engine = make_whisper_engine()
    for prompt, ref in zip(_prompts(), greedy_refs):
        assert _greedy(engine, [prompt]) == [ref]


def test_two_waveforms_in_one_batch(make_whisper_engine, whisper):
    prompts = [{"encoder_prompt": {"audio": (_wave(s, pitch), 16000)}} for s, pitch in ((0.4, 300.0), (1.0, 1250.0))]
    refs = [_hf_generate(whisper, p, MAX_TOKENS) for p in prompts]
    assert refs[0] != refs[1]
    assert _greedy(make_whisper_engine(), prompts) == refs


def test_prefix_cache_keys_on_the_features(make_whisper_engine, greedy_refs):
    """Decoder K/V depend on the encoder output: blocks are shared between requests with equal
    features (whatever tensor holds them) and decoder prompts only."""
    engine = make_whisper_engine()
    prompts = _prompts()
    _greedy(engine, [prompts[1]])
    dec = prompts[1]["decoder_prompt"]

    def seq(features: torch.Tensor) -> Sequence:
        return Sequence(-1, list(dec), 4, encoder_features=EncoderFeatures(features.clone(), encoder_len(WINDOW)))

    assert len(engine.block_manager.prefix_hits(seq(prompts[1]["encoder_prompt"]["input_features"]))) == 2
    assert engine.block_manager.prefix_hits(seq(prompts[3]["encoder_prompt"]["input_features"])) == []
    nudged = prompts[1]["encoder_prompt"]["input_features"].clone()
    nudged[7, 9] += 1e-3
    assert engine.block_manager.prefix_hits(seq(nudged)) == []
    counts = count_schedule(engine)
    assert _greedy(engine, [prompts[7], prompts[3]]) == [greedy_refs[7], greedy_refs[3]]
    assert counts["encoder_tokens"] == 2 * encoder_len(WINDOW)  # a hit still runs the encoder


def test_bad_audio_input_fails_alone(make_whisper_engine, greedy_refs, tmp_path, device):
    ok = _prompts()[0]
    wave = _wave(0.5, 440.0)
    bad = {
        "mel bins": {"encoder_prompt": {"input_features": torch.randn(MELS + 1, 20)}},
        "frames": {"encoder_prompt": {"input_features": torch.randn(MELS, WINDOW + 1)}},
        "text": "hello",
        "token ids": {"encoder_prompt": [1, 2, 3]},
        "keys": {"encoder_prompt": {"input_features": torch.randn(MELS, 4), "audio": (wave, 16000)}},
        "rate": {"encoder_prompt": {"audio": (wave, 44100)}},
        "stereo": {"encoder_prompt": {"audio": (np.stack([wave, wave]), 16000)}},
        "long": {"encoder_prompt": {"audio": (_wave(1.5, 440.0), 16000)}},
        "nan": {"encoder_prompt": {"input_features": torch.full((MELS, 8), float("nan"))}},
        "ints": {"encoder_prompt": {"input_features": torch.ones(MELS, 8, dtype=torch.int64)}},
        "empty": {"encoder_prompt": {"input_features": torch.zeros(MELS, 0)}},
        "budget": {"encoder_prompt": {"input_features": torch.randn(MELS, WINDOW)}, "decoder_prompt": [START] * 20},
    }
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = make_whisper_engine(max_num_batched_tokens=64, max_num_seqs=4)
    outputs = engine.generate([ok, *bad.values(), ok], [params] * (len(bad) + 2))
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", *["error"] * len(bad), "length"]
    assert outputs[0].outputs[0].token_ids == outputs[-1].outputs[0].token_ids == greedy_refs[0]
    errors = dict(zip(bad, (o.error for o in outputs[1:-1])))
    assert f"expected input_features of shape [{MELS} mel bins, frames], got [{MELS + 1}, 20]" in errors["mel bins"]
    assert f"expected at most {WINDOW} frames of input_features" in errors["frames"]
    assert f"got {WINDOW + 1}" in errors["frames"]
    assert "expected an audio encoder prompt for this model" in errors["text"] and errors["text"].endswith("got text")
    assert "got list [1, 2, 3]" in errors["token ids"]
    assert "got keys ['audio', 'input_features']" in errors["keys"]
    assert "expected audio sampled at 16000 Hz (it is not resampled), got 44100 Hz" in errors["rate"]
    assert "expected a non-empty mono waveform [samples]" in errors["stereo"] and "[2, 8000]" in errors["stereo"]
    assert "expected audio of at most 1 s" in errors["long"] and "got 1.5 s" in errors["long"]
    assert "expected finite input_features" in errors["nan"]
    assert "expected floating-point input_features, got torch.int64" in errors["ints"]
    assert "got [80, 0]" in errors["empty"]
    assert "max_num_batched_tokens (64)" in errors["budget"] and "got 70" in errors["budget"]


def test_audio_for_a_text_encoder_fails_alone(tmp_path, device, backend_name):
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine

    tiny_bart(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=32, block_size=4, device=str(device),
                                    backend=backend_name, dtype="float32"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = engine.generate([{"encoder_prompt": {"audio": (_wave(0.2, 440.0), 16000)}}, [5, 6, 7]], [params] * 2)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert "expected a text or token-id encoder prompt for this model (its encoder takes no audio)" in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 4


def test_llm_takes_audio(whisper, device, backend_name):
    import pagedattn

    folder, _ = whisper
    llm = pagedattn.LLM(
        folder, device=str(device), backend=backend_name, dtype="float32", num_kv_blocks=64, block_size=4
    )
    params = pagedattn.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"encoder_prompt": {"audio": (_wave(0.7, 523.0), 16000)}, "decoder_prompt": "<|en|> w7"}
    [out] = llm.generate(prompt, params)
    assert out.prompt_token_ids == [START, 152, 7] and out.encoder_prompt_token_ids is None
    assert out.outputs[0].token_ids == _hf_generate(whisper, prompt, 6, [START, 152, 7])
    assert out.outputs[0].text.strip() == llm.tokenizer.decode(out.outputs[0].token_ids)  # after the prompt: a space
