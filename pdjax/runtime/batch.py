"""Ragged batch: the device-side input of one step (DESIGN.md §3), its shape buckets, and its host builder.

The builder is plain numpy: it turns the struct-of-lists of a `SchedulerOutput` into padded arrays whose
shapes come from a small set of buckets, so a whole run compiles at most len(tokens) · len(seqs) · len(pages)
step variants. Padding tokens get slot -1 (written nowhere), position 0 and token 0; padding sequences get
q_len 0, kv_len 0 and page 0, and their samples are discarded on the host.
All inputs are validated here, once, on the host, so bad batches fail before anything is traced.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
from flax import struct

from pdjax.config.buckets import Buckets
from pdjax.config.sampling import SamplingParams

_GREEDY = SamplingParams()


@struct.dataclass
class RaggedBatch:
    """One step's inputs. T = token bucket, S = sequence bucket, P = pages-per-sequence bucket.

    token_ids, positions, slot_mapping: int32[T] (slot = page * page_size + offset; -1 for padding)
    cu_q_lens: int32[S + 1]; kv_lens: int32[S] (context incl. this step); page_indices: int32[S, P]
    num_seqs: int32[] real sequences; sample_indices: int32[S] flat index of each sequence's last token
    temperature float32[S] (0 = greedy), top_k int32[S] (0 = off), top_p float32[S] (1 = off), seed uint32[S]
    want_logprobs bool[S]: the sequence samples a token and its request asked for logprobs (a batch with none
      skips their computation: pdjax.runtime.sampling.token_logprobs)
    token_src: int32[T] -1 where token_ids holds the token; else the index into the previous step's sampled ids
      of the token to feed (async scheduling: a sample that has not reached the host yet)
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
    token_src: np.ndarray
    want_logprobs: np.ndarray

    @property
    def shape_key(self) -> Tuple[int, int, int]:
        """(T, S, P): the bucket this batch was padded to."""
        return (self.token_ids.shape[0], self.kv_lens.shape[0], self.page_indices.shape[1])


def empty_batch(shape: Tuple[int, int, int]) -> RaggedBatch:
    """An all-padding batch of bucket shape (T, S, P) (used to precompile)."""
    t, s, p = shape
    return RaggedBatch(
        token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
        slot_mapping=np.full(t, -1, np.int32), cu_q_lens=np.zeros(s + 1, np.int32),
        kv_lens=np.zeros(s, np.int32), page_indices=np.zeros((s, p), np.int32),
        num_seqs=np.zeros((), np.int32), sample_indices=np.zeros(s, np.int32),
        temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
        seed=np.zeros(s, np.uint32), token_src=np.full(t, -1, np.int32), want_logprobs=np.zeros(s, bool))


def _lengths(token_ids, num_computed_tokens, page_tables, do_sample, sampling, page_size: int,
             max_model_len: Optional[int]):
    """build_ragged_batch's length checks (ValueError naming the sequence); returns (q_lens, starts, kv_lens,
    pages_needed) per sequence (int64 arrays)."""
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
    return q_lens, starts, kv_lens, pages_needed


def _fill_sampling(batch: RaggedBatch, sampling: Sequence[Optional[SamplingParams]],
                   do_sample: Sequence[bool]) -> None:
    """Each sequence's sampling parameters (None: greedy) into the batch's per-sequence arrays; want_logprobs
    only where the sequence samples (a prefill chunk that does not end the prompt asks for nothing)."""
    n = len(sampling)
    params = [sp or _GREEDY for sp in sampling]
    batch.want_logprobs[:n] = [bool(s) and getattr(sp, "logprobs", None) is not None
                               for sp, s in zip(params, do_sample)]
    batch.temperature[:n] = [sp.temperature for sp in params]
    batch.top_k[:n] = [sp.top_k for sp in params]
    batch.top_p[:n] = [sp.top_p for sp in params]
    batch.seed[:n] = [sp.seed % (2 ** 32) for sp in params]


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
    q_lens, starts, kv_lens, pages_needed = _lengths(token_ids, num_computed_tokens, page_tables, do_sample,
                                                     sampling, page_size, max_model_len)
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
    # Vectorized over sequences and tokens (one Python step per sequence only to copy its page table): this
    # runs on the host between two device steps of a synchronous engine.
    for i in range(n):
        batch.page_indices[i, :pages_needed[i]] = page_tables[i][:pages_needed[i]]
    if num_pages is not None and n:
        used = np.arange(p_pad)[None, :] < pages_needed[:, None]
        bad_rows = np.nonzero((used & ((batch.page_indices[:n] < 0) | (batch.page_indices[:n] >= num_pages))).any(1))[0]
        if bad_rows.size:
            i = int(bad_rows[0])
            table = [int(p) for p in page_tables[i][:pages_needed[i]]]
            raise ValueError(f"sequence {i}: page table {table} has ids outside [0, {num_pages})")
    seq_of_token = np.repeat(np.arange(n), q_lens)
    pos = starts[seq_of_token] + np.arange(total) - cu[seq_of_token]
    batch.positions[:total] = pos
    batch.slot_mapping[:total] = batch.page_indices[seq_of_token, pos // page_size] * page_size + pos % page_size
    _fill_sampling(batch, sampling, do_sample)
    batch.cu_q_lens[:] = cu
    batch.kv_lens[:n] = kv_lens
    batch.sample_indices[:n] = cu[1:n + 1] - 1
    batch.num_seqs[...] = n
    return batch
