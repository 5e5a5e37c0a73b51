"""transformers' continuous batching (`model.generate_batch`), called the same way on every
transformers version the `[hf]` extra allows: greedy, one output length, EOS never stops it.

Used by `pagedattn bench engine` (timed runs), by the transformers integration's tests and by
`scripts/hf_gpu_check.py` (tokens).
"""

from __future__ import annotations

import inspect
import logging
import re
import time

from pagedattn.benchmarks.engine_offline import Request, Run, sync


class TransformersRunner:
    """`model.generate_batch` on requests of one output length.

    Where generate_batch can keep its manager between calls (`persistent_manager`), the warm-up
    call sizes it and captures its CUDA graphs, and the timed calls reuse it, as our engine
    reuses its graphs; `close()` frees it before the next cell. On CUDA its graphs are asked
    for (`use_cuda_graph=True`): by default transformers turns them off for attention that needs
    a mask (sdpa, what runs where flash-attn is not installed).

    num_blocks, max_batch_tokens: the paged cache's size (None: transformers sizes it from free
    memory, which on the CPU is the host's). transformers 5.1-5.4 read them from the generation
    config, later versions from a `ContinuousBatchingConfig`.
    """

    def __init__(self, model, *, num_blocks: int | None = None, max_batch_tokens: int | None = None,
                 persistent: bool = True):
        self.model = model
        params = inspect.signature(model.generate_batch).parameters
        self.persistent = persistent and "persistent_manager" in params
        self.cb_config = "continuous_batching_config" in params
        self.cuda_graphs = model.device.type == "cuda" and self.cb_config
        self.progress_bar = "progress_bar" in params
        self.cache_size = {k: v for k, v in (("num_blocks", num_blocks), ("max_batch_tokens", max_batch_tokens))
                           if v is not None}
        # Its continuous batching warns on every call that keeps a manager; the bar says enough.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    @property
    def description(self) -> str:
        return f"generate_batch (persistent_manager={self.persistent}, use_cuda_graph={self.cuda_graphs})"

    @staticmethod
    def unavailable_reason(model) -> str | None:
        import transformers

        if not hasattr(model, "generate_batch"):
            return f"transformers {transformers.__version__} has no generate_batch (continuous batching)"
        return None

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy tokens of each prompt, in the prompts' order."""
        from transformers import GenerationConfig

        # eos_token_id -1: never stop early, as ignore_eos on our side
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        kwargs = {"persistent_manager": True} if self.persistent else {}
        if self.progress_bar:
            kwargs["progress_bar"] = False
        cb = dict(self.cache_size, **({"use_cuda_graph": True} if self.cuda_graphs else {}))
        if self.cb_config:
            from transformers import ContinuousBatchingConfig

            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb)
        else:
            for k, v in cb.items():
                setattr(config, k, v)
        outs = self.model.generate_batch(prompts, generation_config=config, **kwargs)
        if len(outs) != len(prompts):
            raise RuntimeError(f"expected {len(prompts)} results from generate_batch, got {len(outs)}")
        return [outs[rid].generated_tokens for rid in sorted(outs, key=_request_index)]

    def run(self, requests: list[Request]) -> Run:
        """Every request at once, timed until the last one finishes."""
        new = {r.max_tokens for r in requests}
        if len(new) != 1:
            raise ValueError(f"expected one output length (generate_batch takes one max_new_tokens), got {len(new)}")
        device = self.model.device
        sync(device)
        start = time.perf_counter()
        tokens = self.generate([r.prompt for r in requests], new.pop())
        sync(device)
        return Run(time.perf_counter() - start, sum(map(len, tokens)))

    def close(self) -> None:
        if self.persistent and hasattr(self.model, "destroy_cached_continuous_batching_manager"):
            self.model.destroy_cached_continuous_batching_manager()


def _request_index(request_id: str) -> int:
    """generate_batch names the i-th prompt's request `req_<i>`."""
    m = re.fullmatch(r"req_(\d+)", request_id)
    if m is None:
        raise RuntimeError(f"expected generate_batch request ids 'req_<i>', got {request_id!r}")
    return int(m.group(1))

