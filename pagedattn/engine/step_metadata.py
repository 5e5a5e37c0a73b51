"""A step's attention metadata over the model's KV cache groups: one build per group, one context.

Each group's builder has the group's window, so a windowed group's tables drop the blocks its
window left (the block manager freed them) and a full group's keep every block; the layers of a
group read its metadata (`forward_context(..., layer_metadata=)`). A model with one group builds
once, as the contract's `builder.build`, and its layers read the one metadata.

A cascade step (`engine/cascade.py`) also builds, for each full-attention group, the shared
prefix's metadata (`build_shared_prefix`), and that group's sequences over their tables without
the prefix blocks; the layers that can split (`Attention.prefix_impl`) read both, the others
(windowed groups' layers) their group's whole tables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
from torch import nn

from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.types import ScheduledSeq
from pagedattn.engine.kv_cache_groups import KVCacheGroups
from pagedattn.layer import Attention, ForwardContext, forward_context


class StepMetadata:
    """The step's metadata of every KV cache group (`groups[g]`) and the group each layer reads.

    A cascade step's `shared_prefix[g]` is group g's shared-prefix metadata (None for a windowed
    group), read by the layers whose `cascade_layers` entry is True; `groups[g]` then covers each
    sequence's suffix."""

    def __init__(self, groups: list[AttentionMetadata], layer_group: Sequence[int],
                 shared_prefix: list[AttentionMetadata | None] | None = None,
                 cascade_layers: Sequence[bool] = ()):
        self.groups = groups
        self.layer_group = layer_group  # by layer index: decoder layers, then cross layers (group 0)
        self.shared_prefix = shared_prefix
        self.cascade_layers = cascade_layers

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
        per_layer = shared = None
        if len(self.groups) > 1:
            per_layer = [self.groups[g] for g in self.layer_group]
        if self.shared_prefix is not None:
            shared = [self.shared_prefix[g] if split else None
                      for g, split in zip(self.layer_group, self.cascade_layers)]
        with forward_context(self.first, kv_caches, layer_metadata=per_layer, shared_prefix=shared) as ctx:
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
        self.block_size = block_size
        self.builders = [backend.get_builder_cls()(block_size, device, sliding_window=g.window)
                         for g in kv_groups.groups]
        self.layer_group = kv_groups.layer_group + (0,) * (num_layers - kv_groups.num_layers)
        self.cascade_layers: tuple[bool, ...] = (False,) * num_layers  # by layer index: splits a shared prefix

    def set_layers(self, model: nn.Module) -> None:
        """Give each group's builder the impls of its layers (`MetadataBuilder.set_layers`), and
        note which layers attend a shared prefix apart (those with a `prefix_impl`)."""
        for builder, impls in zip(self.builders, group_impls(model, self.layer_group, len(self.builders))):
            builder.set_layers(impls)
        split = list(self.cascade_layers)
        for m in model.modules():
            if isinstance(m, Attention):
                split[m.layer_idx] = m.prefix_impl is not None
        self.cascade_layers = tuple(split)

    def build(self, seqs_of_group: Sequence[Sequence[ScheduledSeq]] | Sequence[ScheduledSeq], *,
              cuda_graph_pad_to: int | None = None, shared_prefix_blocks: int = 0) -> StepMetadata:
        """The step's metadata: `seqs_of_group[g]` are the step's sequences over group `g`'s block
        tables; one list of `ScheduledSeq` serves every group (dummy steps: any tables will do).
        `shared_prefix_blocks`: a cascade step's shared prefix (`CascadePolicy.prefix_blocks`),
        the first blocks of every sequence's table in each full-attention group."""
        if not seqs_of_group or isinstance(seqs_of_group[0], ScheduledSeq):
            seqs_of_group = [seqs_of_group] * len(self.builders)
        pad = cuda_graph_pad_to
        if not shared_prefix_blocks:
            return StepMetadata([b.build(seqs, cuda_graph_pad_to=pad) for b, seqs in zip(self.builders, seqs_of_group)],
                                self.layer_group)
        n, shift = shared_prefix_blocks, shared_prefix_blocks * self.block_size
        groups, prefixes = [], []
        for builder, seqs in zip(self.builders, seqs_of_group):
            if builder.sliding_window is not None:
                groups.append(builder.build(seqs, cuda_graph_pad_to=pad))
                prefixes.append(None)
                continue
            # a cascade graph's padding rows query the prefix too (their outputs are dropped)
            num_queries = pad if pad is not None else sum(s.query_len for s in seqs)
            prefixes.append(builder.build_shared_prefix(num_queries, seqs[0].block_table[:n]))
            groups.append(builder.build([replace(s, seq_len=s.seq_len - shift, block_table=s.block_table[n:])
                                         for s in seqs], cuda_graph_pad_to=pad))
        return StepMetadata(groups, self.layer_group, prefixes, self.cascade_layers)


def group_impls(model: nn.Module, layer_group: Sequence[int], num_groups: int) -> list[list]:
    """The attention impls of each group's layers (`pagedattn.Attention.layer_idx` -> group), a
    layer's shared-prefix impl (`prefix_impl`) after its own: backends that plan ahead plan both."""
    impls: list[list] = [[] for _ in range(num_groups)]
    for m in model.modules():
        if isinstance(m, Attention):
            impls[layer_group[m.layer_idx]] += [m.impl] if m.prefix_impl is None else [m.impl, m.prefix_impl]
    return impls
