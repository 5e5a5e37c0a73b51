"""Cascade attention in the engine: requests over one cached prefix attend it once per step, with
the greedy tokens of transformers' `generate` (or, for an FP8 cache, of the engine without
cascade); the policy's rules (thresholds, the cap before every query, windowed groups) and
`common_prefix_blocks`."""

from __future__ import annotations

import pytest
import torch

from pagedattn.attention.types import ScheduledSeq
from pagedattn.engine.cascade import CascadePolicy, common_prefix_blocks, common_run, prefix_cap
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.sampling_params import SamplingParams

from .conftest import hf_generate, random_prompts

BS = 8
PREFIX = random_prompts((43,), seed=7)[0]  # 5 whole blocks of 8 (and 3 tokens more)
SUFFIXES = random_prompts((2, 5, 9, 1, 12, 3, 7, 4), seed=8)
LATE = random_prompts((6, 10), seed=9)  # arrive while the others decode: prefill chunks beside decodes
MAX_TOKENS = 10
CASCADE = dict(block_size=BS, num_kv_blocks=160, cascade_attention=True, cascade_min_prefix_tokens=16,
               cascade_min_seqs=4, max_num_seqs=16)


def _run(engine) -> tuple[list[list[int]], list[tuple[int, bool, bool]]]:
    """The prefix alone first (its blocks cached), then SUFFIXES' requests at once and LATE's
    two steps later; (greedy tokens per request, (shared blocks, any prefill, any decode) per step)."""
    steps = []
    build = engine.runner.builder.build

    def recording(seqs_of_group, **kwargs):
        seqs = seqs_of_group[0] if not isinstance(seqs_of_group[0], ScheduledSeq) else seqs_of_group
        steps.append((kwargs.get("shared_prefix_blocks", 0), any(s.is_prefill for s in seqs),
                      not all(s.is_prefill for s in seqs)))
        return build(seqs_of_group, **kwargs)

    engine.runner.builder.build = recording
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.generate([PREFIX], [SamplingParams(temperature=0, max_tokens=1)])
    groups = [engine.add_request(PREFIX + s, params) for s in SUFFIXES]
    outputs = {}
    for i in range(100):
        if i == 2:
            groups += [engine.add_request(PREFIX + s, params) for s in LATE]
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished():
            break
    return [outputs[g.request_id] for g in groups], steps


@pytest.fixture(scope="module")
def greedy_refs(tiny):
    return [hf_generate(tiny.reference, PREFIX + s, MAX_TOKENS) for s in SUFFIXES + LATE]


@pytest.mark.parametrize("config", [{}, dict(async_scheduling=True), dict(num_scheduler_steps=3)],
                         ids=["sync", "async", "multi_step"])
def test_greedy_with_cascade_equals_transformers(make_engine, greedy_refs, config):
    engine = make_engine(**CASCADE, **config)
    tokens, steps = _run(engine)
    assert tokens == greedy_refs
    cascaded = {(prefill, decode) for blocks, prefill, decode in steps if blocks}
    assert {(True, False), (True, True)} <= cascaded, steps  # prefills, mixed steps
    graphs = engine.runner.graphs
    if graphs is None or graphs.has_cascade:  # decodes: eager, or cascade graphs (CUDA)
        assert (False, True) in cascaded, steps
    assert all(blocks in (0, 5) for blocks, _, _ in steps)  # the prefix's whole blocks, never beyond
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_fp8_cache_with_cascade_equals_without(tiny, device, backend_name, make_engine):
    """Both parts read the cache with the layer's scales (calibrated on the prefix's prefill).
    The reference backend only: others may read a step's new K/V from the inputs rather than the
    quantised cache (API.md), which moves near ties between the two paths."""
    from pagedattn.models.loader import load_model

    if backend_name != "torch":
        pytest.skip("FP8 token equality is checked on the reference backend (see the docstring)")

    def fp8_engine(**knobs):
        loaded = load_model(tiny.folder, dtype=torch.float32, device=device, attention_backend=backend_name,
                            kv_cache_dtype="fp8_e5m2")
        return make_engine(loaded, **{**CASCADE, **knobs}, kv_cache_dtype="fp8_e5m2")

    on, steps = _run(fp8_engine())
    off, plain = _run(fp8_engine(cascade_attention=False))
    assert on == off
    assert any(blocks for blocks, _, _ in steps) and not any(blocks for blocks, _, _ in plain)


