"""The engine's paged KV cache on the host (EngineConfig.page_size): how many pages the pool has,
which pages each request holds, the page tables the device reads and the prefix cache
(`SlotPages`, over serve/pages.py's `PagePool`).

A row holds pages for what it has committed and what the next chunk may write: its length, a
chunk's steps of at most `step_tokens` committed tokens each, and one verify pass past them
(`row_slots`); the engine grows each row to that before every chunk, and a row that cannot grow
preempts the newest running request (engine.py). Slots past what a row holds map to the null
page (models/cache.py), where a pass's stale writes land unread.

With prefix caching, a request's prompt takes the cached full pages it begins with (never its
last token, whose logits its prefill must compute) and its prefill starts after them
(engine_batch.py, `prefill_pages`); once prefilled, its prompt's full pages are offered to the
cache (`register`), and, where the proposer reads no features of the target, the pages its
generated tokens fill too.
"""

from __future__ import annotations

import numpy as np

from specjax.checks import is_int
from specjax.models.cache import NULL_PAGE, cache_bytes
from specjax.models.config import LlamaConfig
from specjax.planner import available_memory_bytes
from specjax.serve.engine_batch import PagedLayout
from specjax.serve.engine_config import EngineConfig
from specjax.serve.pages import PagePool
from specjax.speculate.spec import LoopSpec


