"""BART against transformers on tiny random weights, step by step through the paged caches.

One metadata per step serves the encoder (ENCODER: each prefill's encoder prompt), the
decoder's self-attention (DECODER, the decoder pool) and cross-attention (ENCODER_DECODER:
written into the cross pool on the prefill step, read back on decode steps).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_BART_CONFIG, VOCAB, tiny_bart

import pagedattn
from pagedattn.models import load_model

BS = 4
START = TINY_BART_CONFIG["decoder_start_token_id"]
VARIANTS = {
    "tied_scaled_gelu": {},
    "untied_unscaled_relu": dict(tie_word_embeddings=False, scale_embedding=False, activation_function="relu"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return str(folder), tiny_bart(folder, **VARIANTS[request.param])


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Pools:
    """The decoder pool and the cross pool of a loaded BART, blocks handed out shuffled."""

    def __init__(self, lm, backend, device, num_blocks: int = 64):
        spec = lm.spec
        shape = backend.get_kv_cache_shape(num_blocks, BS, spec.num_kv_heads, spec.head_size)
        n = spec.num_layers + spec.num_cross_layers
        self.caches = [torch.full(shape, float("nan"), dtype=spec.dtype, device=device) for _ in range(n)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
        self.builder = backend.get_builder_cls()(BS, device)
        self.lm, self.device = lm, device

    def blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // BS)
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def step(self, parts) -> torch.Tensor:
        """parts: (encoder ids, decoder ids, context_len, query_len, block table, cross table),
        prefills first -> logits float32 [T, vocab] of the step's query tokens."""
        ids, pos, enc_ids, enc_pos, seqs = [], [], [], [], []
        for enc, dec, context_len, query_len, table, cross in parts:
            seq = pagedattn.ScheduledSeq(context_len + query_len, query_len, table, encoder_len=len(enc),
                                         cross_block_table=cross)
            ids += dec[context_len : seq.seq_len]
            pos += range(context_len, seq.seq_len)
            if seq.is_prefill:
                enc_ids += enc
                enc_pos += range(len(enc))
            seqs.append(seq)
        md = self.builder.build(seqs)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        encoder = (t(enc_ids), t(enc_pos)) if enc_ids else (None, None)
        with torch.inference_mode(), pagedattn.forward_context(md, self.caches):
            return self.lm.model.compute_logits(self.lm.model(t(ids), t(pos), *encoder)).cpu()


def _reference(model, enc: list[int], dec: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([dec])).logits[0].float()


def test_spec(checkpoint, device, backend_name):
    lm = load_model(checkpoint[0], dtype=torch.float32, device=device, attention_backend=backend_name)
    spec = lm.spec
    assert spec.architecture == "BartForConditionalGeneration" and spec.is_encoder_decoder
    geometry = (spec.num_layers, spec.num_cross_layers, spec.num_heads, spec.num_kv_heads, spec.head_size)
    assert geometry == (2, 2, 4, 4, 16)
    assert (spec.hidden_size, spec.vocab_size, spec.max_model_len, spec.max_encoder_len) == (64, VOCAB, 64, 64)
    assert spec.decoder_start_token_id == START and spec.eos_token_ids == {257}
    assert spec.sliding_windows == (None, None)
    kinds = [m.impl.attn_type for m in lm.model.modules() if isinstance(m, pagedattn.Attention)]
    AT = pagedattn.AttentionType
    assert kinds == [AT.ENCODER] * 2 + [AT.DECODER, AT.ENCODER_DECODER] * 2


def test_prefill_then_decode_matches_transformers(checkpoint, device, backend, backend_name):
    """Two requests prefilled together, then one decoding while a third prefills beside it."""
    folder, reference = checkpoint
    lm = load_model(folder, dtype=torch.float32, device=device, attention_backend=backend_name)
    pools = Pools(lm, backend, device)
    a_enc, b_enc, c_enc = _tokens(7, 1), _tokens(13, 2), _tokens(5, 3)
    a_dec, b_dec, c_dec = [START, *_tokens(8, 4)], [START, *_tokens(2, 5)], [START, *_tokens(4, 6)]
    a_tab, b_tab, c_tab = pools.blocks(len(a_dec)), pools.blocks(len(b_dec)), pools.blocks(len(c_dec))
    a_x, b_x, c_x = pools.blocks(len(a_enc)), pools.blocks(len(b_enc)), pools.blocks(len(c_enc))
    a_ref, b_ref, c_ref = (_reference(reference, e, d) for e, d in ((a_enc, a_dec), (b_enc, b_dec), (c_enc, c_dec)))

    first = pools.step([(a_enc, a_dec, 0, 6, a_tab, a_x), (b_enc, b_dec, 0, 3, b_tab, b_x)])
    torch.testing.assert_close(first, torch.cat([a_ref[:6], b_ref]), atol=1e-4, rtol=1e-4)
    for n in range(6, len(a_dec)):  # a decodes (cross K/V from the pool), c prefills beside it
        parts = [(a_enc, a_dec, n, 1, a_tab, a_x)]
        if n == 7:
            parts.insert(0, (c_enc, c_dec, 0, len(c_dec), c_tab, c_x))
        out = pools.step(parts)
        torch.testing.assert_close(out[-1], a_ref[n], atol=1e-4, rtol=1e-4)
        if n == 7:
            torch.testing.assert_close(out[:-1], c_ref, atol=1e-4, rtol=1e-4)


def test_loads_older_and_trimmed_checkpoints(checkpoint, tmp_path, device, backend_name):
    """Tied: copies of the shared embedding (older checkpoints save them) are skipped. A
    missing `final_logits_bias` is zero, as in transformers."""
    from safetensors.torch import load_file, save_file

    folder, reference = checkpoint
    weights = load_file(f"{folder}/model.safetensors")
    if reference.config.tie_word_embeddings:
        for part in ("encoder", "decoder"):
            weights[f"model.{part}.embed_tokens.weight"] = weights["model.shared.weight"] + 1  # never read
    del weights["final_logits_bias"]
    save_file(weights, tmp_path / "model.safetensors")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_text(open(f"{folder}/{f}").read())
    lm = load_model(tmp_path, dtype=torch.float32, device=device, attention_backend=backend_name)
    assert torch.count_nonzero(lm.model.final_logits_bias) == 0
    enc, dec = _tokens(6, 7), [START, 3, 4]
    ref = _reference(reference, enc, dec) - reference.final_logits_bias[0].detach()
    pools = Pools(lm, pagedattn.get_backend(backend_name), device)
    out = pools.step([(enc, dec, 0, len(dec), pools.blocks(len(dec)), pools.blocks(len(enc)))])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
