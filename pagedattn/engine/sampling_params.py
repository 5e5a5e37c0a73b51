"""Per-request generation options, validated at construction."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to generate one request's completions.

    temperature: 0 is greedy; otherwise logits are divided by it before top-k/top-p sampling.
    top_k: -1 (or 0) keeps every token; top_p: nucleus mass in (0, 1].
    n: completions returned; best_of: completions generated (>= n), the n with the highest
        cumulative log-probability are returned.
    seed: a per-request torch.Generator seed (each completion i draws from its own stream),
        so sampling is reproducible whatever the batch around it.
    stop: strings that end a completion (excluded from its text).
    use_beam_search: beam search of width `best_of or n`, scored like transformers'
        `num_beams` search (log-probabilities summed, divided by the number of generated tokens,
        `length_penalty=1.0`, `early_stopping=False`) over unscaled log-probabilities; it is
        deterministic, so top_k/top_p/seed are refused and temperature is not applied;
        stop strings are not supported with it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    use_beam_search: bool = False
    best_of: int | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, self.n)
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"expected temperature >= 0 (a finite number), got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"expected 0 < top_p <= 1, got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"expected top_k == -1 (all tokens) or top_k >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"expected seed to be an int or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"expected stop to be a non-empty string or a list of them, got {self.stop!r}")
        for name in ("ignore_eos", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be a bool, got {getattr(self, name)!r}")
        if self.use_beam_search:
            if self.top_k not in (-1, 0) or self.top_p != 1.0:
                raise ValueError(
                    f"expected top_k=-1 and top_p=1.0 with use_beam_search (beam search is deterministic), "
                    f"got top_k={self.top_k}, top_p={self.top_p}"
                )
            if self.stop:
                raise ValueError(f"expected stop=None with use_beam_search (not supported), got {self.stop}")
            if self.seed is not None:
                raise ValueError(f"expected seed=None with use_beam_search (beam search is deterministic), got {self.seed}")
        if self.top_k == 0:
            self.top_k = -1

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def width(self) -> int:
        """Sequences generated: the beam width, or `best_of` samples."""
        return self.best_of if self.best_of is not None else self.n


def _is_finite(x) -> bool:
    """A real number that is neither NaN nor infinite (NaN compares False, so it would pass
    every range check and act as greedy)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"expected {name} to be an int >= {low}, got {value!r}")