def test_thresholds_keep_small_steps_whole(make_engine):
    """Fewer sequences than cascade_min_seqs, or a shorter prefix than cascade_min_prefix_tokens:
    every step attends whole."""
    for knobs in (dict(cascade_min_seqs=11), dict(cascade_min_prefix_tokens=41)):
        _, steps = _run(make_engine(**{**CASCADE, **knobs}))
        assert not any(blocks for blocks, _, _ in steps)


def _seq(context_len: int, query_len: int, table) -> ScheduledSeq:
    return ScheduledSeq(context_len + query_len, query_len, table)


def test_common_prefix_blocks():
    a, b = [4, 9, 2, 7, 1], [4, 9, 2, 3, 5]
    # the run both tables share: blocks 4, 9, 2
    assert common_prefix_blocks([_seq(40, 1, a), _seq(39, 1, b)], BS) == 3
    # capped so every query lies after it; a decode keeps a key of its own
    assert common_prefix_blocks([_seq(17, 1, a), _seq(30, 1, b)], BS) == 2
    assert common_prefix_blocks([_seq(16, 1, a), _seq(30, 1, b)], BS) == 1
    assert common_prefix_blocks([_seq(16, 4, a), _seq(30, 1, b)], BS) == 2  # a prefill chunk may start right after
    assert common_prefix_blocks([_seq(0, 8, a), _seq(30, 1, b)], BS) == 0  # a fresh prompt shares nothing cached
    assert common_prefix_blocks([_seq(40, 1, a)], BS) == 4  # one sequence: its own blocks, up to the cap
    assert common_prefix_blocks([_seq(40, 1, a), _seq(40, 1, [5, 9, 2, 7])], BS) == 0  # first blocks differ
    assert common_prefix_blocks([], BS) == 0
    assert prefix_cap([_seq(33, 1, a), _seq(8, 9, b)], BS) == 1
    assert common_run([[1, 2, 3], [1, 2], [1, 2, 3, 4]], 5) == 2


def test_policy_rules():
    full, windowed = [4, 9, 2, 7, 1], [8, 6, 2, 3, 5]
    seqs = [_seq(40, 1, full)] * 8
    policy = CascadePolicy(min_prefix_tokens=32, min_seqs=8)
    assert policy.prefix_blocks(seqs, [], (None,), BS) == 4
    assert policy.prefix_blocks(seqs[:7], [], (None,), BS) == 0  # too few sequences
    assert CascadePolicy(min_prefix_tokens=33, min_seqs=8).prefix_blocks(seqs, [], (None,), BS) == 0  # too short
    assert CascadePolicy(enabled=False).prefix_blocks(seqs, [], (None,), BS) == 0
    assert CascadePolicy(refusal="ALiBi").prefix_blocks(seqs, [], (None,), BS) == 0
    # a windowed group's tables differ (its early blocks freed): it attends whole, the full group splits
    assert policy.prefix_blocks(seqs, [(windowed,)] * 4 + [([0, 1, 2, 3, 4],)] * 4, (None, 16), BS) == 4
    # two full groups: the run both share
    second = [(full[:2] + [10 + i, 0, 0],) for i in range(8)]
    assert CascadePolicy(min_prefix_tokens=16, min_seqs=8).prefix_blocks(seqs, second, (None, None), BS) == 2
    assert policy.prefix_blocks(seqs, second, (None, None), BS) == 0  # 2 blocks < 32 tokens
    assert policy.prefix_blocks([_seq(40, 1, windowed)] * 8, [], (16,), BS) == 0  # no full group


def test_config_checks():
    with pytest.raises(ValueError, match="cascade_attention to be None or a bool"):
        EngineConfig(cascade_attention="yes")
    # None: on CUDA only (on the CPU the torch backend computes as many scores either way)
    assert EngineConfig().resolved_cascade_attention(torch.device("cuda"))
    assert not EngineConfig().resolved_cascade_attention(torch.device("cpu"))
    assert EngineConfig(cascade_attention=True).resolved_cascade_attention(torch.device("cpu"))
    for name in ("cascade_min_prefix_tokens", "cascade_min_seqs"):
        with pytest.raises(ValueError, match=f"{name} to be an int >= 1"):
            EngineConfig(**{name: 0})
