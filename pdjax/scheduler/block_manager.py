"""Block manager: the device page pool, reference counts, prefix caching, and host swap slots (no JAX).

Choices:
- Pages are ints in [0, num_pages). Per-page state lives in flat lists indexed by page (`ref_count`,
  `page_key`), so the hot path touches no per-page objects.
- Free pages are of two kinds: uncached ones on a stack (`_free`), and free pages that still hold a
  prefix-cached full page, in LRU order in an OrderedDict (`_free_cached`: its oldest entry is O(1) however
  many were evicted before it; a plain dict's next(iter(d)) scans the holes its front deletions leave, which
  made eviction quadratic). Allocation takes an uncached page first and evicts the least recently freed cached
  page only when none is left, so cached content survives as long as possible. Both kinds count as free.
- Prefix-cache key of full page i of a token sequence: the bytes of `hash(key of page i-1)` (0 for page 0) then
  of the page's token ids (4 bytes each, signed little-endian; a page with an id outside int32: a 0xFF byte,
  then 8 bytes each, an odd length). Keys are dict keys, so equal pages chain on the parent's hash and compare
  their tokens exactly: a false hit needs a 64-bit collision of the parent's hash AND identical page tokens.
  Bytes rather than a (parent, tuple of tokens) tuple because a bytes object keeps its hash: a key is hashed at
  every dict it enters or leaves (registration, eviction, the host tier), and a tuple's hash re-reads its
  token ints, cold in memory by eviction time; 4-byte ids keep the keys (and the heap) small. A bytes hash is
  salted per process (PYTHONHASHSEED), so key values are meaningful within one process only: never send them to
  another process or store them (results do not depend on them: nothing iterates a container in hash order).
  Only full pages whose KV has been computed are registered (`register`), and a page is handed out by
  `allocate` only when its reference count is 0, so a cached page is never handed out while referenced.
- A page whose key is already registered to another page (two requests computed the same prefix at once)
  stays unregistered and returns to the uncached stack when freed.
- Numbered keys (the simulator, pdjax.sim.build): a request whose first page no other request of the run has
  shares no page with any (keys chain on their parent's), so its keys can be numbers (`numbered_key_bases`,
  `request_page_keys`: key_base + page index, a range, never stored), found exactly where content keys would be.
  One that shares its first L pages with another request (a shared prefix) shares none after them, so its pages
  from L on are numbered too (`numbered_keys`: `content_key_pages` = L, content keys for the first L).
  On a scheduler whose finished requests' pages nobody looks up again (colocated), such a request never
  preempted offers its pages to the cache without keys at all (pdjax.scheduler.base.Scheduler._keyless: only
  `num_registered_pages` moves; its first L are registered with their keys), and at its finish they become a dead
  segment (`free_dead`; the first L are freed as `free` frees them, after it): one LRU entry
  `_free_cached[token] = pages, the tail last` (token < 0), counted as free cached pages (`_dead_extra`), evicted in
  its place (partly: the rest stays at the front; the segments an eviction of dead pages alone takes, in one pass:
  `_evict_dead`) and offloaded to a host tier as one entry (HostKVTier.offload_dead).
  A request that is preempted first registers them with keys (`_keep_registered`). Records, LRU order, counters and
  host slots equal those of content keys (tests/test_numbered_keys.py); the cost per page is a list slice's.
- Pages are released in reverse table order so a sequence's tail is evicted before its (more shareable)
  head.
- Host swap slots are ints in [0, num_host_pages) on a stack; `swap_out` returns the (host_slot,
  device_page) copies for the runner.
- Host KV tier (`host_tier`, a pdjax.scheduler.kv_tier.HostKVTier, None by default): a prefix-cached page evicted
  from the device is offloaded to it (a (slot, page) copy in `pending_swap_out`), and `load_from_host` brings
  a run of host pages back into fresh device pages (copies in `pending_swap_in`); the scheduler moves both into
  its next non-empty SchedulerOutput (`drain_tier_copies`). `tier_owner` names this instance in the tier.
"""
from __future__ import annotations

import struct as _struct
from bisect import bisect_right as _bisect_right
from collections import OrderedDict
from itertools import accumulate as _accumulate, repeat as _repeat
from operator import itemgetter as _getter
from typing import Iterable, List, Optional, Sequence, Tuple

