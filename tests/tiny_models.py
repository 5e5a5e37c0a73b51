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
