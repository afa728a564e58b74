"""Host-memory KV tier: prefix-cached pages evicted from an instance's device pool live on in host memory (no JAX).

Mooncake (FAST'25) keeps a KV cache pool in host DRAM: a block the device drops is kept in host memory, and a
later request whose prefix hits it loads it back instead of recomputing it. pdjax's reading:
- A `HostKVTier` holds up to `capacity` pages (blocks of page_size tokens) keyed by their prefix-cache key
  (pdjax.scheduler.block_manager: the bytes of the parent key's hash and of the page's token ids, so a hit compares
  the page's token ids exactly and a hash collision alone never serves another prompt's KV). Each entry has a slot
  `(owner, index)`: `owner` the name of the instance that offloaded it (whose host memory holds it), `index` its
  place in the tier. Slots are tuples so they never collide with the int slots of swap preemption; the runner's
  host store keeps both (pdjax.runtime.runner.ModelRunner.swap).
- Eviction: 'lru' (least recently offloaded or hit first) or 'lfu' (fewest hits first, ties least recent).
- A tier is local (one per instance: `deployment.host_kv_pool='local'`) or shared by every instance of a
  deployment ('shared': Mooncake's global pool; a hit on a page another instance offloaded is a remote fetch over
  the KV link, priced by the simulator as such, pdjax.sim.kv_tier).
- The tier is inclusive: a page loaded back keeps its host copy (a later eviction of the device page costs no
  second copy: `offload` only touches the entry).
- Dead pages (pdjax.scheduler.block_manager: a finished request's with numbered keys, which no lookup can reach):
  `offload_dead(n, owner)` takes their slots as n offloads of new keys would, kept as one entry (token < 0 ->
  (owner, indices, the oldest last)) that LRU evictions take from page by page (`_pop_oldest`; a dead offload
  that finds only dead entries least recent takes their slots in one pass, `_dead_slots`); 'lru' only.
- Hot-block replication (`replicate_after=N` > 0, a shared pool's `deployment.host_kv_replicate_after`; Mooncake
  replicates hot blocks to avoid hotspots): the N-th remote fetch of a key by one instance (`fetched_remote`, the
  block manager's load_from_host) makes it due for a copy in that instance's part of the pool; `replicate(key,
  owner)` then gives the copy its own slot (owner, index), entered as the entry `(COPY, key, owner)`, taking
  capacity and evicted like any entry (its own LRU position / LFU hits). Lookup (`lookup`, `count_prefix`,
  `owners`) by an owner prefers its copy, else the key's primary entry; another owner's copy is never served (a
  copy belongs to its owner's part). The primary entry is evicted independently of its copies; an offload of the
  key by a copy's owner while no primary is held makes that copy the primary (same slot, nothing copied).
The block manager calls `offload(key, owner)` for every prefix-cached page it evicts and `lookup(keys, start,
stop)` after a device prefix match; the copies it records go into the next SchedulerOutput's swap_out / swap_in.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from operator import itemgetter
from typing import Dict, List, Optional, Sequence, Tuple


from pdjax.config.deployment import HOST_KV_EVICTIONS, HOST_KV_POOLS
from pdjax.scheduler.block_manager import dead_segments

__all__ = ["COPY", "HOST_KV_EVICTIONS", "HOST_KV_POOLS", "HostKVTier", "host_kv_blocks"]

_INDICES = itemgetter(1)   # an entry's slot (owner, index): its index, a dead entry's list of them
COPY = object()     # first item of a replica's entry key (COPY, key, owner): equal to no prefix-cache key


class HostKVTier:
    """Up to `capacity` host pages keyed by prefix-cache key; `eviction` 'lru' or 'lfu' (module docstring).
    Counters: offloads (copies made), hits (pages found by lookup), remote_hits (found in another owner's
    memory, for a shared tier), evictions; with replicate_after > 0 also replicas (copies made by replicate) and
    copy_hits (hits served by the caller's own copy)."""

    def __init__(self, capacity: int, eviction: str = "lru", replicate_after: int = 0):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"host KV tier capacity={capacity!r}, expected a positive number of pages")
        if eviction not in HOST_KV_EVICTIONS:
            raise ValueError(f"host KV tier eviction={eviction!r}, expected one of {HOST_KV_EVICTIONS}")
        self.capacity, self.eviction = capacity, eviction
        # key -> slot, least recent first: an OrderedDict, whose first entry is O(1) however many were removed
        # before it (a dict's next(iter(d)) skips the holes its front deletions leave)
        self._slot: "OrderedDict[object, Tuple[str, int]]" = OrderedDict()
        self._hits: Dict[object, int] = {}                 # lfu: key -> hit count
        self._heap: list = []                              # lfu: (hits, tick, key), stale entries skipped
        self._tick = itertools.count()
        self._free: List[int] = list(range(capacity - 1, -1, -1))
        self.num_offloads = self.num_hits = self.num_remote_hits = self.num_evictions = 0
        # dead segments (offload_dead): token (< 0) -> (owner, [indices, the oldest last]) entries of _slot
        self._segment = self._num_segments = self._dead_extra = 0
        self.num_dead_offloads = 0       # of num_offloads, dead pages' (offload_dead)
        if isinstance(replicate_after, bool) or not isinstance(replicate_after, int) or replicate_after < 0:
            raise ValueError(f"host KV tier replicate_after={replicate_after!r}, expected remote fetches >= 0 "
                             "(0 = no replication)")
        self.replicate_after = replicate_after
        self._fetches: Dict[Tuple[object, str], int] = {}    # (key, fetcher) -> remote fetches (replication)
        self.num_replicas = self.num_copy_hits = 0

    def __len__(self) -> int:
        return len(self._slot) + self._dead_extra

    def __contains__(self, key) -> bool:
        return key in self._slot

    def _touch(self, key) -> None:
        if self.eviction == "lru":
            self._slot.move_to_end(key)
        else:
            self._hits[key] += 1
            heapq.heappush(self._heap, (self._hits[key], next(self._tick), key))

    def _evict_one(self) -> int:
        self.num_evictions += 1
        if self.eviction == "lru":
            return self._pop_oldest(1)[0]
        while True:
            hits, _, key = heapq.heappop(self._heap)
            if key in self._slot and self._hits[key] == hits:
                break
        del self._hits[key]
        return self._slot.pop(key)[1]

    def offload(self, key, owner: str) -> Optional[Tuple[str, int]]:
        """A device page with prefix key `key` is evicted on instance `owner`: the slot to copy it into, or None
        when the tier holds the key already (the entry is touched, nothing is copied)."""
        if self.replicate_after and (COPY, key, owner) in self._slot:
            if key in self._slot:
                self._touch((COPY, key, owner))
            else:
                self._promote(key, owner)
            return None
        if key in self._slot:
            self._touch(key)
            return None
        index = self._free.pop() if self._free else self._evict_one()
        slot = (owner, index)
        self._slot[key] = slot
        if self.eviction == "lfu":
            self._hits[key] = 0
            heapq.heappush(self._heap, (0, next(self._tick), key))
        self.num_offloads += 1
        return slot

    def offload_many(self, keys: Sequence, owner: str) -> List[Optional[Tuple[str, int]]]:
        """[offload(key, owner) for key in keys] (a block manager's evictions, in eviction order:
        pdjax.scheduler.block_manager.BlockManager._evict); in one pass for 'lru' when the keys are new and
        distinct (none is touched, nor popped by another's eviction)."""
        slots = self._slot
        if (self.eviction == "lru" and not self.replicate_after and 1 < len(keys) <= len(self._free) + len(self)
                and slots.keys().isdisjoint(keys)):
            new = dict.fromkeys(keys)
            if len(new) == len(keys):     # new distinct keys, none popped by another's eviction: in one pass
                out = [(owner, i) for i in self._take_slots(len(keys))]
                slots.update(zip(new, out))
                self.num_offloads += len(out)
                return out
        return [self.offload(key, owner) for key in keys]

    def offload_runs(self, keys: Sequence, runs: Sequence[int], owner: str, slots: bool = True
                     ) -> Optional[List[Optional[Tuple[str, int]]]]:
        """offload_many(keys) where `runs` splits keys into consecutive runs: n > 0 keys, or -n dead pages (None
        keys: offload_dead), in order. slots=False: returns None (the caller records no copies)."""
        if len(runs) == 1 and runs[0] > 0:
            out = self.offload_many(keys, owner)
            return out if slots else None
        out, pos = [], 0
        for n in runs:
            if n > 0:
                out += self.offload_many(keys[pos:pos + n], owner)
                pos += n
            else:
                indices = self._offload_dead(-n, owner, slots)
                if slots:
                    out += [(owner, i) for i in indices]
                pos -= n
        return out if slots else None

    def offload_dead(self, n: int, owner: str, slots: bool = True) -> Optional[List[Tuple[str, int]]]:
        """The slots of `n` pages no lookup can reach any more (a finished request's with numbered keys:
        pdjax.scheduler.block_manager.BlockManager.free_dead), offloaded in order as offload() of n new keys would
        (each takes a free slot, else the least recent entry's), kept as one entry (LRU only). slots=False:
        returns None."""
        indices = self._offload_dead(n, owner, slots)
        return [(owner, i) for i in indices] if slots else None

    def _offload_dead(self, n: int, owner: str, want: bool = True) -> Optional[List[int]]:
        """offload_dead's slot indices, in offload order (None may stand for them when not `want`)."""
        if self.eviction != "lru":
            raise ValueError("offload_dead needs an 'lru' tier (an 'lfu' one orders pages by their hits)")
        capacity = self.capacity
        kept = self._dead_slots(n) if not self._free and self._num_segments and n < capacity else None
        if kept is not None:          # the n least recent slots, all dead pages', taken in one pass
            indices = kept[::-1] if want else None
            self.num_evictions += n
        else:
            indices = self._take_slots(min(n, len(self._free) + len(self)))
            self.num_evictions += n - len(indices)
            while len(indices) < n:   # more pages than the tier holds: each evicts the new one `capacity` before
                indices.append(indices[len(indices) - capacity])
            kept = indices[:-capacity - 1:-1]     # the last `capacity`, tail first
        self._segment -= 1
        self._slot[self._segment] = (owner, kept)
        self._dead_extra += len(kept) - 1
        self._num_segments += 1
        self.num_offloads += n
        self.num_dead_offloads += n
        return indices

    def _dead_slots(self, n: int) -> Optional[List[int]]:
        """_take_slots(n) when no slot is free and the n least recent slots are all dead pages' (offload_dead's
        entries; the common case): the entries they fill dropped, the last one's oldest slots taken (the rest
        stays in place). Returns the n indices as a dead entry keeps them (tail first); None, having done nothing,
        when a live entry is among them."""
        slots = self._slot
        found = dead_segments(map(_INDICES, slots.values()), n)
        if found is None:
            return None
        full, part, held = found
        segment = []
        if part is not None:
            segment = part[held - n:]
            del part[held - n:]
        pop = slots.popitem
        for whole in reversed(full):
            pop(False)
            segment += whole
        self._dead_extra -= n - len(full)
        self._num_segments -= len(full)
        return segment

    def _take_slots(self, k: int) -> List[int]:
        """The indices k offloads of new keys take, in order (k <= free indices + entries): free ones, then the
        least recent entries' (their entries dropped, counted as evictions)."""
        free = self._free
        take = min(k, len(free))
        indices = free[:-take - 1:-1] if take else []
        if take:
            del free[-take:]
        if k > take:
            pop = self._slot.popitem
            indices += self._pop_oldest(k - take) if self._num_segments else [pop(False)[1][1]
                                                                              for _ in range(k - take)]
            self.num_evictions += k - take
        return indices

    def _pop_oldest(self, k: int) -> List[int]:
        """The indices of the k least recent pages, their entries dropped (a dead segment partly taken keeps the
        rest at the front, in place: the common case is part of the oldest entry). The caller counts the
        evictions."""
        slots = self._slot
        pop = slots.popitem
        out: List[int] = []
        while len(out) < k:
            index = next(iter(slots.values()))[1]
            if index.__class__ is not list:
                out.append(index)
                pop(last=False)
                continue
            m = k - len(out)
            if m < len(index):
                out += index[:-m - 1:-1]
                del index[-m:]
                self._dead_extra -= m
            else:
                out += index[::-1]
                pop(last=False)
                self._dead_extra -= len(index) - 1
                self._num_segments -= 1
        return out

    def lookup(self, keys: Sequence, start: int, stop: int, owner: str = "") -> List[Tuple[str, int]]:
        """Slots of the longest run keys[start:stop] held here (each hit is touched and counted; a slot of another
        owner than `owner` counts as a remote hit). With replication, `owner`'s own copy of a key first."""
        if self.replicate_after:
            return self._lookup_copies(keys, start, stop, owner)
        get = self._slot.get
        slots = []
        for i in range(start, min(stop, len(keys))):
            slot = get(keys[i])
            if slot is None:
                break
            self._touch(keys[i])
            slots.append(slot)
            self.num_remote_hits += slot[0] != owner
        self.num_hits += len(slots)
        return slots

    def _lookup_copies(self, keys: Sequence, start: int, stop: int, owner: str) -> List[Tuple[str, int]]:
        """lookup() where `owner` may hold copies (module docstring: its copy first, else the primary)."""
        get = self._slot.get
        slots = []
        for i in range(start, min(stop, len(keys))):
            entry = (COPY, keys[i], owner)
            slot = get(entry)
            if slot is None:
                entry = keys[i]
                slot = get(entry)
                if slot is None:
                    break
            else:
                self.num_copy_hits += 1
            self._touch(entry)
            slots.append(slot)
            self.num_remote_hits += slot[0] != owner
        self.num_hits += len(slots)
        return slots

    def count_prefix(self, keys: Sequence, start: int, stop: int, owner: str = "") -> int:
        """How many of keys[start:stop] (a consecutive run from start) are held for `owner` (its copies count
        with replication), touching nothing (routers)."""
        n = 0
        slot = self._slot
        copies = self.replicate_after
        for i in range(start, min(stop, len(keys))):
            if keys[i] not in slot and not (copies and (COPY, keys[i], owner) in slot):
                break
            n += 1
        return n

    def owners(self, keys: Sequence, start: int, stop: int, owner: str = "") -> List[str]:
        """The owner of each slot lookup(..., owner) would return for the run count_prefix counts (routers price
        remote pages)."""
        n = self.count_prefix(keys, start, stop, owner)
        if not self.replicate_after:
            return [self._slot[keys[i]][0] for i in range(start, start + n)]
        slot = self._slot
        return [owner if (COPY, keys[i], owner) in slot else slot[keys[i]][0] for i in range(start, start + n)]

    # ---- hot-block replication (module docstring)
    def fetched_remote(self, key, owner: str) -> bool:
        """`owner` loaded `key` from another owner's slot: True when this is its replicate_after-th such fetch
        (the key is then due for a copy: replicate). Counters of keys no longer held are dropped now and then."""
        if not self.replicate_after:
            return False
        n = self._fetches.get((key, owner), 0) + 1
        if n >= self.replicate_after:
            self._fetches.pop((key, owner), None)
            return True
        self._fetches[(key, owner)] = n
        if len(self._fetches) > 4 * self.capacity:
            held = self._slot
            self._fetches = {k: v for k, v in self._fetches.items() if k[0] in held}
        return False

    def replicate(self, key, owner: str) -> Optional[Tuple[str, int]]:
        """A copy of `key` in `owner`'s part of the pool: the slot to copy its data into (taking a free slot, else
        evicting as offload does), or None when `owner` holds it already (its copy or the primary: touched)."""
        entry = (COPY, key, owner)
        if entry in self._slot:
            self._touch(entry)
            return None
        primary = self._slot.get(key)
        if primary is not None and primary[0] == owner:
            self._touch(key)
            return None
        index = self._free.pop() if self._free else self._evict_one()
        slot = self._slot[entry] = (owner, index)
        if self.eviction == "lfu":
            self._hits[entry] = 0
            heapq.heappush(self._heap, (0, next(self._tick), entry))
        self.num_replicas += 1
        return slot

    def _promote(self, key, owner: str) -> None:
        """`owner`'s copy of `key` becomes its primary entry (no primary is held), touched."""
        self._slot[key] = self._slot.pop((COPY, key, owner))
        if self.eviction == "lfu":
            self._hits[key] = self._hits.pop((COPY, key, owner))
        self._touch(key)


