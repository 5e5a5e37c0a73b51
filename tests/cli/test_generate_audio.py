"""`pagedattn generate --audio FILE.wav` on a tiny Whisper: WAV files read as the engine's
waveforms, one request each, and one-line errors (exit 2) for what cannot work."""

from __future__ import annotations

import json
import wave

import numpy as np
import pytest
from tiny_models import save_tiny_whisper

from pagedattn.cli import main
from pagedattn.cli.generate import read_wav


@pytest.fixture(scope="module")
def tiny_whisper_folder(tmp_path_factory) -> str:
    return save_tiny_whisper(tmp_path_factory.mktemp("tiny_whisper_cli"))


def _write_wav(path, samples: np.ndarray, rate: int = 16000, width: int = 2) -> str:
    """samples: integers [frames] or [frames, channels], written as they are."""
    samples = samples if samples.ndim == 2 else samples[:, None]
    with wave.open(str(path), "wb") as f:
        f.setnchannels(samples.shape[1])
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(samples.astype({1: "u1", 2: "<i2", 3: "u1", 4: "<i4"}[width]).tobytes())
    return str(path)


def _tone(seconds: float, pitch: float) -> np.ndarray:
    """int16 samples of a tone."""
    t = np.arange(int(16000 * seconds)) / 16000
    return (9000 * np.sin(2 * np.pi * pitch * t)).astype(np.int16)


def _stderr_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_read_wav_scales_and_mixes_down(tmp_path):
    tone = _tone(0.1, 440.0)
    samples, rate = read_wav(_write_wav(tmp_path / "mono.wav", tone))
    assert rate == 16000 and samples.dtype == np.float32
    np.testing.assert_array_equal(samples, tone / 32768)
    stereo = np.stack([tone, -tone // 2], axis=1)
    samples, _ = read_wav(_write_wav(tmp_path / "stereo.wav", stereo, rate=8000))
    np.testing.assert_allclose(samples, (tone / 32768 + (-tone // 2) / 32768) / 2, rtol=1e-6)
    bytes8 = np.array([0, 128, 255], dtype=np.uint8)
    samples, _ = read_wav(_write_wav(tmp_path / "u8.wav", bytes8, width=1))
    np.testing.assert_array_equal(samples, [-1.0, 0.0, 127 / 128])


def test_audio_files_are_requests(tiny_whisper_folder, tmp_path, capsys):
    import pagedattn

    tones = {"a.wav": _tone(0.5, 440.0), "b.wav": _tone(0.8, 1250.0)}
    paths = [_write_wav(tmp_path / name, t) for name, t in tones.items()]
    base = ["generate", "--model", tiny_whisper_folder, "--device", "cpu", "--max-tokens", "5"]
    assert main([*base, "--json", "--audio", paths[0], "--audio", paths[1], "<|en|>"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == paths
    assert all(line["error"] is None and line["prompt_tokens"] == 2 for line in lines)

    llm = pagedattn.LLM(tiny_whisper_folder, device="cpu")
    params = pagedattn.SamplingParams(temperature=0, max_tokens=5)
    prompts = [{"encoder_prompt": {"audio": (t / 32768, 16000)}, "decoder_prompt": "<|en|>"} for t in tones.values()]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [line["outputs"][0]["token_ids"] for line in lines] == expected

    assert main([*base, "--audio", paths[0]]) == 0  # one file: streamed
    assert capsys.readouterr().err.count("tokens in") == 1


def test_audio_errors_are_one_line(tiny_whisper_folder, tiny_chat, tmp_path, capsys):
    good = _write_wav(tmp_path / "good.wav", _tone(0.2, 440.0))
    base = ["generate", "--device", "cpu", "--max-tokens", "2"]
    whisper = [*base, "--model", tiny_whisper_folder]
    (tmp_path / "notes.txt").write_text("not audio")
    cases = [
        ([*whisper, "--audio", str(tmp_path / "missing.wav")], "expected --audio to name a PCM WAV file, got"),
        ([*whisper, "--audio", str(tmp_path / "notes.txt")], "expected --audio to name a PCM WAV file, got"),
        ([*whisper, "--audio", _write_wav(tmp_path / "w24.wav", np.zeros(30, np.uint8), width=3)],
         "expected 8-, 16- or 32-bit PCM samples"),
        ([*whisper, "--audio", good, "one", "two"], "expected at most one PROMPT (the decoder prompt)"),
        ([*whisper, "--audio", _write_wav(tmp_path / "slow.wav", _tone(0.2, 440.0), rate=8000)],
         "expected --audio sampled at 16000 Hz (no resampling), got 8000 Hz in"),
        ([*whisper, "hello"], "expected --audio FILE.wav for the audio model"),
        ([*base, "--model", tiny_chat, "--audio", good],
         "expected a model with an audio encoder (Whisper) for --audio"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        line = _stderr_line(capsys)
        assert line.startswith("pagedattn generate: error: ") and message in line, line
