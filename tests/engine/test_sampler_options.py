"""The sampler's options on small hand-made logits, against steps computed by hand: logit bias,
the min_tokens mask, presence / frequency / repetition penalties, min_p, log-probabilities."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pagedattn.engine.sampler import Sampler, SamplingBatch, _apply_min_p
from pagedattn.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 6


def _seq(prompt: list[int], generated: list[int]):
    """What the sampler reads of a `Sequence`."""
    tokens = prompt + generated
    return SimpleNamespace(token_ids=tokens, num_prompt_tokens=len(prompt), num_output_tokens=len(generated))


def _batch(params: list[SamplingParams], seqs=None, **kwargs) -> SamplingBatch:
    return SamplingBatch.build([(p, None) for p in params], V, CPU, seqs=seqs, **kwargs)


LOGITS = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0],
                       [0.0, 3.0, -2.0, 1.0, -0.5, 2.5]])


def test_plain_greedy_batch_builds_no_tensors():
    batch = _batch([SamplingParams(temperature=0)] * 2)
    assert batch.all_greedy and batch.temperatures is None and batch.min_p is None
    assert batch.bias is batch.masked is batch.penalties is None and not batch.logprob_rows
    assert batch.process(LOGITS) is LOGITS  # no copy of the logits either


def test_logit_bias():
    params = [SamplingParams(temperature=0, logit_bias={3: 7.0, "5": -200}), SamplingParams(temperature=0)]
    assert params[0].logit_bias == {3: 7.0, 5: -100.0}  # clamped like vLLM, JSON keys accepted
    expected = LOGITS.clone()
    expected[0, 3] = -3.0 + 7.0
    expected[0, 5] = 0.0 - 100.0
    batch = _batch(params)
    torch.testing.assert_close(batch.process(LOGITS), expected)
    draws = Sampler(torch.Generator()).sample(LOGITS, batch)
    assert draws.tokens.tolist() == [3, 1]  # greedy follows the bias
    # log-probabilities stay the model's: bias does not change them
    assert draws.logprobs[0].item() == pytest.approx(torch.log_softmax(LOGITS[0], -1)[3].item(), abs=1e-6)


def test_presence_and_frequency_penalties_over_generated_tokens():
    # row 0: prompt [0, 1], generated [2, 2, 4]; row 1: no penalty
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    seqs = [_seq([0, 1], [2, 2, 4]), _seq([1], [1])]
    batch = _batch([p, SamplingParams(temperature=0)], seqs)
    expected = LOGITS.clone()
    expected[0, 2] -= 0.25 * 2 + 0.5  # counted twice, present
    expected[0, 4] -= 0.25 * 1 + 0.5
    # prompt tokens 0 and 1 are not penalised (OpenAI's penalties cover the completion only)
    torch.testing.assert_close(batch.process(LOGITS), expected)


def test_repetition_penalty_over_prompt_and_generated_tokens():
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    seqs = [_seq([0, 3], [5]), _seq([1], [])]
    batch = _batch([p, SamplingParams(temperature=0)], seqs)
    expected = LOGITS.clone()
    expected[0, 0] = 2.0 / 2  # positive: divided
    expected[0, 3] = -3.0 * 2  # negative: multiplied
    expected[0, 5] = 0.0  # zero stays
    torch.testing.assert_close(batch.process(LOGITS), expected)
    # row order does not matter: penalise row 1 only
    batch = _batch([SamplingParams(temperature=0), p], [seqs[1], seqs[0]])
    expected = LOGITS.clone()
    expected[1, 0], expected[1, 3], expected[1, 5] = 0.0, 1.0 / 2, 2.5 / 2
    torch.testing.assert_close(batch.process(LOGITS), expected)


def test_bias_comes_before_penalties():
    """vLLM V1's order: the repetition penalty sees the biased logit's sign."""
    p = SamplingParams(temperature=0, logit_bias={3: 5.0}, repetition_penalty=2.0, frequency_penalty=1.0)
    batch = _batch([p], [_seq([3], [3])])
    out = batch.process(LOGITS[:1])
    assert out[0, 3].item() == pytest.approx((-3.0 + 5.0) / 2 - 1.0)


def test_min_tokens_masks_stop_tokens_until_enough_are_generated():
    eos = frozenset({4})
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[0], max_tokens=8)
    plain = SamplingParams(temperature=0)
    seqs = [_seq([1, 2], [5]), _seq([1], [])]  # row 0 generated 1 token: masked for 2 more draws
    batch = _batch([p, plain], seqs, eos_token_ids=eos)
    out = batch.process(LOGITS)
    assert out[0, 0] == -math.inf and out[0, 4] == -math.inf
    torch.testing.assert_close(out[1], LOGITS[1])
    assert Sampler(torch.Generator()).sample(LOGITS, batch).tokens[0].item() == 2  # not 0 (the argmax)
    # multi-step: one more draw, still masked; then free
    batch.advance(torch.tensor([2, 1]))
    assert batch.process(LOGITS)[0, 0] == -math.inf
    batch.advance(torch.tensor([2, 1]))
    torch.testing.assert_close(batch.process(LOGITS), LOGITS)
    # ignore_eos: EOS does not stop, so it is not masked; the stop token still is
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[0], ignore_eos=True, max_tokens=8)
    out = _batch([p], seqs[:1], eos_token_ids=eos).process(LOGITS[:1])
    assert out[0, 0] == -math.inf and out[0, 4] == LOGITS[0, 4]
    # a pending token (async scheduling) counts as generated: 2 generated -> one masked draw
    batch = _batch([p], seqs[:1], eos_token_ids=eos, pending=torch.tensor([5]))
    assert batch.process(LOGITS[:1])[0, 0] == -math.inf
    batch.advance(torch.tensor([2]))
    torch.testing.assert_close(batch.process(LOGITS[:1]), LOGITS[:1])


def test_pending_token_is_counted_like_a_host_token():
    p = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5)
    on_host = _batch([p], [_seq([0], [2, 3])]).process(LOGITS[:1])
    on_device = _batch([p], [_seq([0], [2])], pending=torch.tensor([3])).process(LOGITS[:1])
    torch.testing.assert_close(on_device, on_host)
    advanced = _batch([p], [_seq([0], [2])])
    advanced.advance(torch.tensor([3]))
    torch.testing.assert_close(advanced.process(LOGITS[:1]), on_host)


def test_min_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    out = _apply_min_p(logits.clone(), torch.tensor([0.25]))  # threshold 0.125: drops 0.12 and 0.08
    assert torch.isinf(out[0, 2:]).all() and torch.equal(out[0, :2], logits[0, :2])
    torch.testing.assert_close(_apply_min_p(logits.clone(), torch.tensor([0.0])), logits)


def test_min_p_is_applied_after_temperature_when_sampling():
    # probabilities 0.5 / 0.3 / 0.2 at temperature 1; at temperature 0.5 they become ~0.66/0.24/0.10,
    # so min_p=0.3 keeps tokens 0 and 1 only (0.2 >= 0.3 * 0.5 would have kept token 2 before it)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2])).repeat(400, 1)
    params = SamplingParams(temperature=0.5, min_p=0.3)
    batch = SamplingBatch.build([(params, None)] * 400, 3, CPU)
    tokens = Sampler(torch.Generator().manual_seed(0)).sample(logits, batch).tokens
    assert set(tokens.tolist()) == {0, 1}


def test_top_logprobs_and_ranks():
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0, logit_bias={3: 100})]
    logits = torch.cat([LOGITS, LOGITS[:1]])
    batch = _batch(params)
    assert batch.logprob_rows == (0, 2) and batch.logprob_ks == (2, 0)
    draws = Sampler(torch.Generator()).sample(logits, batch)
    reference = torch.log_softmax(logits, -1)
    top = draws.top
    assert top.ids[0].tolist() == [0, 4]  # the two most likely of row 0
    torch.testing.assert_close(top.logprobs[0], reference[0, [0, 4]])
    assert top.ranks.tolist() == [1, 6]  # row 2 drew token 3 (biased): the least likely of 6
    torch.testing.assert_close(top.token_logprobs, reference[[0, 2], [0, 3]])
