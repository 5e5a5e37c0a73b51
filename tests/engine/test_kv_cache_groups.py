"""KV cache groups: which layers share block tables and cache tensors (vLLM's grouping rule)."""

from __future__ import annotations

from pagedattn.engine.kv_cache_groups import KVCacheGroup, KVCacheGroups


def test_layers_that_attend_alike_make_one_group():
    for windows in ([None] * 4, [8] * 3):
        groups = KVCacheGroups.of(windows)
        assert groups.groups == (KVCacheGroup(windows[0], tuple(range(len(windows)))),)
        assert groups.num_tensors == len(windows)
        assert groups.layer_caches("abcd"[: len(windows)]) == list("abcd"[: len(windows)])


def test_alternating_layers_make_two_groups_sharing_tensors():
    """Gemma 2 / gpt-oss: local and global layers alternate; layer j of each group shares tensor j."""
    groups = KVCacheGroups.of([8, None] * 3)
    assert groups.groups == (KVCacheGroup(None, (1, 3, 5)), KVCacheGroup(8, (0, 2, 4)))
    assert groups.windows == (None, 8)
    assert groups.layer_group == (1, 0, 1, 0, 1, 0)
    assert groups.num_tensors == 3
    assert groups.layer_caches(["t0", "t1", "t2"]) == ["t0", "t0", "t1", "t1", "t2", "t2"]


def test_gemma3_pattern_cuts_local_layers_into_groups_of_the_global_count():
    """26 layers, every sixth global: 4 global layers, 22 local ones in 6 groups (the last of 2)."""
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(26)]
    groups = KVCacheGroups.of(windows)
    assert [g.window for g in groups.groups] == [None] + [1024] * 6
    assert [len(g.layers) for g in groups.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert groups.groups[0].layers == (5, 11, 17, 23)
    assert sorted(layer for g in groups.groups for layer in g.layers) == list(range(26))
    assert groups.num_tensors == 4


def test_nearly_equal_kinds_make_one_group_each():
    """Fewer than 1.5 times as many of one kind: one group per kind (the smaller one leaves a
    tensor unused in its blocks); 1.5 times or more: groups of the smaller kind's size."""
    groups = KVCacheGroups.of([8, 8, None, 8, None, 8, None])
    assert [len(g.layers) for g in groups.groups] == [3, 4]
    assert groups.num_tensors == 4
    groups = KVCacheGroups.of([8, 8, None, 8, None])
    assert [(g.window, g.layers) for g in groups.groups] == [(None, (2, 4)), (8, (0, 1)), (8, (3,))]


def test_blocks_per_request_counts_a_windowed_group_up_to_its_window_and_a_step():
    groups = KVCacheGroups.of([8, None])
    # 100 slots of 4: 25 blocks in the full group; the window (8) and a step of 16 tokens: 7
    assert groups.blocks_per_request(100, 4, 16) == 25 + 7
    assert KVCacheGroups.of([None, None]).blocks_per_request(100, 4, 16) == 25
