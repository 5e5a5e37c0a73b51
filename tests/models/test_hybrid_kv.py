"""Models of windowed and full layers in the engine's KV cache groups: greedy tokens equal
transformers' with chunked prefill, prefix-cache hits and a pool too small for whole tables,
while each windowed group holds only the blocks its window reaches."""

from __future__ import annotations

import pytest
import torch

import pagedattn
from pagedattn.engine.block_manager import SLIDING_FREED
from pagedattn.engine.config import EngineConfig
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.engine.sequence import Sequence
from pagedattn.models import load_model

from .conftest import skip_unless_runs
from .test_generate_families import _hf_greedy

MAX_TOKENS = 16
WINDOW, BLOCK = 8, 4  # the tiny configs' window; blocks of 4 so windows span few of them


def _engine(ckpt, backend_name, device, **kwargs) -> LLMEngine:
    skip_unless_runs(ckpt.name, backend_name)
    loaded = load_model(ckpt.folder, dtype=torch.float32, device=device, attention_backend=backend_name)
    config = EngineConfig(device=str(device), backend=backend_name, block_size=BLOCK, enforce_eager=True, **kwargs)
    return LLMEngine(config, loaded, check_integrity=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    first, second = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 37))
    return [first, second, first[:32] + [7, 8, 9, 10, 11, 12]]  # the third shares 8 blocks with the first


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_greedy_equals_transformers_over_kv_cache_groups(tiny_checkpoint, backend_name, device, family):
    """Chunked prefill (16-token steps), a prefix-cache hit whose windowed groups take only the
    blocks in their window, and a pool smaller than the sequences' whole tables in every group."""
    ckpt = tiny_checkpoint(family)
    engine = _engine(ckpt, backend_name, device, num_kv_blocks=48, max_num_batched_tokens=16, max_num_seqs=2)
    assert len(engine.runner.kv_groups.groups) > 1
    params = pagedattn.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    first = engine.generate(prompts[:1], [params])
    hits = engine.block_manager.prefix_hits(Sequence(-1, prompts[2], BLOCK))
    assert len(hits) == 8  # the 32 tokens shared with the first prompt
    assert any(SLIDING_FREED in row for row in hits) and not any(SLIDING_FREED == row[0] for row in hits)
    rest = engine.generate(prompts[1:], [params] * 2)
    with torch.no_grad():
        expected = [_hf_greedy(ckpt.reference, p, MAX_TOKENS) for p in prompts]
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert sum(o.metrics.num_preemptions for o in rest) == 0  # 2 x 56 tokens of 2-3 layers in 48 blocks


def test_windowed_groups_hold_their_window_and_the_full_group_everything(tiny_checkpoint, backend_name, device):
    """Gemma 3 (two local layers, one global): three groups of one layer; past the prompt, each
    local group holds the blocks of its last WINDOW positions and the global group every block."""
    engine = _engine(tiny_checkpoint("gemma3"), backend_name, device, num_kv_blocks=64)
    assert engine.runner.kv_groups.windows == (None, WINDOW, WINDOW)
    assert engine.runner.kv_groups.num_tensors == 1  # a block is one layer's K/V
    group = engine.add_request(_prompts()[0], pagedattn.SamplingParams(temperature=0.0, max_tokens=10))
    seq = group.seqs[0]
    while engine.has_unfinished():
        engine.step()
        if seq.is_finished:
            break
        full, *local = seq.block_tables
        n = seq.num_computed_tokens
        assert len(full) * BLOCK >= n and SLIDING_FREED not in full
        for table in local:
            held = [b for b in table if b != SLIDING_FREED]
            assert len(held) <= WINDOW // BLOCK + 2  # the window's blocks and the next token's
        used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
        assert used == len(full) + sum(b != SLIDING_FREED for t in local for b in t)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("mode", [
    dict(num_scheduler_steps=4),  # multi-step: every group's metadata advances on the device
    dict(async_scheduling=True),  # the next decode step planned before this one's tokens are read
    # admitted a chunk at a time, three outgrow 30 blocks: one is preempted and recomputed, or
    # swapped out and back (every group's blocks)
    dict(num_kv_blocks=30, max_num_batched_tokens=16, preemption_mode="recompute"),
    dict(num_kv_blocks=30, max_num_batched_tokens=16, preemption_mode="swap"),
], ids=["multi_step", "async", "recompute", "swap"])
def test_engine_modes_over_kv_cache_groups(tiny_checkpoint, backend_name, device, mode):
    ckpt = tiny_checkpoint("gemma2")
    engine = _engine(ckpt, backend_name, device, **{"num_kv_blocks": 64, "max_num_seqs": 3, **mode})
    params = pagedattn.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    outs = engine.generate(prompts, [params] * 3)
    with torch.no_grad():
        expected = [_hf_greedy(ckpt.reference, p, MAX_TOKENS) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "preemption_mode" in mode:
        assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_cascade_over_kv_cache_groups_equals_transformers(tiny_checkpoint, backend_name, device):
    """gpt-oss's requests over one cached prefix: its full group's layers attend it once per step
    (their sinks join the suffix part only), its windowed group's layers attend whole."""
    ckpt = tiny_checkpoint("gpt_oss")
    engine = _engine(ckpt, backend_name, device, num_kv_blocks=96, cascade_attention=True,
                     cascade_min_prefix_tokens=16, cascade_min_seqs=4)
    gen = torch.Generator().manual_seed(6)
    prefix = torch.randint(0, 256, (26,), generator=gen).tolist()  # 6 whole blocks of 4
    prompts = [prefix + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 3, 6, 2, 5)]
    params = pagedattn.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.generate([prefix], [pagedattn.SamplingParams(temperature=0.0, max_tokens=1)])
    cascaded = []
    build = engine.runner.builder.build
    engine.runner.builder.build = lambda seqs, **kw: (cascaded.append(kw.get("shared_prefix_blocks")),
                                                      build(seqs, **kw))[1]
    outs = engine.generate(prompts, [params] * len(prompts))
    with torch.no_grad():
        expected = [_hf_greedy(ckpt.reference, p, 6) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert cascaded and all(n == 6 for n in cascaded), cascaded  # every step: the prefill and the decodes
