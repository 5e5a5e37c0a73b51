"""Each tensor-parallel layer equals its dense counterpart on random weights, at 2 ranks (gloo,
spawned processes) and at 1, loaded through `load_weights` from whole checkpoint tensors of
which each rank reads only its shard."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.models.layers import STACKED_PARAMS, load_weights, silu_and_mul
from pagedattn.parallel.group import TPGroup
from pagedattn.parallel.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Split,
                                       VocabParallelEmbedding, local_heads)

from .ranks import run_ranks

HEAD_SIZE, HIDDEN, INTERMEDIATE, VOCAB, TOKENS = 4, 16, 24, 37, 5  # an odd vocabulary: the last shard is padded


class _Block(nn.Module):
    def __init__(self, tp: TPGroup, heads: int, kv_heads: int, tied: bool) -> None:
        super().__init__()
        q = Split.heads(heads, HEAD_SIZE, tp, "heads")
        kv = Split.heads(kv_heads, HEAD_SIZE, tp, "kv heads", replicate=True)
        self.q_split = q
        self.qkv_proj = ColumnParallelLinear(HIDDEN, (q, kv, kv), bias=True)
        self.o_proj = RowParallelLinear(q, HIDDEN, bias=True, tp=tp)
        columns = Split.even(INTERMEDIATE, tp, "intermediate")
        self.gate_up_proj = ColumnParallelLinear(HIDDEN, (columns, columns), bias=False)
        self.down_proj = RowParallelLinear(columns, HIDDEN, bias=False, tp=tp)
        self.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
        self.lm_head = ParallelLMHead(HIDDEN, VOCAB, tp)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


class _Model(nn.Module):
    def __init__(self, tp: TPGroup, heads: int, kv_heads: int, tied: bool) -> None:
        super().__init__()
        self.blk = _Block(tp, heads, kv_heads, tied)


class _Counted:
    """A checkpoint tensor that counts the elements read from it (as a safetensors slice would)."""

    def __init__(self, tensor: torch.Tensor, reads: list[int]) -> None:
        self.tensor, self.reads, self.shape = tensor, reads, tensor.shape

    def __getitem__(self, index) -> torch.Tensor:
        out = self.tensor[index]
        self.reads.append(out.numel())
        return out


def _checkpoint(heads: int, kv_heads: int, tied: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    shapes = {
        "blk.q_proj.weight": (heads * HEAD_SIZE, HIDDEN), "blk.q_proj.bias": (heads * HEAD_SIZE,),
        "blk.k_proj.weight": (kv_heads * HEAD_SIZE, HIDDEN), "blk.k_proj.bias": (kv_heads * HEAD_SIZE,),
        "blk.v_proj.weight": (kv_heads * HEAD_SIZE, HIDDEN), "blk.v_proj.bias": (kv_heads * HEAD_SIZE,),
        "blk.o_proj.weight": (HIDDEN, heads * HEAD_SIZE), "blk.o_proj.bias": (HIDDEN,),
        "blk.gate_proj.weight": (INTERMEDIATE, HIDDEN), "blk.up_proj.weight": (INTERMEDIATE, HIDDEN),
        "blk.down_proj.weight": (HIDDEN, INTERMEDIATE), "blk.embed_tokens.weight": (VOCAB, HIDDEN),
    }
    if not tied:
        shapes["blk.lm_head.weight"] = (VOCAB, HIDDEN)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def check_layers(tp: TPGroup, heads: int, kv_heads: int, tied: bool) -> int:
    """Build the block on this rank, compare every layer with the dense math; returns the
    checkpoint elements this rank read."""
    w = _checkpoint(heads, kv_heads, tied)
    model = _Model(tp, heads, kv_heads, tied).requires_grad_(False)  # as the loader builds models
    reads: list[int] = []
    load_weights(model, ((n, _Counted(t, reads)) for n, t in w.items()), STACKED_PARAMS)
    blk = model.blk
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))

    # q/k/v: this rank's heads of the dense projections (a replicated KV head on every rank holding it)
    q, k, v = blk.qkv_proj(x).split(blk.qkv_proj.output_sizes, dim=-1)
    kv = blk.qkv_proj.splits[1]
    for name, local, split in (("q", q, blk.q_split), ("k", k, kv), ("v", v, kv)):
        dense = F.linear(x, w[f"blk.{name}_proj.weight"], w[f"blk.{name}_proj.bias"])
        torch.testing.assert_close(local, dense[:, split.start : split.start + split.length])

    # o_proj: this rank's heads' columns in, the whole output out (all-reduced, bias once)
    attn = torch.randn(TOKENS, heads * HEAD_SIZE, generator=torch.Generator().manual_seed(8))
    local_attn = attn[:, blk.q_split.start : blk.q_split.start + blk.q_split.length]
    torch.testing.assert_close(blk.o_proj(local_attn), F.linear(attn, w["blk.o_proj.weight"], w["blk.o_proj.bias"]))

    # the MLP end to end: gate/up split by columns, down row-parallel
    dense_mlp = F.linear(F.silu(F.linear(x, w["blk.gate_proj.weight"])) * F.linear(x, w["blk.up_proj.weight"]),
                         w["blk.down_proj.weight"])
    torch.testing.assert_close(blk.down_proj(silu_and_mul(blk.gate_up_proj(x))), dense_mlp)

    # embedding and head over every id, the padded last shard included
    ids = torch.tensor([0, 1, VOCAB // 2, VOCAB - 2, VOCAB - 1])
    torch.testing.assert_close(blk.embed_tokens(ids), w["blk.embed_tokens.weight"][ids])
    head = w["blk.embed_tokens.weight" if tied else "blk.lm_head.weight"]
    logits = blk.lm_head(x)
    assert logits.shape == (TOKENS, VOCAB)
    torch.testing.assert_close(logits, F.linear(x, head))
    return sum(reads)


def _expected_reads(rank: int, size: int, heads: int, kv_heads: int, tied: bool) -> int:
    """Elements rank `rank` of `size` should read: its shard of every split tensor (the
    row-parallel bias: rank 0 only), the rest whole."""
    model = _Model(TPGroup(rank, size), heads, kv_heads, tied)
    total = 0
    for name, t in _checkpoint(heads, kv_heads, tied).items():
        parent, module, leaf = name.rsplit(".", 2)
        dst, index = STACKED_PARAMS.get(module, (module, None))
        shard = model.get_submodule(f"{parent}.{dst}").checkpoint_shard(leaf, index)
        total += t.numel() // t.shape[shard.dim] * shard.length
    return total


HEADS = [(4, 1), (4, 2), (4, 4), (8, 2)]  # (query heads, KV heads): replicated, one each, two each


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("heads", HEADS, ids=[f"{h}q{k}kv" for h, k in HEADS])
def test_one_rank_equals_dense(heads, tied):
    read = check_layers(TPGroup(), *heads, tied)
    assert read == sum(t.numel() for t in _checkpoint(*heads, tied).values())


def test_two_ranks_equal_dense_and_read_only_their_shards():
    """Every head layout at 2 ranks, and the group's own collectives, in one pair of processes
    (spawning one costs seconds)."""
    results = run_ranks(check_all, HEADS)
    expected = [[_expected_reads(rank, 2, h, k, tied) for h, k in HEADS for tied in (False, True)] for rank in range(2)]
    assert [r["reads"] for r in results] == expected
    assert [r["exchange"] for r in results] == [(("plan", [1, 2]), 3, [7, 7])] * 2


def check_all(tp: TPGroup, layouts) -> dict:
    reads = [check_layers(tp, h, k, tied) for h, k in layouts for tied in (False, True)]
    return {"reads": reads, "exchange": exchange(tp)}


def exchange(tp: TPGroup):
    """A message from rank 0 (the control group), the smallest of the ranks' ints, rank 0's
    tensor broadcast (the device group)."""
    message = ("plan", [1, 2])
    if tp.rank == 0:
        tp.send(message)
    else:
        message = tp.receive()
    mine = torch.tensor([7, 7]) if tp.rank == 0 else torch.zeros(2, dtype=torch.int64)
    return message, tp.min(3 + tp.rank), tp.broadcast(mine).tolist()


@pytest.mark.parametrize(("heads", "size", "replicate", "expected"), [
    (8, 2, False, 4), (8, 8, False, 1), (2, 4, True, 1), (8, 4, True, 2), (1, 8, True, 1)])
def test_local_heads(heads, size, replicate, expected):
    assert local_heads(heads, size, "heads", replicate=replicate) == expected


@pytest.mark.parametrize(("heads", "size", "replicate"), [(9, 2, False), (2, 4, False), (3, 2, True), (2, 3, True)])
def test_heads_that_cannot_be_shared_are_refused(heads, size, replicate):
    with pytest.raises(ValueError, match=f"divisible by tensor_parallel_size={size}"):
        local_heads(heads, size, "num_key_value_heads", replicate=replicate)


def test_replicated_kv_heads_follow_their_query_heads():
    """With 4 ranks and 2 KV heads of 8 query heads, ranks 0-1 hold KV head 0 and ranks 2-3 KV
    head 1: query head h's KV head is h // 4 (GQA), and rank r holds query heads 2r, 2r + 1."""
    for rank in range(4):
        tp = TPGroup(rank, 4)
        q = Split.heads(8, 1, tp, "heads")
        kv = Split.heads(2, 1, tp, "kv", replicate=True)
        assert {h // 4 for h in range(q.start, q.start + q.length)} == {kv.start}
