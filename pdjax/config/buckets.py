"""Shape buckets of the jitted step (no JAX): the padded sizes of the flat token axis (T), the sequence axis (S) and
pages per sequence (P). The runtime pads every batch up to them, so a run compiles at most
len(tokens) * len(seqs) * len(pages) shapes; the simulator pads its cost the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import numpy as np


def powers_of_two(floor: int, ceiling: int) -> Tuple[int, ...]:
    if floor < 1 or ceiling < 1:
        raise ValueError(f"bucket floor={floor} and ceiling={ceiling} must be >= 1")
    sizes, n = [], 1
    while n < floor:
        n *= 2
    while n < ceiling:
        sizes.append(n)
        n *= 2
    sizes.append(ceiling)
    return tuple(sorted(set(sizes)))


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Allowed padded sizes for tokens (T), sequences (S) and pages per sequence (P), ascending."""
    tokens: Tuple[int, ...]
    seqs: Tuple[int, ...]
    pages: Tuple[int, ...]

    def __post_init__(self):
        for name in ("tokens", "seqs", "pages"):
            sizes = tuple(getattr(self, name))
            if not sizes or any((not isinstance(s, (int, np.integer))) or s < 1 for s in sizes):
                raise ValueError(f"Buckets.{name}={sizes!r}, expected a non-empty tuple of positive ints")
            object.__setattr__(self, name, tuple(sorted(set(int(s) for s in sizes))))

    @classmethod
    def powers_of_two(cls, max_tokens: int, max_seqs: int, max_pages: int, *, min_tokens: int = 16,
                      min_seqs: int = 4, min_pages: int = 4) -> "Buckets":
        """Powers of two from each floor up to the maximum (the maximum itself always included)."""
        return cls(tokens=powers_of_two(min(min_tokens, max_tokens), max_tokens),
                   seqs=powers_of_two(min(min_seqs, max_seqs), max_seqs),
                   pages=powers_of_two(min(min_pages, max_pages), max_pages))

    @property
    def num_shapes(self) -> int:
        """Most distinct (T, S, P) shapes a run can compile."""
        return len(self.tokens) * len(self.seqs) * len(self.pages)

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    @property
    def max_seqs(self) -> int:
        return self.seqs[-1]

    @property
    def max_pages(self) -> int:
        return self.pages[-1]

    def all_shapes(self):
        return [(t, s, p) for t in self.tokens for s in self.seqs for p in self.pages]

    @staticmethod
    def _pick(sizes: Tuple[int, ...], n: int, what: str) -> int:
        for size in sizes:
            if size >= n:
                return size
        raise ValueError(f"{what}={n} exceeds the largest bucket {sizes[-1]} (buckets {sizes})")

    def pick(self, num_tokens: int, num_seqs: int, num_pages: int) -> Tuple[int, int, int]:
        return (self._pick(self.tokens, num_tokens, "number of tokens"),
                self._pick(self.seqs, max(num_seqs, 1), "number of sequences"),
                self._pick(self.pages, max(num_pages, 1), "pages per sequence"))


def engine_buckets(token_budget: int, max_num_seqs: int, max_model_len: int, page_size: int,
                   token_buckets: Sequence[int] = (), seq_buckets: Sequence[int] = (),
                   page_buckets: Sequence[int] = ()) -> Buckets:
    """The serving engine's buckets for a scheduler config: explicit lists when given, else tokens in powers of
    two from 16 to the token budget, sequences {max_num_seqs // 4, max_num_seqs} and one page bucket, max_pages
    (the blocked and Pallas attention loop over each sequence's own pages, so a wider page table costs almost
    nothing; only the dense jnp reference pays for it). Few shapes keep warm-up compile time small."""
    max_tokens = max(token_budget, 1)
    max_pages = -(-max_model_len // page_size)
    return Buckets(
        tokens=tuple(int(t) for t in token_buckets) or powers_of_two(min(16, max_tokens), max_tokens),
        seqs=tuple(int(s) for s in seq_buckets) or tuple(sorted({max(1, max_num_seqs // 4), max_num_seqs})),
        pages=tuple(int(p) for p in page_buckets) or (max_pages,))