def paged_layout(config: EngineConfig, spec: LoopSpec, groups: int = 1) -> PagedLayout | None:
    """The engine's pool and tables (None for a dense cache): `spec.capacity` slots a row (a
    multiple of the page size), and the pool EngineConfig sizes, which must hold one request of
    max_model_len alone (so that the oldest running request can always go on). On a mesh of
    `groups` data groups each group holds an equal part of the pool, its own null page among them,
    and every request of its slots takes its pages there: each group's part must hold one."""
    P = spec.page_size
    if P is None:
        return None
    width = spec.capacity // P
    itemsize = np.dtype(spec.cache_dtype).itemsize
    pages = pool_pages(
        spec.config,
        P,
        itemsize,
        config.num_pages,
        config.kv_cache_memory,
        default=config.max_batch * width,
        groups=groups,
    )
    asked = (
        f"num_pages={config.num_pages}"
        if config.num_pages is not None
        else f"kv_cache_memory={config.kv_cache_memory!r}"
    )
    if pages % groups:
        raise ValueError(
            f"{asked}: on a mesh of {groups} data groups the pool splits into equal parts, one a group; "
            f"give a multiple of {groups} pages"
        )
    needed = -(-(config.max_model_len + spec.num_drafted + 1) // P)  # a row's most: _row_slots
    per_group = pages // groups
    if per_group < needed:
        n = max(per_group, 0)
        what = f"a pool of {n} pages of {P} slots ({n * P} tokens)"
        if groups > 1:
            what = (
                f"a data group's part of the pool, {n} pages of {P} slots ({n * P} tokens; {pages} over "
                f"{groups} groups),"
            )
        raise ValueError(
            f"{asked}: {what} cannot hold one request of max_model_len={config.max_model_len} ({needed} "
            "pages with its verify pass); give the pool more, or a smaller max_model_len"
        )
    return PagedLayout(page_size=P, num_pages=pages + groups, table_width=width, groups=groups)


def pool_pages(
    config: LlamaConfig,
    page_size: int,
    itemsize: int,
    num_pages: int | None,
    kv_cache_memory: int | float | None,
    default: int,
    groups: int = 1,
) -> int:
    """Pages in the pool besides the null pages (one per data group of `groups`): `num_pages`, or
    as many as `kv_cache_memory` holds (bytes, or a fraction in (0, 1] of the device's free
    memory; a multiple of `groups`), else `default`."""
    if num_pages is not None:
        return num_pages
    if kv_cache_memory is None:
        return default
    page_bytes = cache_bytes(config, 1, page_size, itemsize)
    budget = kv_cache_memory
    if not is_int(kv_cache_memory):  # a fraction of the free memory
        free = available_memory_bytes()
        if free is None:
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory!r}: this device does not report its free memory; "
                "give the bytes (an integer) or num_pages"
            )
        budget = int(kv_cache_memory * free)
    pages = int(budget // page_bytes) - groups  # (the null pages come out of the budget too)
    return pages - pages % groups


class DenseRows:
    """A dense KV cache's report (what `SlotPages` says of a paged one): `max_batch` rows of
    `spec.capacity` slots, each request's own."""

    prefix_counts = (0, 0)  # (no prefix cache)

    def __init__(self, config: EngineConfig, spec: LoopSpec):
        self.max_batch, self.max_model_len = config.max_batch, config.max_model_len
        self.capacity_tokens = config.max_batch * config.max_model_len
        self.bytes = cache_bytes(
            spec.config, config.max_batch, spec.capacity, np.dtype(spec.cache_dtype).itemsize
        )

    def summary(self) -> str:
        """What the cache holds, for a server's start."""
        rows = f"{self.max_batch} slots of at most {self.max_model_len:,} tokens"
        gib = self.bytes / (1 << 30)
        return f"KV cache: dense, {rows} each ({self.capacity_tokens:,} tokens, {gib:.2f} GiB)"

    def usage(self, num_running: int) -> float:
        """The cache in use, 0 to 1: the slots taken."""
        return num_running / self.max_batch

    def reset_prefix_cache(self) -> None:
        """(Nothing to forget.)"""


class SlotPages:
    """The pages of `max_batch` slots' rows in the pool of `layout` (its null page among them),
    each row's table `layout.table_width` pages wide. On a mesh of data groups (`layout.groups`),
    slot b belongs to group b // (max_batch / groups), each group's part of the pool is a
    `PagePool` of its own (its page ids local to it, its own prefix cache), and a request takes
    its pages in the group of the slot it is admitted into (`group_of_slot`): the rows of one
    group never read another's pages."""

    def __init__(self, layout: PagedLayout, config: EngineConfig, spec: LoopSpec):
        page_size, table_width, max_batch = layout.page_size, layout.table_width, config.max_batch
        self.max_batch, self.max_model_len = max_batch, config.max_model_len
        itemsize = np.dtype(spec.cache_dtype).itemsize
        self.bytes = cache_bytes(spec.config, layout.num_pages, page_size, itemsize)  # the pool's
        self.pools = [
            PagePool(layout.group_pages, page_size, prefix_caching=config.prefix_caching)
            for _ in range(layout.groups)
        ]
        self.slots_per_group = max_batch // layout.groups
        self.step_tokens = spec.num_drafted + 1  # the most a step commits, and what it writes
        self.page_size, self.table_width = page_size, table_width
        self.tables = np.full((max_batch, table_width), NULL_PAGE, np.int32)
        self.request_of: list[int | None] = [None] * max_batch
        self._group: dict[int, int] = {}  # request id -> the data group holding its pages
        self.changed = False  # tables differ from the device's since the last `take_changed`

    @property
    def capacity_tokens(self) -> int:
        """The most tokens the running requests may hold together (one request: a group's
        pool's `capacity_tokens`)."""
        return sum(pool.capacity_tokens for pool in self.pools)

    def summary(self) -> str:
        """What the cache holds, for a server's start: "KV cache: 512 pages of 16 slots, 8,192
        tokens (0.36 GiB); 8 slots of at most 2,048 tokens" (on data groups, "2 data groups of
        256 pages of 16 slots, ...")."""
        pool, gib = self.pools[0], self.bytes / (1 << 30)
        groups = "" if len(self.pools) == 1 else f"{len(self.pools)} data groups of "
        return (
            f"KV cache: {groups}{pool.usable_pages:,} pages of {pool.page_size} slots, "
            f"{self.capacity_tokens:,} tokens ({gib:.2f} GiB); {self.max_batch} slots of at most "
            f"{self.max_model_len:,} tokens"
        )

    def usage(self, num_running: int) -> float:
        """The cache in use, 0 to 1: the pages requests hold."""
        usable = sum(pool.usable_pages for pool in self.pools)
        return sum(pool.usable_pages - pool.available_pages for pool in self.pools) / usable

    @property
    def prefix_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, of them the tokens found there)."""
        return sum(pool.queries for pool in self.pools), sum(pool.hits for pool in self.pools)

    def reset_prefix_cache(self) -> None:
        """Forget what the prefix cache holds: later prompts are prefilled whole until their pages
        are cached again."""
        for pool in self.pools:
            pool.reset_cache()

    def group_of_slot(self, slot: int) -> int:
        """The data group of slot `slot` (0 off a data-parallel mesh)."""
        return slot // self.slots_per_group

    def group_of(self, request_id: int) -> int:
        """The data group holding a request's pages."""
        return self._group[request_id]

    def cached_tokens(self, prompt, group: int | None = None) -> int:
        """How many of the prompt's tokens the prefix cache holds now (full pages; never its last
        token, whose logits the prefill must compute), without taking them: in `group`'s pool, or
        (None) the most any group's holds."""
        pools = self.pools if group is None else [self.pools[group]]
        found = max(len(pool.cached_prefix(prompt, max_tokens=len(prompt) - 1)) for pool in pools)
        return found * self.page_size

    def slot_choices(self, free: list[int], prompt) -> list[int]:
        """The free slots (of `free`, in order) a request with this prompt may take, best first:
        one per data group, the group whose prefix cache holds most of it first, then those
        whose pools have the most pages available (the first free slot where there is one
        group). The engine takes the first whose group's pool has its pages now."""
        if len(self.pools) == 1:
            return free[:1]
        first = {}  # group -> its first free slot
        for slot in free:
            first.setdefault(self.group_of_slot(slot), slot)

        def merit(group):
            return (-self.cached_tokens(prompt, group), -self.pools[group].available_pages, group)

        return [first[group] for group in sorted(first, key=merit)]

    def row_slots(self, slot, steps: int, request=None) -> int:
        """The slots a running row (`slot`, an engine_rows.Running) or a request about to be
        admitted (`slot` None) holds for a chunk of `steps` steps: what they may commit (a verify
        pass's drafts and the target's token each, up to the request's last token) and the slots
        one more verify pass writes past them."""
        width, request = self.step_tokens, request or slot.request
        length = len(request.prompt) + 1 if slot is None else slot.reported
        return min(length + steps * width, len(request.prompt) + request.max_new_tokens) + width

    def take(
        self, request_id: int, request, running, steps: int, group: int, cached: bool = True
    ) -> int | None:
        """Pages in data group `group` for a request about to be prefilled, for its prompt and its
        first chunk of `steps`, leaving the group's `running` rows ((slot, Running) pairs) what
        they grow by in their next chunk: how many of its prompt's tokens the prefix cache gave
        (its prefill starts there), or None (it waits) where the pool has too few. A request
        whose prompt is scored (prompt_logprobs) takes no cached pages: its one-pass prefill
        scores every token; nor does one with `cached` False."""
        mine = [(i, slot) for i, slot in running if self.group_of_slot(i) == group]
        reserve = sum(self.growth(i, self.row_slots(slot, steps)) for i, slot in mine)
        slots = self.row_slots(None, steps, request)
        cached = cached and request.prompt_logprobs is None
        return self.admit(request_id, request.prompt, slots, reserve, cached=cached, group=group)

    def admit(
        self, request_id: int, prompt, slots: int, reserve: int = 0, cached: bool = True, group: int = 0
    ) -> int | None:
        """Pages in data group `group` holding `slots` slots for a request, the cached pages its
        prompt begins with first (unless not `cached`), leaving `reserve` pages available (what
        the running rows grow by in the next chunk: a request admitted into the pages they need
        would be preempted at once). Returns how many prompt tokens the cached pages hold (its
        prefill starts there); None, nothing taken, where the pool has too few."""
        pool = self.pools[group]
        slots = min(slots, self.table_width * self.page_size)
        if pool.pages_for(slots) + reserve > pool.available_pages:
            return None
        limit = len(prompt) - 1 if cached else 0
        admission = pool.admit(request_id, prompt, slots, max_cached_tokens=limit)
        if admission is None:
            return None
        self._group[request_id] = group
        return admission.cached_tokens

    def place(self, slot: int, request_id: int) -> None:
        """The request's row now in slot `slot` (its pages in the slot's table), a slot of the
        group holding its pages."""
        assert self.group_of_slot(slot) == self._group[request_id], (slot, request_id)
        self.request_of[slot] = request_id
        self._set(slot)

    def table_of(self, request_id: int) -> np.ndarray:
        return self._pool_of(request_id).table(request_id, self.table_width)

    def register(self, request_id: int, tokens) -> None:
        """Offer the request's full pages holding `tokens` (the first of its committed tokens) to
        the prefix cache."""
        self._pool_of(request_id).register(request_id, tokens)

    def drop(self, request_id: int) -> None:
        """The pages of a request that holds no slot (a prompt in chunks, aborted) given back."""
        group = self._group.pop(request_id, None)
        if group is not None:
            self.pools[group].release(request_id)

    def grow(self, slot: int, slots: int) -> bool:
        """Slot `slot`'s row grown to hold `slots` slots (at most its table's); False where the
        pool has too few pages."""
        request_id = self.request_of[slot]
        added = self._pool_of(request_id).grow(request_id, min(slots, self.table_width * self.page_size))
        if added is None:
            return False
        if added:
            self._set(slot)
        return True

    def release(self, slot: int) -> None:
        """The row's pages given back (its request finished, was aborted or preempted); its table
        null, so that the finished row's writes land in the null page."""
        request_id, self.request_of[slot] = self.request_of[slot], None
        if request_id is not None:
            self.drop(request_id)
        self.tables[slot] = NULL_PAGE
        self.changed = True

    def move(self, source: int, slot: int) -> None:
        """The row of slot `source` now in slot `slot` (the device moved its table with it), both
        of one group."""
        assert self.group_of_slot(source) == self.group_of_slot(slot), (source, slot)
        self.request_of[slot], self.request_of[source] = self.request_of[source], None
        self.tables[slot], self.tables[source] = self.tables[source], NULL_PAGE
        self.changed = True

    def growth(self, slot: int, slots: int) -> int:
        """The pages slot `slot`'s row lacks to hold `slots` slots."""
        request_id = self.request_of[slot]
        if request_id is None:  # admitted this step, not yet placed: it holds its first chunk's
            return 0
        pool = self._pool_of(request_id)
        slots = min(slots, self.table_width * self.page_size)
        return max(0, pool.pages_for(slots) - len(pool.pages(request_id)))

    def take_changed(self, width: int) -> np.ndarray | None:
        """The first `width` tables where they changed since the last call, else None."""
        if not self.changed:
            return None
        self.changed = False
        return self.tables[:width].copy()

    def _pool_of(self, request_id: int) -> PagePool:
        return self.pools[self._group[request_id]]

    def _set(self, slot: int) -> None:
        self.tables[slot] = self.table_of(self.request_of[slot])
        self.changed = True
