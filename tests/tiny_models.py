"""Pieces of the tiny random checkpoints that the engine and model tests build."""

from __future__ import annotations

VOCAB = 260  # 256 byte tokens + <s>, </s> and two spare ids


def byte_tokenizer():
    """A byte-level tokenizer over ids 0..255 plus <s> (256) and </s> (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)} | {"<s>": 256, "</s>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")

# A tiny config every family starts from: 2 layers, hidden 64, 4 query / 2 KV heads of 16.
TINY_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=256,
    eos_token_id=257,
)

# A minimal chat template: turns in brackets, then "A:" opens the answer (enough to tell that
# the template was applied).
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def save_tiny_chat_llama(folder, *, clear_cut: bool = False) -> str:
    """Save a random 2-layer Llama (context 128) with the byte tokenizer and `CHAT_TEMPLATE` in
    `folder`. `clear_cut`: untied, scaled weights, so greedy choices do not hinge on rounding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_CONFIG, tie_word_embeddings=False) if clear_cut else LlamaConfig(**TINY_CONFIG)
    model = LlamaForCausalLM(config).eval()
    if clear_cut:
        clear_cut_weights_(model)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


# A tiny BART: 2 encoder and 2 decoder layers, d_model 64, 4 heads of 16 (the smallest head size
# our Triton kernels take), byte vocabulary.
TINY_BART_CONFIG = dict(
    vocab_size=VOCAB,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=64,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
    decoder_start_token_id=257,  # BART starts decoding from EOS
    forced_eos_token_id=None,
    scale_embedding=True,
)


def tiny_bart(folder, **overrides):
    """Save a tiny random `BartForConditionalGeneration` (safetensors + byte tokenizer) in
    `folder`; returns transformers' model on the same weights (float32, eval) as the reference.

    Weights are drawn so that every part shows in the logits and greedy choices do not hinge on
    rounding: linear weights of gain 1.5, embeddings of std 0.5, layer norm scales around 1,
    and small random biases (`final_logits_bias` included)."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    model = BartForConditionalGeneration(BartConfig(**{**TINY_BART_CONFIG, **overrides})).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), ("final_logits_bias", model.final_logits_bias)]:
            rand = torch.randn(p.shape, generator=gen)
            if "norm.weight" in name:
                p.copy_(1.0 + 0.1 * rand)
            elif "embed" in name or "shared" in name:
                p.copy_(0.5 * rand)
            elif p.dim() == 2 and "bias" not in name:
                p.copy_(1.0 * rand / p.shape[1] ** 0.5)
            else:
                p.copy_(0.1 * rand)
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    return model


# A tiny Whisper: 2 encoder and 2 decoder layers, d_model 64, 4 heads of 16, 80 mel bins, 1 s
# windows (100 frames: the encoder's 50 positions), a word-level vocabulary of 160 ids.
WHISPER_SPECIAL_TOKENS = {
    "<|endoftext|>": 150,
    "<|startoftranscript|>": 151,
    "<|en|>": 152,
    "<|transcribe|>": 153,
    "<|notimestamps|>": 154,
    "<unk>": 155,
}
TINY_WHISPER_CONFIG = dict(
    vocab_size=160,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    num_mel_bins=80,
    max_source_positions=50,
    max_target_positions=64,
    bos_token_id=150,
    eos_token_id=150,
    pad_token_id=150,
    decoder_start_token_id=151,
    suppress_tokens=None,  # Whisper's defaults name ids of the full vocabulary
    begin_suppress_tokens=None,
)


def whisper_tokenizer():
    """A word-level tokenizer: "w0".."w149" are ids 0..149, then `WHISPER_SPECIAL_TOKENS`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(150)} | WHISPER_SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = [t for t in WHISPER_SPECIAL_TOKENS if t not in ("<|endoftext|>", "<unk>")]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<unk>",
        additional_special_tokens=specials,
    )


def tiny_whisper(folder, **overrides):
    """Save a tiny random `WhisperForConditionalGeneration` (safetensors, word-level tokenizer,
    a `WhisperFeatureExtractor` of 1 s windows) in `folder`; returns transformers' model on the
    same weights (float32, eval) as the reference.

    Weights are drawn so that greedy choices do not hinge on rounding and do not repeat the last
    token (pre-norm blocks over embeddings tied to the output favour it): linear and
    convolution weights of gain 4 over the fan-in, embeddings of std 0.3, layer norm scales
    around 1, small random biases. The encoder keeps transformers' sinusoidal positions (a
    checkpoint weight, loaded as such)."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration(WhisperConfig(**{**TINY_WHISPER_CONFIG, **overrides})).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            rand = torch.randn(p.shape, generator=gen)
            if name == "model.encoder.embed_positions.weight":
                continue
            if "norm.weight" in name:
                p.copy_(1.0 + 0.1 * rand)
            elif "embed" in name:
                p.copy_(0.3 * rand)
            elif p.dim() >= 2:  # linear and convolution weights
                p.copy_(4.0 * rand / p[0].numel() ** 0.5)
            else:
                p.copy_(0.1 * rand)
    model.save_pretrained(folder, safe_serialization=True)
    whisper_tokenizer().save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=model.config.num_mel_bins, chunk_length=1).save_pretrained(folder)
    return model


def save_tiny_whisper(folder) -> str:
    """`tiny_whisper` for tests that need only the folder (the command line)."""
    tiny_whisper(folder)
    return str(folder)


def whisper_encoder_reference(model, features):
    """transformers' Whisper encoder (`model`'s modules, float32) on log-mel features
    [num_mel_bins, frames] of any length up to the window: transformers' own forward refuses
    all but the full window. Returns its `BaseModelOutput`, last_hidden_state [1, positions, d_model]."""
    import torch
    import torch.nn.functional as F
    from transformers.modeling_outputs import BaseModelOutput

    encoder = model.model.encoder
    with torch.no_grad():
        h = F.gelu(encoder.conv2(F.gelu(encoder.conv1(features[None])))).permute(0, 2, 1)
        h = h + encoder.embed_positions.weight[: h.shape[1]]
        for layer in encoder.layers:
            h = layer(h, None)
        return BaseModelOutput(last_hidden_state=encoder.layer_norm(h))


def clear_cut_weights_(model) -> None:
    """Redraw `model`'s weights (seeded) so that its greedy choices are clear-cut: norms near 1,
    the rest 0.2 x N(0, 1)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
