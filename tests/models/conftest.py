"""Fixtures for the model tests: tiny random Hugging Face checkpoints and a paged step runner.

A checkpoint is built with transformers' own config and model classes, saved as safetensors
with a byte-level tokenizer, and kept in memory as the reference (transformers' eager attention
never reads our paged cache). The runner drives our model through `forward_context` over a pool
of shuffled physical blocks, one `builder.build` per step, as the engine does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from tiny_models import TINY_CONFIG, VOCAB, byte_tokenizer

from pagedattn.engine.kv_cache_groups import KVCacheGroups

TINY = TINY_CONFIG

# name -> (transformers config class name, config overrides)
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3_rope": ("LlamaConfig", dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16),
    )),
    "mistral": ("MistralConfig", dict(sliding_window=8, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen2_sliding": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                           tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # GGUF stores no query_pre_attn_scalar: llama.cpp uses head_dim (see the loader).
    "gemma2_gguf": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # head_dim 32: the head size is the config's, not hidden / heads
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    # two local layers per global one; the global RoPE has its own base and a linear scaling
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=4.0)},
    )),
    # YaRN over an original context of 32 positions, so prompts of 40 reach its scaled part
    "gpt_oss": ("GptOssConfig", dict(
        head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=32),
    )),
}


SINKS = {"gpt_oss"}
"""Families whose attention has sinks: only backends with `Capabilities.sinks` run them."""


def skip_unless_runs(family: str, backend_name: str) -> None:
    """Skip a test of `family` on a backend that refuses its attention options at construction."""
    import pagedattn

    if family in SINKS and not pagedattn.get_backend(backend_name).capabilities.sinks:
        pytest.skip(f"backend {backend_name!r} has no attention sinks, which {family} needs")


@torch.no_grad()
def _randomise(model, norm_base: float) -> None:
    # transformers initialises norms to constants and biases to zero; random values make the
    # test see a mis-loaded or mis-ordered weight.
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(norm_base + 0.1 * noise if "norm" in name else 0.15 * noise)


@dataclass
class TinyCheckpoint:
    name: str
    folder: str
    reference: torch.nn.Module  # transformers' model on the same weights, float32, eager attention


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family) -> TinyCheckpoint, built once per family per session."""
    import transformers

    built: dict[str, TinyCheckpoint] = {}

    def make(name: str) -> TinyCheckpoint:
        if name not in built:
            cls_name, overrides = FAMILIES[name]
            config = getattr(transformers, cls_name)(**(TINY | overrides))
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="eager", dtype=torch.float32
            )
            _randomise(model, norm_base=0.0 if name.startswith("gemma") else 1.0)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder, safe_serialization=True)
            byte_tokenizer().save_pretrained(folder)
            built[name] = TinyCheckpoint(name, str(folder), model.eval())
        return built[name]

    return make


@dataclass
class PagedRunner:
    """Runs steps of a loaded model over a paged KV cache of shuffled physical blocks."""

    loaded: object  # pagedattn.models.LoadedModel
    backend: type
    device: torch.device
    block_size: int = 4
    num_blocks: int = 96
    free: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.model = self.loaded.model  # tests may swap in a compiled module
        spec = self.loaded.spec
        # One builder for every layer: it trims the tables only where every layer has one window.
        groups = KVCacheGroups.of(spec.sliding_windows).groups
        self.builder = self.backend.get_builder_cls()(
            self.block_size, self.device, sliding_window=groups[0].window if len(groups) == 1 else None
        )
        shape = self.backend.get_kv_cache_shape(self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)
        self.kv_caches = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        self.free = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(3)).tolist()

    def block_table(self, max_len: int) -> list[int]:
        n = math.ceil(max_len / self.block_size)
        table, self.free = self.free[:n], self.free[n:]
        return table

    def step(self, parts: list[tuple[list[int], int, int, list[int]]]) -> torch.Tensor:
        """parts: (token ids of the whole sequence, context_len, query_len, block table), prefills first.

        Returns logits float32 [T, vocab] of every query token of the step, in order.
        """
        import pagedattn

        ids, positions, seqs = [], [], []
        for tokens, context_len, query_len, table in parts:
            seq_len = context_len + query_len
            ids += tokens[context_len:seq_len]
            positions += range(context_len, seq_len)
            seqs.append(pagedattn.ScheduledSeq(seq_len=seq_len, query_len=query_len, block_table=table))
        md = self.builder.build(seqs)
        model = self.model
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with torch.inference_mode(), pagedattn.forward_context(md, self.kv_caches):
            hidden = model(input_ids, pos)  # [T, hidden]
            return model.compute_logits(hidden)


@pytest.fixture
def paged_runner(backend, device):
    """paged_runner(loaded, **kw) -> PagedRunner on the session's --backend and --device."""
    return lambda loaded, **kw: PagedRunner(loaded, backend, device, **kw)
