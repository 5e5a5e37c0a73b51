"""A step's attention metadata over the model's KV cache groups: one build per group, one context.

Each group's builder has the group's window, so a windowed group's tables drop the blocks its
window left (the block manager freed them) and a full group's keep every block; the layers of a
group read its metadata (`forward_context(..., layer_metadata=)`). A model with one group builds
once, as the contract's `builder.build`, and its layers read the one metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.types import ScheduledSeq
from pagedattn.engine.kv_cache_groups import KVCacheGroups
from pagedattn.layer import Attention, ForwardContext, forward_context


class StepMetadata:
    """The step's metadata of every KV cache group (`groups[g]`) and the group each layer reads."""

    def __init__(self, groups: list[AttentionMetadata], layer_group: Sequence[int]):
        self.groups = groups
        self.layer_group = layer_group  # by layer index: decoder layers, then cross layers (group 0)

    @property
    def first(self) -> AttentionMetadata:
        """Group 0's metadata: the step's counts (prefills, tokens, sequences) as every group's."""
        return self.groups[0]

    @property
    def num_seqs(self) -> int:
        return self.first.num_seqs

    @property
    def max_decode_seq_len(self) -> int:
        """The longest decode's length in any group (a windowed group's count from its first kept block)."""
        return max(md.max_decode_seq_len for md in self.groups)

    @contextlib.contextmanager
    def context(self, kv_caches: Sequence[torch.Tensor]) -> Iterator[ForwardContext]:
        """`forward_context` over `kv_caches` (one per layer index), each layer reading its group's metadata."""
        per_layer = None
        if len(self.groups) > 1:
            per_layer = [self.groups[g] for g in self.layer_group]
        with forward_context(self.first, kv_caches, layer_metadata=per_layer) as ctx:
            yield ctx

    def advance_step(self, input_tokens: torch.Tensor, input_positions: torch.Tensor, sampled_token_ids: torch.Tensor,
                     block_size: int, num_seqs: int, num_queries: int) -> None:
        """`AttentionMetadata.advance_step` of every group; the tokens and positions advance once."""
        scratch = (input_tokens.clone(), input_positions.clone()) if len(self.groups) > 1 else None
        self.first.advance_step(input_tokens, input_positions, sampled_token_ids, block_size, num_seqs, num_queries)
        for md in self.groups[1:]:  # they write the same tokens and positions: into the scratch copies
            md.advance_step(*scratch, sampled_token_ids, block_size, num_seqs, num_queries)


class GroupedMetadataBuilder:
    """A metadata builder per KV cache group of `kv_groups`, each with its group's window."""

    def __init__(self, backend, block_size: int, device: torch.device, kv_groups: KVCacheGroups, num_layers: int):
        """num_layers: the model's attention layers (decoder layers, then cross layers, which read group 0)."""
        self.kv_groups = kv_groups
        self.builders = [backend.get_builder_cls()(block_size, device, sliding_window=g.window)
                         for g in kv_groups.groups]
        self.layer_group = kv_groups.layer_group + (0,) * (num_layers - kv_groups.num_layers)

    def set_layers(self, model: nn.Module) -> None:
        """Give each group's builder the impls of its layers (`MetadataBuilder.set_layers`)."""
        for builder, impls in zip(self.builders, group_impls(model, self.layer_group, len(self.builders))):
            builder.set_layers(impls)

    def build(self, seqs_of_group: Sequence[Sequence[ScheduledSeq]] | Sequence[ScheduledSeq], *,
              cuda_graph_pad_to: int | None = None) -> StepMetadata:
        """The step's metadata: `seqs_of_group[g]` are the step's sequences over group `g`'s block
        tables; one list of `ScheduledSeq` serves every group (dummy steps: any tables will do)."""
        if not seqs_of_group or isinstance(seqs_of_group[0], ScheduledSeq):
            seqs_of_group = [seqs_of_group] * len(self.builders)
        return StepMetadata([b.build(seqs, cuda_graph_pad_to=cuda_graph_pad_to)
                             for b, seqs in zip(self.builders, seqs_of_group)], self.layer_group)


def group_impls(model: nn.Module, layer_group: Sequence[int], num_groups: int) -> list[list]:
    """The attention impls of each group's layers (`pagedattn.Attention.layer_idx` -> group)."""
    impls: list[list] = [[] for _ in range(num_groups)]
    for m in model.modules():
        if isinstance(m, Attention):
            impls[layer_group[m.layer_idx]].append(m.impl)
    return impls
