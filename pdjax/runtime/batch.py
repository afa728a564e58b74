"""Ragged batch: the device-side input of one step (DESIGN.md §3), its shape buckets, and its host builder.

The builder is plain numpy: it turns the struct-of-lists of a `SchedulerOutput` into padded arrays whose
shapes come from a small set of buckets, so a whole run compiles at most len(tokens) · len(seqs) · len(pages)
step variants. Padding tokens get slot -1 (written nowhere), position 0 and token 0; padding sequences get
q_len 0, kv_len 0 and page 0, and their samples are discarded on the host.
All inputs are validated here, once, on the host, so bad batches fail before anything is traced.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np
from flax import struct

from pdjax.config.sampling import SamplingParams


@struct.dataclass
class RaggedBatch:
    """One step's inputs. T = token bucket, S = sequence bucket, P = pages-per-sequence bucket.

    token_ids, positions, slot_mapping: int32[T] (slot = page * page_size + offset; -1 for padding)
    cu_q_lens: int32[S + 1]; kv_lens: int32[S] (context incl. this step); page_indices: int32[S, P]
    num_seqs: int32[] real sequences; sample_indices: int32[S] flat index of each sequence's last token
    temperature float32[S] (0 = greedy), top_k int32[S] (0 = off), top_p float32[S] (1 = off), seed uint32[S]
    """
    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    num_seqs: np.ndarray
    sample_indices: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray

    @property
    def shape_key(self) -> Tuple[int, int, int]:
        """(T, S, P): the bucket this batch was padded to."""
        return (self.token_ids.shape[0], self.kv_lens.shape[0], self.page_indices.shape[1])


def _powers_of_two(floor: int, ceiling: int) -> Tuple[int, ...]:
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
        return cls(tokens=_powers_of_two(min(min_tokens, max_tokens), max_tokens),
                   seqs=_powers_of_two(min(min_seqs, max_seqs), max_seqs),
                   pages=_powers_of_two(min(min_pages, max_pages), max_pages))

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


def empty_batch(shape: Tuple[int, int, int]) -> RaggedBatch:
    """An all-padding batch of bucket shape (T, S, P) (used to precompile)."""
    t, s, p = shape
    return RaggedBatch(
        token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
        slot_mapping=np.full(t, -1, np.int32), cu_q_lens=np.zeros(s + 1, np.int32),
        kv_lens=np.zeros(s, np.int32), page_indices=np.zeros((s, p), np.int32),
        num_seqs=np.zeros((), np.int32), sample_indices=np.zeros(s, np.int32),
        temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
        seed=np.zeros(s, np.uint32))


def build_ragged_batch(token_ids: Sequence[Sequence[int]], num_computed_tokens: Sequence[int],
                       page_tables: Sequence[Sequence[int]], do_sample: Sequence[bool],
                       sampling: Sequence[Optional[SamplingParams]], *, page_size: int, buckets: Buckets,
                       max_model_len: Optional[int] = None, num_pages: Optional[int] = None,
                       vocab_size: Optional[int] = None) -> RaggedBatch:
    """Pad one iteration's sequences into a RaggedBatch (numpy arrays).

    Sequence i feeds token_ids[i] at positions num_computed_tokens[i] + j; its kv_len is
    num_computed_tokens[i] + len(token_ids[i]); the slot of position p is
    page_tables[i][p // page_size] * page_size + p % page_size. `sampling[i]` None means greedy.
    Raises ValueError naming the sequence and the bad value on: length mismatches, empty token lists, a kv_len
    beyond max_model_len, a page table too short for kv_len, page ids outside [0, num_pages), token ids outside
    [0, vocab_size), or sizes beyond the largest bucket.
    """
    n = len(token_ids)
    for name, lst in (("num_computed_tokens", num_computed_tokens), ("page_tables", page_tables),
                      ("do_sample", do_sample), ("sampling", sampling)):
        if len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} entries, expected {n} (one per sequence)")
    if page_size < 1:
        raise ValueError(f"page_size={page_size}, expected >= 1")
    q_lens = np.array([len(t) for t in token_ids], np.int64)
    starts = np.array(num_computed_tokens, np.int64).reshape(n)
    for i in range(n):
        if q_lens[i] < 1:
            raise ValueError(f"sequence {i}: no tokens to feed (num_new_tokens=0), expected >= 1")
        if starts[i] < 0:
            raise ValueError(f"sequence {i}: num_computed_tokens={starts[i]}, expected >= 0")
    kv_lens = starts + q_lens
    pages_needed = -(-kv_lens // page_size)
    for i in range(n):
        if max_model_len is not None and kv_lens[i] > max_model_len:
            raise ValueError(f"sequence {i}: length {kv_lens[i]} (num_computed_tokens={starts[i]} + "
                             f"{q_lens[i]} new) exceeds max_model_len={max_model_len}")
        if len(page_tables[i]) < pages_needed[i]:
            raise ValueError(f"sequence {i}: page table has {len(page_tables[i])} pages, needs "
                             f"{pages_needed[i]} for {kv_lens[i]} tokens at page_size={page_size}")
    total = int(q_lens.sum())
    max_pages = int(pages_needed.max()) if n else 1
    t_pad, s_pad, p_pad = buckets.pick(total, n, max_pages)

    batch = empty_batch((t_pad, s_pad, p_pad))
    cu = np.zeros(s_pad + 1, np.int64)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = total
    flat_tokens = np.fromiter((tok for seq in token_ids for tok in seq), np.int64, count=total)
    if vocab_size is not None and total and (flat_tokens.min() < 0 or flat_tokens.max() >= vocab_size):
        bad = int(flat_tokens[(flat_tokens < 0) | (flat_tokens >= vocab_size)][0])
        raise ValueError(f"token id {bad} outside [0, {vocab_size})")
    batch.token_ids[:total] = flat_tokens
    for i in range(n):
        table = np.asarray(page_tables[i][:pages_needed[i]], np.int64)
        if num_pages is not None and table.size and (table.min() < 0 or table.max() >= num_pages):
            raise ValueError(f"sequence {i}: page table {table.tolist()} has ids outside [0, {num_pages})")
        batch.page_indices[i, :table.size] = table
        pos = starts[i] + np.arange(q_lens[i])
        batch.positions[cu[i]:cu[i + 1]] = pos
        batch.slot_mapping[cu[i]:cu[i + 1]] = table[pos // page_size] * page_size + pos % page_size
        sp = sampling[i] or SamplingParams()
        batch.temperature[i] = sp.temperature
        batch.top_k[i] = sp.top_k
        batch.top_p[i] = sp.top_p
        batch.seed[i] = sp.seed % (2 ** 32)
    batch.cu_q_lens[:] = cu
    batch.kv_lens[:n] = kv_lens
    batch.sample_indices[:n] = cu[1:n + 1] - 1
    batch.num_seqs[...] = n
    return batch
