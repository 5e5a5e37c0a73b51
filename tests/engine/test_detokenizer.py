"""The detokenizer's decode: a fast tokenizer's Rust decode where that is what `tokenizer.decode`
returns (no space clean-up), transformers' `decode` otherwise; the same text either way."""

from __future__ import annotations

import copy
import random

from tiny_models import byte_tokenizer

from pagedattn.engine.detokenizer import IncrementalDetokenizer, decoder


def test_the_fast_decode_is_the_tokenizers_decode():
    tok = byte_tokenizer()
    assert not tok.clean_up_tokenization_spaces and hasattr(tok, "backend_tokenizer")
    fast = decoder(tok)
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(12))]
        assert fast(ids) == tok.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_decode():
    class CleaningUp:
        clean_up_tokenization_spaces = True
        backend_tokenizer = None  # never used

        def decode(self, ids, skip_special_tokens):
            return "x" * len(ids)

    assert decoder(CleaningUp())([1, 2, 3]) == "xxx"


def test_incremental_text_equals_the_whole_decode():
    tok = byte_tokenizer()
    prompt = tok.encode("Hello there,")
    out = tok.encode(" caf\u00e9 \u2603 ok")  # multi-byte characters across byte tokens
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.add(t) for t in out) + detok.flush()
    assert text == detok.text == tok.decode(out, skip_special_tokens=True)


def test_a_fork_goes_on_as_a_deep_copy_would_and_shares_the_tokenizer():
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    for t in tok.encode(" caf"):
        detok.add(t)
    child, copied = detok.fork(), copy.deepcopy(detok)
    assert child.tokenizer is tok
    rest = tok.encode("\u00e9 \u2603")
    for t in rest:
        assert child.add(t) == copied.add(t)
    assert child.flush() == copied.flush() and child.text == copied.text
    assert detok.text == tok.decode(tok.encode(" caf"), skip_special_tokens=True)  # the parent is untouched
