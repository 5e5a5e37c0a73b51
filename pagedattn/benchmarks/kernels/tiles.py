"""Forced tiles of `--tiles` (the `raw-<label>` rows): parsed from the command line, named in rows."""

from __future__ import annotations

ForcedTile = tuple[int, int, int, "int | None"]  # keys, warps, stages, rows or None (the policy's)


def parse_tile(item: str) -> ForcedTile | None:
    """`[ROWSx]KEYSxWARPSxSTAGES` as `paged_attention`'s forced tile (keys, warps, stages, rows
    or None); None when malformed."""
    parts = item.lower().split("x")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
        return None
    nums = [int(p) for p in parts]
    rows = nums.pop(0) if len(nums) == 4 else None
    return (*nums, rows)


def tile_label(tile: ForcedTile) -> str:
    """The row suffix of a forced tile: [m<ROWS>]n<KEYS>w<WARPS>s<STAGES>."""
    block_n, warps, stages, rows = tile
    return f"{'' if rows is None else f'm{rows}'}n{block_n}w{warps}s{stages}"
