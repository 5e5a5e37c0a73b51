"""Whisper against transformers on tiny random weights, step by step through the paged caches.

One metadata per step serves the encoder (ENCODER: each prefill's log-mel features, through
the convolutions, as its encoder positions), the decoder's self-attention (DECODER) and
cross-attention (ENCODER_DECODER: written into the cross pool on the prefill step, read back on
decode steps). Features shorter than the window run as they are; transformers' own forward
refuses them, so their reference is its modules run by `whisper_encoder_reference`.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import TINY_WHISPER_CONFIG, tiny_whisper, whisper_encoder_reference

import pagedattn
from pagedattn.models import load_model
from pagedattn.models.whisper import LogMelInput, encoder_len

from .test_bart import Pools

START = TINY_WHISPER_CONFIG["decoder_start_token_id"]
MELS = TINY_WHISPER_CONFIG["num_mel_bins"]
WINDOW = 2 * TINY_WHISPER_CONFIG["max_source_positions"]  # frames
VARIANTS = {"tied": {}, "untied": dict(tie_word_embeddings=False)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"whisper_{request.param}")
    return str(folder), tiny_whisper(folder, **VARIANTS[request.param])


def _features(frames: int, seed: int) -> torch.Tensor:
    return torch.randn(MELS, frames, generator=torch.Generator().manual_seed(seed))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class WhisperPools(Pools):
    def step(self, parts) -> torch.Tensor:
        """parts: (features [MELS, frames], decoder ids, context_len, query_len, block table,
        cross table), prefills first -> logits float32 [T, vocab] of the step's query tokens."""
        ids, pos, features, enc_pos, seqs = [], [], [], [], []
        for feats, dec, context_len, query_len, table, cross in parts:
            n = encoder_len(feats.shape[1])
            seq = pagedattn.ScheduledSeq(context_len + query_len, query_len, table, encoder_len=n,
                                         cross_block_table=cross)
            ids += dec[context_len : seq.seq_len]
            pos += range(context_len, seq.seq_len)
            if seq.is_prefill:
                features.append(feats.to(self.device))
                enc_pos += range(n)
            seqs.append(seq)
        md = self.builder.build(seqs)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        encoder = (features, t(enc_pos)) if features else (None, None)
        with torch.inference_mode(), pagedattn.forward_context(md, self.caches):
            return self.lm.model.compute_logits(self.lm.model(t(ids), t(pos), *encoder)).cpu()


def _run_reference(model, features: torch.Tensor, dec: list[int], device) -> torch.Tensor:
    """transformers' logits [len(dec), vocab] (float64, on the CPU): its own encoder on a full
    window, else its modules."""
    model.to(device)
    features = features.to(device, next(model.parameters()).dtype)
    with torch.no_grad():
        dec = torch.tensor([dec], device=device)
        if features.shape[1] == WINDOW:
            return model(input_features=features[None], decoder_input_ids=dec).logits[0].double().cpu()
        encoder = whisper_encoder_reference(model, features)
        return model(encoder_outputs=encoder, decoder_input_ids=dec).logits[0].double().cpu()


def _reference(model, features: torch.Tensor, dec: list[int], device) -> torch.Tensor:
    """[2, len(dec), vocab]: transformers' float32 logits on the device under test, and its
    float64 logits on the CPU (the exact answer, for `_check`)."""
    exact = _run_reference(copy.deepcopy(model).double(), features.double(), dec, "cpu")
    return torch.stack([_run_reference(model, features, dec, device), exact])


