"""Forced tiles of `--tiles` (the `raw-<label>` rows): parsed from the command line, named in rows."""

from __future__ import annotations

ForcedTile = tuple[int, int, int, "int | None", bool, bool]  # keys, warps, stages, rows or None, TMA, WS


def parse_tile(item: str) -> ForcedTile | None:
    """`[ROWSx]KEYSxWARPSxSTAGES[t|w]` as `paged_attention`'s forced tile (keys, warps, stages,
    rows or None, TMA, warp specialisation); None when malformed. A trailing `t` asks for TMA
    descriptors, `w` for TMA and a warp-specialised key loop."""
    text = item.lower()
    flag = text[-1:] if text[-1:] in ("t", "w") else ""
    parts = text.removesuffix(flag).split("x")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
        return None
    nums = [int(p) for p in parts]
    rows = nums.pop(0) if len(nums) == 4 else None
    return (*nums, rows, flag != "", flag == "w")


def tile_label(tile: ForcedTile) -> str:
    """The row suffix of a forced tile: m<ROWS>n<KEYS>w<WARPS>s<STAGES>[t|ws]."""
    block_n, warps, stages, rows, tma, ws = tile
    flag = "ws" if ws else "t" if tma else ""
    return f"{'' if rows is None else f'm{rows}'}n{block_n}w{warps}s{stages}{flag}"
