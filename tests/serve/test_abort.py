"""`LLMEngine.abort_request`: a request dropped while waiting, running or swapped out frees its
blocks at once and is never reported again; the others go on unchanged."""

from __future__ import annotations

from pagedattn.engine.config import EngineConfig
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.engine.sampling_params import SamplingParams

PROMPTS = [list(range(10, 40)), list(range(50, 70)), list(range(100, 125))]


def _engine(loaded, device, **kwargs) -> LLMEngine:
    config = dict(device=str(device), backend="torch", num_kv_blocks=16, block_size=4) | kwargs
    return LLMEngine(EngineConfig(**config), loaded, check_integrity=True)


def _run(engine: LLMEngine, abort_after: dict[int, str]) -> dict[str, list[int]]:
    """Step to the end, aborting request abort_after[k] before step k; finished tokens by id."""
    done, k = {}, 0
    while engine.has_unfinished():
        if k in abort_after:
            assert engine.abort_request(abort_after[k])
            assert not engine.abort_request(abort_after[k])  # already gone
            engine.block_manager.check_integrity(engine.scheduler.all_seqs())
        for out in engine.step():
            assert out.request_id not in done
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        k += 1
        assert k < 500
    return done


def test_abort_waiting_running_and_finished(loaded, device):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = {str(i): _run_one(loaded, device, p, params) for i, p in enumerate(PROMPTS)}
    engine = _engine(loaded, device, max_num_seqs=2)  # the third request waits
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, str(i))
    done = _run(engine, {0: "2", 3: "0"})  # "2" while waiting, "0" while running
    assert done == {"1": alone["1"]}
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.abort_request("1")  # finished requests are not aborted


def test_abort_swapped_group(loaded, device):
    """n=2 groups are swapped out under pressure; aborting one frees its CPU blocks."""
    params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=20, ignore_eos=True)
    engine = _engine(loaded, device, num_kv_blocks=24, swap_space_gib=0.01)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, str(i))
    swapped = None
    for _ in range(200):
        engine.step()
        if engine.scheduler.swapped:
            swapped = engine.scheduler.swapped[0].request_id
            break
    assert swapped is not None, "expected a swap-out under this pool"
    assert engine.abort_request(swapped)
    engine.block_manager.check_integrity(engine.scheduler.all_seqs())
    done = _run(engine, {})
    assert swapped not in done and len(done) == 2
    assert engine.block_manager.num_free_cpu_blocks == engine.block_manager.cpu.num_blocks


def _run_one(loaded, device, prompt, params) -> list[int]:
    [out] = _engine(loaded, device).generate([prompt], [params])
    return out.outputs[0].token_ids