def _check(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Our float32 logits as close to the exact ones as transformers' own float32 logits are, on
    the same device (within 2x; 1e-5 of the logits' scale at least). These random weights
    amplify float32 rounding (4/sqrt(fan_in) per layer): transformers' float32 logits differ from
    its float64 ones by ~1e-4 of their scale, and its SDPA from its eager attention by 2.5e-4,
    so a fixed 1e-4 between two float32 runs measured only whether they rounded alike."""
    theirs, exact = reference
    own = (theirs - exact).abs().max().item()
    err = (out.double() - exact).abs().max().item()
    bound = 2 * own + 1e-5 * exact.abs().max().item()
    assert err <= bound, f"max error {err:.3g} vs float64, bound {bound:.3g} (transformers' float32: {own:.3g})"


def test_encoder_length_is_the_convolutions_rule(checkpoint):
    reference = checkpoint[1]
    frames = torch.arange(1, WINDOW + 1)
    assert [encoder_len(int(f)) for f in frames] == reference._get_feat_extract_output_lengths(frames).tolist()
    assert encoder_len(WINDOW) == TINY_WHISPER_CONFIG["max_source_positions"]


def test_spec_and_audio_input(checkpoint, device, backend_name):
    lm = load_model(checkpoint[0], dtype=torch.float32, device=device, attention_backend=backend_name)
    spec = lm.spec
    assert spec.architecture == "WhisperForConditionalGeneration" and spec.is_encoder_decoder
    geometry = (spec.num_layers, spec.num_cross_layers, spec.num_heads, spec.num_kv_heads, spec.head_size)
    assert geometry == (2, 2, 4, 4, 16)
    assert (spec.hidden_size, spec.vocab_size, spec.max_model_len, spec.max_encoder_len) == (64, 160, 64, 50)
    assert spec.decoder_start_token_id == START and spec.eos_token_ids == {150}
    kinds = [m.impl.attn_type for m in lm.model.modules() if isinstance(m, pagedattn.Attention)]
    AT = pagedattn.AttentionType
    assert kinds == [AT.ENCODER] * 2 + [AT.DECODER, AT.ENCODER_DECODER] * 2
    assert isinstance(lm.audio, LogMelInput)
    assert (lm.audio.num_mel_bins, lm.audio.max_frames, lm.audio.sampling_rate) == (MELS, WINDOW, 16000)


def test_prefill_then_decode_matches_transformers(checkpoint, device, backend, backend_name):
    """Two requests prefilled together, then one decoding while a third prefills beside it;
    full windows and shorter features (odd frame counts included)."""
    folder, reference = checkpoint
    lm = load_model(folder, dtype=torch.float32, device=device, attention_backend=backend_name)
    pools = WhisperPools(lm, backend, device)
    a_f, b_f, c_f = _features(WINDOW, 1), _features(37, 2), _features(WINDOW - 1, 3)
    a_dec, b_dec, c_dec = [START, *_tokens(8, 4)], [START, *_tokens(2, 5)], [START, *_tokens(4, 6)]
    a_tab, b_tab, c_tab = pools.blocks(len(a_dec)), pools.blocks(len(b_dec)), pools.blocks(len(c_dec))
    a_x, b_x, c_x = (pools.blocks(encoder_len(f.shape[1])) for f in (a_f, b_f, c_f))
    a_ref, b_ref, c_ref = (_reference(reference, f, d, device) for f, d in ((a_f, a_dec), (b_f, b_dec), (c_f, c_dec)))

    first = pools.step([(a_f, a_dec, 0, 6, a_tab, a_x), (b_f, b_dec, 0, 3, b_tab, b_x)])
    _check(first, torch.cat([a_ref[:, :6], b_ref], dim=1))
    for n in range(6, len(a_dec)):  # a decodes (cross K/V from the pool), c prefills beside it
        parts = [(a_f, a_dec, n, 1, a_tab, a_x)]
        if n == 7:
            parts.insert(0, (c_f, c_dec, 0, len(c_dec), c_tab, c_x))
        out = pools.step(parts)
        _check(out[-1], a_ref[:, n])
        if n == 7:
            _check(out[:-1], c_ref)


def test_loading(checkpoint, tmp_path, device, backend_name):
    """A tied checkpoint's saved copy of the embeddings as `proj_out.weight` is skipped; a
    folder without preprocessor_config.json takes features only; a feature extractor whose mel
    bins differ from the model's is refused."""
    from safetensors.torch import load_file, save_file

    folder, reference = checkpoint
    weights = load_file(f"{folder}/model.safetensors")
    if reference.config.tie_word_embeddings:
        weights["proj_out.weight"] = weights["model.decoder.embed_tokens.weight"] + 1  # never read
    save_file(weights, tmp_path / "model.safetensors")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{folder}/{f}", tmp_path / f)
    lm = load_model(tmp_path, dtype=torch.float32, device=device, attention_backend=backend_name)
    assert lm.audio.feature_extractor is None and lm.audio.sampling_rate is None
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        lm.audio.features({"audio": ([0.0] * 100, 16000)})
    feats, dec = _features(WINDOW, 7), [START, 3, 4]
    pools = WhisperPools(lm, pagedattn.get_backend(backend_name), device)
    out = pools.step([(feats, dec, 0, len(dec), pools.blocks(len(dec)), pools.blocks(encoder_len(WINDOW)))])
    _check(out, _reference(reference, feats, dec, device))

    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(feature_size=MELS + 8, chunk_length=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"expected feature_size {MELS} .*got {MELS + 8}"):
        load_model(tmp_path, dtype=torch.float32, device=device, attention_backend=backend_name)


def test_audio_becomes_transformers_features(checkpoint):
    """A waveform goes through the folder's WhisperFeatureExtractor, padded to the window."""
    import numpy as np
    from transformers import WhisperFeatureExtractor

    folder = checkpoint[0]
    audio = LogMelInput.from_folder(checkpoint[1].config, Path(folder))
    wave = np.sin(np.arange(9000, dtype=np.float32) / 7) * 0.4
    ours = audio.features({"audio": (wave, 16000)})
    theirs = WhisperFeatureExtractor.from_pretrained(folder)(wave, sampling_rate=16000, return_tensors="pt")
    assert ours.dtype == torch.float32 and ours.shape == (MELS, WINDOW)
    torch.testing.assert_close(ours, theirs.input_features[0])
    batch_of_one = audio.features({"input_features": theirs.input_features})  # [1, mels, frames] taken as is
    torch.testing.assert_close(batch_of_one, ours)