def host_kv_blocks(blocks: int, gib: float, page_bytes: int) -> int:
    """Pages of a host tier given as `blocks` pages or `gib` GiB (one of them non-zero) of pages of `page_bytes`
    bytes each (all layers, K and V, one instance's share)."""
    if blocks:
        return blocks
    if gib <= 0:
        return 0
    if page_bytes <= 0:
        raise ValueError(f"host KV tier of {gib} GiB: page size of {page_bytes} bytes, expected > 0")
    return max(1, int(gib * 2 ** 30 // page_bytes))


def attach_host_tiers(groups: Dict[str, Sequence], dep, page_bytes: int) -> List[HostKVTier]:
    """Give the instances of each group (role -> instances; the deployment's groups of its kind) the host KV tier
    `dep` (a DeploymentConfig) asks for: `deployment.<group>.host_kv_blocks` (or `host_kv_gib`, of pages of
    `page_bytes` bytes) pages per instance, each its own tier ('local') or one tier of all their pages ('shared'),
    `host_kv_eviction` order. Decode instances take the prefix they hold on a handoff when
    `dep.partial_transfer` (pdjax.scheduler.policies.DecodeOnlyScheduler.reuse_prefix). Returns the tiers made."""
    sizes = {}
    for role, instances in groups.items():
        g = dep.group(role)
        blocks = host_kv_blocks(g.host_kv_blocks, g.host_kv_gib, page_bytes)
        if blocks:
            sizes.update((id(inst), (inst, blocks)) for inst in instances)
        if dep.partial_transfer and role == "decode":
            for inst in instances:
                inst.scheduler.reuse_prefix = True
    if not sizes:
        return []
    if dep.host_kv_pool == "shared":
        tiers = [HostKVTier(sum(b for _, b in sizes.values()), dep.host_kv_eviction,
                            dep.host_kv_replicate_after)]
        members = [(inst, tiers[0]) for inst, _ in sizes.values()]
    else:
        members = [(inst, HostKVTier(b, dep.host_kv_eviction)) for inst, b in sizes.values()]
        tiers = [t for _, t in members]
    for inst, tier in members:
        bm = inst.scheduler.block_manager
        bm.host_tier, bm.tier_owner = tier, inst.name
    return tiers
