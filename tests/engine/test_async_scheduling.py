"""Async scheduling: a decode step is planned and queued before the previous step's draws are
read, its input tokens carried on the device. Whatever a request does meanwhile (stops on EOS or
a stop string, reaches max_tokens, is aborted, forks, samples with a seed), the engine's tokens,
outputs and pool equal those of the same engine stepping synchronously."""

from __future__ import annotations

import pytest

from pagedattn.engine.sampling_params import SamplingParams

from .conftest import random_prompts


def _count_carried(engine) -> list[int]:
    """[launches, launches that carried their input tokens from the step before]."""
    counts = [0, 0]
    launch = engine.runner.launch

    def counting(out, after=None):
        counts[0] += 1
        counts[1] += after is not None
        return launch(out, after)

    engine.runner.launch = counting
    return counts


def _run(engine, prompts, params) -> list[tuple]:
    outs = engine.generate(prompts, params)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [(o.request_id, [(c.token_ids, c.text, c.finish_reason, round(c.cumulative_logprob, 4))
                            for c in o.outputs]) for o in outs]


def _both(make, prompts, params, **config):
    """(sync results, async results, async launch counts) of one workload."""
    sync = _run(make(async_scheduling=False, **config), prompts, params)
    engine = make(async_scheduling=True, **config)
    counts = _count_carried(engine)
    return sync, _run(engine, prompts, params), counts


def test_decodes_carry_their_tokens_and_equal_the_synchronous_engine(make_engine):
    prompts = random_prompts((5, 16, 17, 33, 40), seed=1)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 24, 13)]
    sync, asynchronous, (launches, carried) = _both(make_engine, prompts, params)
    assert asynchronous == sync
    assert carried >= 20 and carried > launches / 2  # the steady decodes were launched ahead


def test_eos_stop_strings_and_seeds(request, make_engine):
    """A sequence that stops on EOS or a stop string after its next step was queued: that
    step's row for it is dropped; seeded samples draw from their own streams either way."""
    make = lambda **kw: make_engine(request.getfixturevalue("loaded_eos"), **kw)  # noqa: E731
    prompts = [list(range(40, 50)), *random_prompts((9, 21, 30), seed=4)]
    params = [SamplingParams(temperature=0, max_tokens=20),  # ends on the model's EOS
              SamplingParams(temperature=0, max_tokens=20, stop=["a", "e", "o"], ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=5, n=2, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=6, max_tokens=18)]
    sync, asynchronous, (_, carried) = _both(make, prompts, params)
    assert asynchronous == sync and carried > 0
    assert sync[0][1][0][2] == "stop" and len(sync[0][1][0][0]) < 20  # the EOS path was taken


@pytest.mark.parametrize("config", [dict(num_kv_blocks=6, block_size=8),
                                    dict(max_num_seqs=2, max_num_batched_tokens=16)],
                         ids=["tiny_pool", "small_batches"])
def test_tight_pools_and_budgets(make_engine, config):
    """When the next step's slots would not fit, or requests wait, nothing is launched ahead;
    preemptions and admissions happen as in the synchronous engine."""
    prompts = random_prompts((12, 20, 7, 26), seed=2)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 4
    sync, asynchronous, _ = _both(make_engine, prompts, params, **config)
    assert asynchronous == sync


def test_an_abort_between_steps_is_not_reported_again(make_engine):
    prompts = random_prompts((8, 14, 19), seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = make_engine(async_scheduling=True)
    counts = _count_carried(engine)
    groups = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    assert counts[1] > 0
    assert engine.abort_request(groups[1].request_id)
    reported = []
    while engine.has_unfinished():
        reported += [o.request_id for o in engine.step()]
    assert groups[1].request_id not in reported
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    reference = make_engine(async_scheduling=False).generate([prompts[0], prompts[2]], [params] * 2)
    assert [g.seqs[0].output_token_ids for g in (groups[0], groups[2])] == [o.outputs[0].token_ids for o in reference]


def test_async_scheduling_is_checked(make_engine):
    with pytest.raises(ValueError, match="async_scheduling"):
        make_engine(async_scheduling="yes")
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        make_engine(async_scheduling=True, num_scheduler_steps=4)