_any = any
_KEY_PACKERS: dict = {}     # page size -> struct pack of a key (_key_packer)


def extend_page_keys(keys: list, tokens: Sequence[int], page_size: int, num_pages: int) -> None:
    """Append prefix-cache keys to `keys` until it covers the first `num_pages` full pages of `tokens` (module
    docstring: bytes, the parent key's hash then the page's token ids)."""
    parent = hash(keys[-1]) if keys else 0
    pack = _key_packer(page_size)
    for s in range(len(keys) * page_size, num_pages * page_size, page_size):
        try:
            key = pack(parent, *tokens[s:s + page_size])
        except _struct.error:            # a short page (tokens end inside it) or a token id outside int32
            key = _other_key(parent, tokens[s:s + page_size])
        keys.append(key)
        parent = hash(key)


def request_page_keys(req, page_size: int, num_pages: int) -> Sequence:
    """The prefix-cache keys of (at least) the first `num_pages` full pages of `req` (a pdjax.scheduler.Request):
    `req.page_keys`, its content keys (extend_page_keys) extended as needed, or, when the request has a key base
    (numbered_key_bases: no other request shares its pages, so numbers identify them as exactly as their content,
    without reading a token), range(key_base, key_base + num_pages)."""
    base = req.key_base
    shared = req.content_key_pages
    if base is not None and not shared:
        return range(base, base + num_pages)
    keys = req.page_keys
    if base is not None:          # content keys for its first `shared` pages (numbered_keys), numbers after them
        if len(keys) < shared and len(keys) < num_pages:
            extend_page_keys(keys, req.all_token_ids, page_size, min(shared, num_pages))
        return keys if num_pages <= shared else keys + list(range(base + shared, base + num_pages))
    if len(keys) < num_pages:
        extend_page_keys(keys, req.all_token_ids, page_size, num_pages)
    return keys


def holds_no_prefix(req) -> bool:
    """Whether no prefix cache or host tier can hold a page of `req`: it has numbered keys only (numbered_keys: no
    other request shares its pages) and was never scheduled (it cached none of its own)."""
    return req.key_base is not None and not req.content_key_pages and req.first_scheduled_time is None


def numbered_key_bases(prompts: Sequence[Sequence[int]], page_size: int, placeholder: int) -> List[Optional[int]]:
    """Key bases (request_page_keys) of the requests of a run, given their `prompts`, whose sampled ids are all
    `placeholder` (the simulator's): request i's is i << 32, or None (content keys) when another request has the
    same first page (the prompt's first page_size ids, completed with placeholders). A content key chains on its
    parent's, so a request shares a page with another only if they share the first: a numbered request shares
    none, and numbers find in the cache exactly what content keys would. (numbered_keys with no shared pages.)"""
    bases, shared = numbered_keys(prompts, page_size, placeholder)
    return [None if pages else base for base, pages in zip(bases, shared)]


