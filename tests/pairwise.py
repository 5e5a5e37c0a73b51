"""All-pairs grids for tests whose every row is expensive (a GPU grid row compiles its own
kernel specialisations: tens of seconds each): every value of each factor meets every value of
every other factor in at least one row, in far fewer rows than the full product.

    all_pairs(heads=[(4, 4), (8, 2)], head_size=[128, 256], variant=["plain", "alibi"])
    # -> a list of dicts, one per row, in a fixed order (greedy: the row covering most new pairs)
"""

from __future__ import annotations

from itertools import combinations, product


def all_pairs(**factors: list) -> list[dict]:
    names = list(factors)
    pairs = list(combinations(names, 2))

    def covers(row: dict) -> set:
        return {((a, row[a]), (b, row[b])) for a, b in pairs}

    candidates = [dict(zip(names, values)) for values in product(*factors.values())]
    uncovered = set().union(*(covers(row) for row in candidates))
    rows = []
    while uncovered:
        best = max(candidates, key=lambda row: len(covers(row) & uncovered))
        rows.append(best)
        uncovered -= covers(best)
    return rows
