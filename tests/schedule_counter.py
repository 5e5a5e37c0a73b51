"""Counting what an engine's scheduler does, step by step (encoder-decoder engine tests)."""


def count_schedule(engine) -> dict[str, int]:
    """Wrap `engine.scheduler.schedule` to count preemptions, cross swaps and encoder positions
    run, and to check each step's token budget. Returns the live counts dict."""
    counts = {"preempted": 0, "cross_swap_out": 0, "cross_swap_in": 0, "encoder_tokens": 0}
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        counts["preempted"] += len(out.preempted)
        counts["cross_swap_out"] += len(out.cross_swap_out)
        counts["cross_swap_in"] += len(out.cross_swap_in)
        counts["encoder_tokens"] += sum(c.num_encoder_tokens for c in out.chunks)
        assert out.num_batched_tokens <= engine.runner.max_num_batched_tokens
        return out

    engine.scheduler.schedule = counting
    return counts