def numbered_keys(prompts: Sequence[Sequence[int]], page_size: int, placeholder: int
                  ) -> Tuple[List[Optional[int]], List[int]]:
    """numbered_key_bases, and numbers for the pages a request shares with no other: (key bases, content-key pages).
    Request i's pages are its prompt then placeholders (the simulator's sampled ids), page d its ids d * page_size
    onwards (completed with placeholders). Its first L pages are shared with another request when some other
    request has the same first L pages; from the first page no other shares (on the same ones before it) on, none
    is shared (content keys chain on the pages before), so those pages can be numbers: request i's key base i << 32
    and content_key_pages L (request_page_keys: content keys for its first L pages, key_base + d for page d >= L).
    A request that shares every page with another (the same ids until both prompts end, then placeholders) keeps
    content keys for all (base None, 0).

    The requests are split group by group, each group's members sharing pages [0, d): their next k pages compared
    at once (k doubling while all agree, halved when they do not), so a shared prefix of L
    pages costs O(log L) comparisons per request, not L."""
    bases: List[Optional[int]] = [None] * len(prompts)
    shared = [0] * len(prompts)

    def pages(i: int, d: int, k: int) -> tuple:
        ids = tuple(prompts[i][d * page_size:(d + k) * page_size])
        return ids + (placeholder,) * (k * page_size - len(ids))

    work = [(list(range(len(prompts))), 0, 1)] if prompts else []
    while work:
        members, d, k = work.pop()
        if len(members) == 1:         # the others parted from it before page d: L = d
            bases[members[0]], shared[members[0]] = members[0] << 32, d
            continue
        if all(d * page_size >= len(prompts[i]) for i in members):
            continue            # the same pages so far, placeholders from here on: they share every page
        split: dict = {}
        for i in members:
            split.setdefault(pages(i, d, k), []).append(i)
        if len(split) == 1:
            work.append((members, d + k, 2 * k))
        elif k > 1:
            work.append((members, d, k // 2))
        else:
            work += [(group, d + 1, 1) if len(group) > 1 else (group, d, 1) for group in split.values()]
    return bases, shared


def dead_segments(entries: Iterable, n: int) -> Optional[Tuple[List[list], Optional[list], int]]:
    """The dead segments (lists, oldest first; any other entry is a live page) whose pages the n oldest of an LRU's
    `entries` are: (the segments they fill whole, the one whose oldest pages complete them or None, the pages of
    the whole ones); None when a live page is among them or the entries hold fewer than n (BlockManager._evict_dead,
    HostKVTier._dead_slots)."""
    whole, held = [], 0
    for segment in entries:
        if segment.__class__ is not list:
            return None
        if held + len(segment) > n:
            return whole, segment, held
        whole.append(segment)
        held += len(segment)
        if held == n:
            return whole, None, held
    return None


def _key_packer(page_size: int):
    """struct pack of a parent hash and `page_size` int32 token ids into a key, made once per size."""
    pack = _KEY_PACKERS.get(page_size)
    if pack is None:
        pack = _KEY_PACKERS[page_size] = _struct.Struct(f"<q{page_size}i").pack
    return pack


def _other_key(parent: int, page: Sequence[int]) -> bytes:
    """The key of a page `_key_packer(page_size)` does not pack: 4-byte ids if they fit (a short page), else a
    0xFF byte then 8-byte ids (an odd length, so never equal to a key of 4-byte ids)."""
    try:
        return _key_packer(len(page))(parent, *page)
    except _struct.error:
        return _struct.pack(f"<qB{len(page)}q", parent, 255, *page)


def page_key_tokens(key: bytes) -> Tuple[int, ...]:
    """The token ids of the page whose prefix-cache key is `key` (extend_page_keys)."""
    if len(key) % 2:
        return _struct.unpack(f"<{(len(key) - 9) // 8}q", key[9:])
    return _struct.unpack(f"<{(len(key) - 8) // 4}i", key[8:])


class BlockManager:
    """Fixed pool of `num_pages` device pages of `page_size` tokens, plus `num_host_pages` swap slots."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False,
                 num_host_pages: int = 0):
        if num_pages < 1 or page_size < 1 or num_host_pages < 0:
            raise ValueError(f"num_pages={num_pages}, page_size={page_size}, num_host_pages={num_host_pages}: "
                             f"expected positive pool and page sizes and >= 0 host pages")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_pages = num_host_pages
        self.ref_count: List[int] = [0] * num_pages
        self.page_key: list = [None] * num_pages
        self._free: List[int] = list(range(num_pages - 1, -1, -1))   # pop() hands out page 0 first
        self._free_cached: "OrderedDict[int, None]" = OrderedDict()   # LRU: oldest first
        self._dead_extra = 0             # pages of the dead segments in _free_cached beyond one each (free_dead)
        self._segment = 0                # the last dead segment's token (-1, -2, ...: never a page)
        self._num_segments = 0
        self._key_to_page: dict = {}
        self._free_host: List[int] = list(range(num_host_pages - 1, -1, -1))
        self.num_cache_hit_pages = 0
        self.num_query_pages = 0         # pages admissions looked up in the prefix cache (the hit ratio's base)
        self.num_evictions = 0
        self.num_dead_evictions = 0      # of them, dead segments' pages (free_dead)
        self.host_tier = None            # pdjax.scheduler.kv_tier.HostKVTier (module docstring)
        self.tier_owner = ""
        self.pending_swap_out: List[Tuple[object, int]] = []
        # whether evictions record their host-tier copies in pending_swap_out (the engine's runner makes them);
        # the simulator prices no offload (pdjax.sim.kv_tier) and turns it off
        self.record_offloads = True
        self.pending_swap_in: List[Tuple[object, int]] = []
        # hot-block replication (HostKVTier.replicate_after): (key, device page) of pages due for a copy, loaded
        # by this schedule's output (`_copies_due`) and by the one before (`_copies_next`: their data is on the
        # device once that output's step ran, so their copies go out with the next output: drain_tier_copies)
        self._copies_due: List[Tuple[object, int]] = []
        self._copies_next: List[Tuple[object, int]] = []
        self.num_host_hit_pages = 0
        self.num_remote_hit_pages = 0

    # ---- counts
    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._free_cached) + self._dead_extra

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_free_host_pages(self) -> int:
        return len(self._free_host)

    @property
    def num_cached_pages(self) -> int:
        """Pages holding a registered prefix-cache entry (in use or free)."""
        return len(self._key_to_page)

    # ---- allocation
    def allocate(self, table: List[int], n: int) -> None:
        """Append `n` fresh pages (refcount 1) to `table`. The caller checks `num_free_pages >= n`."""
        if n > len(self._free) + len(self._free_cached) + self._dead_extra:
            raise RuntimeError(f"allocate({n}) with only {self.num_free_pages} free pages")
        free, ref = self._free, self.ref_count
        if n <= len(free):     # no eviction: the top n pages of the stack, in pop order, in C-level passes
            if n <= 0:
                return
            if n == 1:
                p = free.pop()
                ref[p] = 1
                table.append(p)
                return
            pages = free[:-n - 1:-1]
            del free[-n:]
            table += pages
            _any(map(ref.__setitem__, pages, _repeat(1)))
            return
        self.allocate_each_evicting([(table, n)])    # the whole uncached stack, then the oldest cached pages

    def allocate_one_each(self, tables: Sequence[List[int]]) -> None:
        """`allocate(table, 1)` for each of `tables` in order (a table may repeat). The caller checks
        `num_free_pages >= len(tables)`."""
        n = len(tables)
        free = self._free
        if not n:
            return
        if n > len(free):             # some allocation evicts a cached page
            self.allocate_one_each_evicting(tables)
            return
        pages = free[:-n - 1:-1]          # the pages n pops hand out, in order
        del free[-n:]
        for table, p in zip(tables, pages):
            table.append(p)
        _any(map(self.ref_count.__setitem__, pages, _repeat(1)))

    def allocate_each(self, grants: Sequence[Tuple[List[int], int]]) -> None:
        """`allocate(table, n)` for each (table, n) of `grants` in order (a table may repeat). The caller checks
        `num_free_pages >= sum(n)`."""
        free = self._free
        if sum(n for _, n in grants) > len(free):     # some allocation evicts a cached page
            self.allocate_each_evicting(grants)
            return
        ref = self.ref_count
        for table, n in grants:
            if n == 1:
                p = free.pop()
                ref[p] = 1
                table.append(p)
            elif n > 0:
                pages = free[:-n - 1:-1]
                del free[-n:]
                table += pages
                _any(map(ref.__setitem__, pages, _repeat(1)))

    def allocate_each_evicting(self, grants: Sequence[Tuple[List[int], int]], swaps: bool = True
                               ) -> List[Tuple[int, object]]:
        """`allocate_each(grants)`, returning (index of the grant, prefix key) of each cached page it evicts, in
        eviction order (pdjax.scheduler.runs replays registrations against them). The caller checks
        `num_free_pages >= sum(n)`. In C-level passes: the pages n pops hand out (the whole uncached stack, then
        the oldest cached pages, their keys dropped and offloaded in that order), then dealt to the grants.
        swaps=False: the offloads' host copies are not recorded (a decode run builds no SchedulerOutput)."""
        taken = self._take_evicting(sum([n for _, n in grants]), swaps)
        if taken is None:
            self.allocate_each(grants)
            return []
        pages, fresh, live, keys = taken
        pos = 0
        for table, n in grants:
            if n == 1:
                table.append(pages[pos])
            elif n > 0:
                table += pages[pos:pos + n]
            pos += n
        if not live:
            return []
        ends = list(_accumulate(n for _, n in grants))
        return [(_bisect_right(ends, fresh + a), keys[a]) for a in live]

    def allocate_one_each_evicting(self, tables: Sequence[List[int]], swaps: bool = True
                                   ) -> List[Tuple[int, object]]:
        """allocate_each_evicting([(table, 1) for table in tables], swaps)."""
        taken = self._take_evicting(len(tables), swaps)
        if taken is None:
            self.allocate_one_each(tables)
            return []
        pages, fresh, live, keys = taken
        for table, p in zip(tables, pages):
            table.append(p)
        return [(fresh + a, keys[a]) for a in live]

    def _take_evicting(self, total: int, swaps: bool) -> Optional[Tuple[List[int], int, list, list]]:
        """The `total` pages allocate_each_evicting hands out, in order, their refcounts set: (pages, how many came
        from the uncached stack, the places in the evicted ones (after those) of the live evicted pages, the
        evicted pages' keys); None when the stack has them all (nothing to evict)."""
        free, cached = self._free, self._free_cached
        short = total - len(free)
        if short <= 0:
            return None
        if short > len(cached) + self._dead_extra:
            raise RuntimeError(f"allocate_each_evicting({total}) with only {self.num_free_pages} free pages")
        fresh = len(free)
        pages = free[::-1]
        del free[:]
        ref = self.ref_count
        for p in pages:
            ref[p] = 1
        out = self._evict_dead(short, swaps) if self._num_segments else None
        if out is not None:
            return (pages + out if fresh else out), fresh, [], None
        out, keys, runs = self._evict(short, swaps)
        live, pos = [], 0        # the live evicted pages' places in `out` (a dead page's refcount is 1 already)
        for n_run in runs:
            if n_run > 0:
                for p in out[pos:pos + n_run]:
                    ref[p] = 1
                live += range(pos, pos + n_run)
            pos += abs(n_run)
        return (pages + out if fresh else out), fresh, live, keys

    def _evict_dead(self, n: int, swaps: bool) -> Optional[List[int]]:
        """_evict(n) when the n oldest cached pages are all dead (free_dead's segments; the common case): the
        segments they fill leave the LRU, the last one's tail taken (the rest stays at the front), and the pages
        go to the host tier as dead pages (HostKVTier.offload_dead). Returns them, oldest first; None, having done
        nothing, when a live page is among them."""
        cached = self._free_cached
        found = dead_segments(cached.values(), n)
        if found is None:
            return None
        full, part, held = found
        pages = []
        pop = cached.popitem
        for whole in full:
            pop(False)
            pages += whole[::-1]
        if part is not None:
            pages += part[:held - n - 1:-1]
            del part[held - n:]
        self._dead_extra -= n - len(full)
        self._num_segments -= len(full)
        self.num_dead_evictions += n
        self.num_evictions += n
        if self.host_tier is not None:
            swaps = swaps and self.record_offloads
            slots = self.host_tier.offload_dead(n, self.tier_owner, swaps)
            if swaps:
                self.pending_swap_out += list(zip(slots, pages))
        return pages

    def _evict(self, n: int, swaps: bool = True) -> Tuple[List[int], list, List[int]]:
        """Evict the `n` least recently freed cached pages (the caller checks there are as many): their keys
        dropped and offloaded to the host tier, in eviction order (as one at a time), the copies recorded in
        `pending_swap_out` unless not `swaps`. Returns (the pages, their keys: None for a dead page, free_dead;
        the lengths of its consecutive runs of live (> 0) and dead (< 0) pages), oldest first. (Plain loops: a
        map over a bound __setitem__ / __delitem__ costs more per item.)"""
        page_key, k2p = self.page_key, self._key_to_page
        if self._num_segments:
            pages, keys, runs = self._pop_with_segments(n)
        else:
            pop = self._free_cached.popitem
            pages = [pop(False)[0] for _ in range(n)]
            keys, runs = [page_key[p] for p in pages], [n]
        pos = 0
        for n_run in runs:          # live runs (> 0): their keys dropped; dead ones (< 0) hold none
            if n_run > 0:
                for key in keys[pos:pos + n_run]:
                    del k2p[key]
                for p in pages[pos:pos + n_run]:
                    page_key[p] = None
            pos += abs(n_run)
        self.num_evictions += n
        if self.host_tier is not None:
            swaps = swaps and self.record_offloads
            slots = self.host_tier.offload_runs(keys, runs, self.tier_owner, swaps)
            if swaps:
                self.pending_swap_out += [(s, p) for s, p in zip(slots, pages) if s is not None]
        return pages, keys, runs

    def _pop_with_segments(self, n: int) -> Tuple[List[int], list, List[int]]:
        """_evict's n oldest cached pages when dead segments may be among them: (pages, keys, runs), a dead page's
        key None, runs the lengths of the consecutive runs of live (> 0) and dead (< 0) pages; a segment partly
        taken keeps the rest at the front of the LRU, in place (dead segments alone: _evict_dead)."""
        cached = self._free_cached
        pop = cached.popitem
        pages, keys, runs = [], [], []
        while len(pages) < n:
            p, seg = next(iter(cached.items()))
            if seg is None:
                pop(False)
                pages.append(p)
                keys.append(self.page_key[p])
                if runs and runs[-1] > 0:
                    runs[-1] += 1
                else:
                    runs.append(1)
                continue
            take = n - len(pages)
            if take < len(seg):          # its last `take` pages, tail first; the rest stays at the front
                taken = seg[:-take - 1:-1]
                del seg[-take:]
                self._dead_extra -= take
            else:
                pop(False)
                taken = seg[::-1]
                self._dead_extra -= len(seg) - 1
                self._num_segments -= 1
            pages += taken
            keys += [None] * len(taken)
            self.num_dead_evictions += len(taken)
            if runs and runs[-1] < 0:
                runs[-1] -= len(taken)
            else:
                runs.append(-len(taken))
        return pages, keys, runs

    def free_dead(self, table: Sequence[int], registered: int, keyed: int = 0) -> bool:
        """free(table) of a finished request with numbered keys (numbered_key_bases) whose first `registered` pages
        are cached but were never entered in the key map (Scheduler._keyless): no request can look them up any
        more, so they enter the LRU as one dead segment (`_free_cached[token] = the pages, the tail last`, token < 0)
        evicted in their place and offloaded without keys, at a list slice's cost instead of a key's per page.
        Every page of `table` is held once (a numbered request shares none); a dead page keeps its refcount of 1
        (nothing reads it before allocation sets it again). keyed: its first pages registered with keys instead
        (Scheduler._keyless: the ones other requests may share), freed as free() frees them, after the segment (tail
        first). Returns False, having done nothing, with an LFU host tier (it orders pages by their hits): the
        caller registers the pages and frees them."""
        if self.host_tier is not None and self.host_tier.eviction != "lru":
            return False
        ref = self.ref_count
        if registered < len(table):
            tail = table[registered:]
            _any(map(ref.__setitem__, tail, _repeat(0)))
            self._free.extend(reversed(tail))
        if registered > keyed:
            self._segment -= 1
            self._free_cached[self._segment] = table[keyed:registered]
            self._dead_extra += registered - keyed - 1
            self._num_segments += 1
        if keyed:
            self.free(table[:keyed])
        return True

    def free(self, table: Sequence[int]) -> None:
        """Drop one reference to every page of `table` (tail first). The caller drops the table itself."""
        ref, key = self.ref_count, self.page_key
        if len(table) > 1 and not self._key_to_page:
            # No page holds a prefix-cache entry: a page whose last reference goes returns to the uncached stack.
            # The common case, every page held once, in C-level passes.
            if _getter(*table)(ref).count(1) == len(table):
                self._free.extend(reversed(table))
                _any(map(ref.__setitem__, table, _repeat(0)))
                return
        for p in reversed(table):
            c = ref[p] - 1
            ref[p] = c
            if c == 0:
                if key[p] is None:
                    self._free.append(p)
                else:
                    self._free_cached[p] = None
            elif c < 0:
                raise RuntimeError(f"page {p} freed more often than allocated")

    # ---- prefix caching
    def match_prefix(self, keys: Sequence, max_pages: int) -> List[int]:
        """Pages caching the longest prefix of `keys` (at most `max_pages`); takes no reference."""
        hits = []
        get = self._key_to_page.get
        for i in range(min(max_pages, len(keys))):
            p = get(keys[i])
            if p is None:
                break
            hits.append(p)
        return hits

    def holds_first_page(self, req) -> bool:
        """Whether an admission of `req` could hit now: the prefix cache or the host tier (this instance's copy
        included, with hot-block replication) holds its first page (an admission looks up at most
        (tokens - 1) // page_size pages). Touches nothing."""
        if len(req.all_token_ids) <= self.page_size:
            return False
        keys = request_page_keys(req, self.page_size, 1)
        return keys[0] in self._key_to_page or (self.host_tier is not None
                                                and self.host_tier.count_prefix(keys, 0, 1, self.tier_owner) > 0)

    # ---- host KV tier
    def match_host(self, keys: Sequence, start: int, max_pages: int) -> list:
        """Host-tier slots of the longest run keys[start:max_pages] (after a device match of `start` pages)."""
        if self.host_tier is None or start >= max_pages:
            return []
        return self.host_tier.lookup(keys, start, max_pages, self.tier_owner)

    def load_from_host(self, table: List[int], keys: Sequence, slots: Sequence) -> None:
        """Append one fresh page per host slot to `table` (they hold keys[len(table) - ...]: the pages right after
        the table's current ones), register them in the prefix cache and record the host -> device copies. The
        caller checks `num_free_pages >= len(slots)`."""
        start = len(table)
        self.allocate(table, len(slots))
        self.register(table, keys, start, start + len(slots))
        self.pending_swap_in += zip(slots, table[start:])
        self.num_host_hit_pages += len(slots)
        self.num_remote_hit_pages += sum(1 for s in slots if s[0] != self.tier_owner)
        if self.host_tier.replicate_after:
            fetched = self.host_tier.fetched_remote
            self._copies_due += [(keys[i], table[i]) for i, s in enumerate(slots, start)
                                 if s[0] != self.tier_owner and fetched(keys[i], self.tier_owner)]

    def drain_tier_copies(self, out) -> None:
        """Move the pending host-tier copies into SchedulerOutput `out` (the runner makes them before its step).
        Replication: the copies of pages the previous output loaded (HostKVTier.replicate) go out with this one
        (device -> host, like offloads); those `out` loads wait for the next output, their data is not on the
        device before its step."""
        if self._copies_next:
            replicate, owner = self.host_tier.replicate, self.tier_owner
            made = [(replicate(key, owner), page) for key, page in self._copies_next]
            self.pending_swap_out += [(s, p) for s, p in made if s is not None]
        self._copies_next, self._copies_due = self._copies_due, []
        if self.pending_swap_out:
            out.swap_out += self.pending_swap_out
            self.pending_swap_out = []
        if self.pending_swap_in:
            out.swap_in += self.pending_swap_in
            self.pending_swap_in = []

    def num_free_among(self, pages: Iterable[int]) -> int:
        """How many of `pages` are free (cached, refcount 0): taking them lowers the free count."""
        ref = self.ref_count
        return sum(1 for p in pages if ref[p] == 0)

    def take_cached(self, table: List[int], pages: Sequence[int]) -> None:
        """Append cache-hit `pages` to `table`, taking a reference to each."""
        ref = self.ref_count
        for p in pages:
            if ref[p] == 0:
                del self._free_cached[p]
            ref[p] += 1
            table.append(p)
        self.num_cache_hit_pages += len(pages)

    def register(self, table: Sequence[int], keys: Sequence, start: int, stop: int) -> None:
        """Offer full pages table[start:stop] (KV computed, keys[i] their prefix keys) to the prefix cache."""
        k2p, page_key = self._key_to_page, self.page_key
        for i in range(start, stop):
            p = table[i]
            if page_key[p] is None:
                k = keys[i]
                if k not in k2p:
                    k2p[k] = p
                    page_key[p] = k

    def uncache(self, pages: Iterable[int]) -> None:
        """Drop the prefix-cache entries of free `pages` (their KV is being overwritten: a request whose logits
        went non-finite left NaN in them); they become plain free pages. Pages in use are refused."""
        for p in pages:
            if self.ref_count[p] != 0:
                raise RuntimeError(f"uncache of page {p}, which is in use (refcount {self.ref_count[p]})")
            key = self.page_key[p]
            if key is not None:
                del self._key_to_page[key]
                del self._free_cached[p]
                self.page_key[p] = None
                self._free.append(p)

    # ---- swapping
    def swap_out(self, table: Sequence[int]) -> Tuple[List[int], List[Tuple[int, int]]]:
        """Move `table`'s pages to host slots: returns (slots, [(host_slot, device_page)]) and frees the pages.

        The caller checks `num_free_host_pages >= len(table)`."""
        if len(table) > len(self._free_host):
            raise RuntimeError(f"swap_out of {len(table)} pages with {len(self._free_host)} free host slots")
        slots = [self._free_host.pop() for _ in table]
        copies = list(zip(slots, table))
        self.free(table)
        return slots, copies

    def swap_in(self, slots: Sequence[int], table: List[int]) -> List[Tuple[int, int]]:
        """Allocate one device page per host slot into empty `table`; frees the slots; returns the copies."""
        if table:
            raise RuntimeError("swap_in into a non-empty page table")
        self.allocate(table, len(slots))
        self._free_host.extend(reversed(slots))
        return list(zip(slots, table))

    def free_host(self, slots: Sequence[int]) -> None:
        self._free_host.extend(reversed(slots))

    # ---- invariants
    def check_invariants(self, tables: Iterable[Sequence[int]] = (), host_tables: Iterable[Sequence[int]] = ()
                         ) -> None:
        """Raise AssertionError unless the accounting holds for the given live page tables and host slots.

        free + used = total; every free page has refcount 0 and sits in exactly one free list; a cached free
        page's key maps back to it; refcounts equal the number of tables holding each page; a page held by
        several tables (or twice) is a registered full page (shared read-only); host slots are owned once. A dead
        segment's pages (free_dead) count as cached free pages without keys (refcount 1, its last holder's).
        """
        n = self.num_pages
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a page is twice on the free stack"
        dead = [p for seg in self._free_cached.values() if seg is not None for p in seg]
        segments = [t for t, seg in self._free_cached.items() if seg is not None]
        assert len(segments) == self._num_segments and all(t < 0 for t in segments), "dead segments miscounted"
        assert len(dead) - len(segments) == self._dead_extra, "dead segment pages miscounted"
        dead_set = set(dead)
        cached_set = {p for p, seg in self._free_cached.items() if seg is None} | dead_set
        assert len(cached_set) == len(self._free_cached) + self._dead_extra, "a cached page is twice in the LRU"
        assert not (free_set & cached_set), f"pages on both free lists: {sorted(free_set & cached_set)[:8]}"
        holders = [0] * n
        for t in tables:
            for p in t:
                assert 0 <= p < n, f"page {p} out of range [0, {n})"
                holders[p] += 1
        assert all(self.ref_count[p] == 1 for p in dead), "a dead page's refcount is not its last holder's 1"
        for p in range(n):
            r = 0 if p in dead_set else self.ref_count[p]
            assert r == holders[p], f"page {p}: refcount {r} but held by {holders[p]} tables"
            if r == 0:
                assert (p in free_set) != (p in cached_set), f"free page {p} is on no free list or on both"
            else:
                assert p not in free_set and p not in cached_set, f"page {p} is used (ref {r}) and free"
            if r > 1:
                assert self.page_key[p] is not None, f"page {p} shared by {r} holders but not a cached full page"
            if p in cached_set:
                assert (self.page_key[p] is None) == (p in dead_set), f"page {p}: cached free, key / dead mismatch"
            if p in free_set:
                assert self.page_key[p] is None, f"page {p} on the uncached free stack with a key"
        assert self.num_free_pages + sum(1 for r in self.ref_count if r > 0) - len(dead) == n, "free + used != total"
        for k, p in self._key_to_page.items():
            assert self.page_key[p] == k, f"key of page {p} does not map back to it"
        assert sum(1 for k in self.page_key if k is not None) == len(self._key_to_page), "stale page keys"
        host_free = set(self._free_host)
        assert len(host_free) == len(self._free_host), "a host slot is twice on the free stack"
        owned = [s for t in host_tables for s in t]
        assert len(set(owned)) == len(owned), "a host slot is owned twice"
        assert not (host_free & set(owned)), "a host slot is owned and free"
        assert len(owned) + len(host_free) == self.num_host_pages, "host slots lost"
