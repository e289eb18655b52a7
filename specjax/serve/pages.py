"""The host's side of a paged KV cache: which pages of the device's pool each request holds, and
the prefix cache over them (`PagePool`).

The device holds a static pool of `num_pages` pages of `page_size` token slots per layer, and each
running row a page table (its pages in order: slot s of the row is slot s % page_size of page
table[s // page_size]). Every paged array of a row, the target's keys and values and whatever a
proposer keeps per position (a draft model's cache, the features an EAGLE head reads), is indexed
by the same page ids, so that one table and one allocation serve them all, and a page shared
through the prefix cache shares every one of them: a hit drafts as a miss does.

Page 0 is never handed out (`NULL_PAGE`): a table's entries past a row's pages, and the tables of
free slots, point at it, so that the stale writes a static-shaped pass makes there (a padding
row's, a verify pass's slots past what a row holds) land in a page nobody reads.

The prefix cache (vLLM's automatic prefix caching, written anew here): once a page is full, it is
keyed by its content, a hash chain over its tokens and every token before it (`page_keys`), and a
later request whose prompt begins with the same full pages takes them instead of prefilling them.
A page is shared read-only: it is reference-counted, a row never writes into a page it does not
own alone (`PagePool.make_writable` gives it a copy first), and a page no row holds stays cached,
still a hit, until a new page is needed and it is the least recently used (evicted then). Pages of
a released row are queued for eviction last page first, so that a prefix outlives its tails.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from specjax.models.cache import NULL_PAGE  # page 0, which no request holds (module doc)


def page_keys(
    tokens: Sequence[int], page_size: int, salt: bytes = b"", after: bytes | None = None, first: int = 0
) -> list[bytes]:
    """The content keys of the full pages of `tokens`: key i digests key i - 1 and page i's
    tokens, so equal keys mean equal tokens from the start (up to SHA-256 collisions). `salt` (a
    request's cache salt, or what else its pages' contents depend on: the model, an adapter)
    starts the chain, so differently salted prompts never share a page. The keys are the same in
    every process, which a prefill node handing pages to a decode node relies on. `after`, with
    `first`: the key of page first - 1, to go on the chain from page `first` (the keys of the
    pages from there)."""
    keys, key = [], hashlib.sha256(b"specjax-pages" + salt).digest() if after is None else after
    ids = np.asarray(tokens, dtype=np.int64)
    for start in range(first * page_size, len(ids) - page_size + 1, page_size):
        key = hashlib.sha256(key + ids[start : start + page_size].tobytes()).digest()
        keys.append(key)
    return keys


@dataclasses.dataclass
class Admission:
    """What `PagePool.admit` gave a request: its pages (its table's first entries, in order) and
    how many of its prompt's tokens they already hold (full cached pages: the prefill starts
    there)."""

    pages: list[int]
    cached_tokens: int


@dataclasses.dataclass
class _Held:
    """A request's pages in order, and how many of its first pages are settled for the prefix
    cache: taken from it at admission, or looked at by `PagePool.register` (keyed there, or left
    the request's own where another page holds the same content)."""

    pages: list[int]
    registered: int
    salt: bytes
    chain: list[bytes] = dataclasses.field(default_factory=list)  # its first pages' content keys


class PagePool:
    """The pages of a device pool of `num_pages` pages (`NULL_PAGE` among them) of `page_size`
    slots: free, held by requests (reference-counted), or cached (held by none, keyed, a hit
    until evicted). Every method either does all it says or, where pages run out, nothing (it
    returns None), so that the caller may preempt a request and try again."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the pool needs at least 2 (page 0 is the null page)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: a page holds at least 1 token slot")
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self._free = collections.deque(range(1, num_pages))  # pages nobody holds and no key names
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # page -> its content key, for keyed pages
        self._page_of: dict[bytes, int] = {}  # content key -> the page holding it
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._held: dict[object, _Held] = {}
        self.queries = 0  # prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.hits = 0  # of them, tokens found there (prefix_cache_hits)

    # ----- sizes -------------------------------------------------------------------------------

    @property
    def usable_pages(self) -> int:
        """Pages a request may hold: all but the null page."""
        return self.num_pages - 1

    @property
    def available_pages(self) -> int:
        """Pages a new allocation may take now: the free ones and the cached ones (evicted)."""
        return len(self._free) + len(self._cached)

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one request may hold: every usable page."""
        return self.usable_pages * self.page_size

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` slots."""
        return -(-tokens // self.page_size)

    def holds(self, request_id) -> bool:
        return request_id in self._held

    def pages(self, request_id) -> list[int]:
        """The request's pages, in table order."""
        return list(self._held[request_id].pages)

    def table(self, request_id, width: int) -> np.ndarray:
        """The request's page table as the device reads it: [width] int32, its pages then
        NULL_PAGE. ValueError where it holds more than `width` pages."""
        pages = self._held[request_id].pages
        if len(pages) > width:
            raise ValueError(f"request {request_id!r} holds {len(pages)} pages; its table has {width}")
        table = np.full((width,), NULL_PAGE, np.int32)
        table[: len(pages)] = pages
        return table

    # ----- the prefix cache ----------------------------------------------------------------------

    def cached_prefix(
        self, tokens: Sequence[int], salt: bytes = b"", max_tokens: int | None = None
    ) -> list[int]:
        """The cached pages holding the longest run of full pages that `tokens` begins with (and
        at most `max_tokens` tokens); nothing is taken or counted."""
        if not self.prefix_caching:
            return []
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        found = []
        for key in page_keys(tokens[: limit - limit % self.page_size], self.page_size, salt):
            page = self._page_of.get(key)
            if page is None:
                break
            found.append(page)
        return found

    # ----- requests' pages -----------------------------------------------------------------------

    def admit(
        self,
        request_id,
        prompt: Sequence[int],
        slots: int,
        salt: bytes = b"",
        max_cached_tokens: int | None = None,
    ) -> Admission | None:
        """Pages for a new request holding `slots` token slots (its prompt and what its first
        passes write past it), the cached full pages its `prompt` begins with first (at most
        `max_cached_tokens` of its tokens: the caller keeps back what it must compute, such as the
        last prompt token where nothing cached gives its logits). None, and nothing taken, where
        the pool cannot give what it needs now; ValueError where it never could."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds pages")
        needed = self.pages_for(max(slots, len(prompt)))
        if needed > self.usable_pages:
            raise ValueError(
                f"a request of {max(slots, len(prompt))} token slots needs {needed} pages of "
                f"{self.page_size}; the pool has {self.usable_pages} ({self.capacity_tokens} tokens)"
            )
        hits = self.cached_prefix(prompt, salt, max_cached_tokens)
        reused = [page for page in hits if self._refs[page] == 0]  # cached, counted as available
        if needed - len(hits) > self.available_pages - len(reused):
            return None
        for page in hits:
            self._take(page)
        pages = hits + [self._allocate() for _ in range(needed - len(hits))]
        self._held[request_id] = _Held(pages, registered=len(hits), salt=salt)
        if self.prefix_caching:
            self.queries += len(prompt)
            self.hits += len(hits) * self.page_size
        return Admission(pages=list(pages), cached_tokens=len(hits) * self.page_size)

    def grow(self, request_id, slots: int) -> list[int] | None:
        """The pages added so the request holds `slots` token slots (none where it already
        does); None, and nothing taken, where the pool has too few."""
        held = self._held[request_id]
        more = self.pages_for(slots) - len(held.pages)
        if more <= 0:
            return []
        if more > self.available_pages:
            return None
        added = [self._allocate() for _ in range(more)]
        held.pages.extend(added)
        return added

    def register(self, request_id, tokens: Sequence[int]) -> None:
        """Key the request's full pages that `tokens` (its committed tokens, prompt first) fill,
        so later requests may share them. A page whose content some other page is already cached
        under stays the request's own (the two hold the same tokens; one is enough)."""
        held = self._held[request_id]
        if not self.prefix_caching:
            return
        # The chain goes on from the last key computed (a row registers as it grows: hashing its
        # tokens from the start at every chunk would grow with its length).
        known = min(len(held.chain), held.registered)
        after = held.chain[known - 1] if known else None
        keys = held.chain[:known] + page_keys(tokens, self.page_size, held.salt, after, known)
        held.chain = keys
        for i in range(held.registered, min(len(keys), len(held.pages))):
            page, key = held.pages[i], keys[i]
            if key not in self._page_of:
                self._page_of[key], self._key_of[page] = page, key
        held.registered = max(held.registered, min(len(keys), len(held.pages)))

    def make_writable(self, request_id, first_slot: int) -> list[tuple[int, int]] | None:
        """Before a pass writes the request's slots from `first_slot` on: each of its pages there
        that others hold too, or that the prefix cache names, replaced by a fresh copy it owns.
        Returns the (source, copy) pages the device must copy; None, and nothing changed, where
        the pool has too few pages for the copies."""
        held = self._held[request_id]
        first = first_slot // self.page_size
        shared = [i for i in range(first, len(held.pages)) if self._shared(held.pages[i])]
        if len(shared) > self.available_pages:
            return None
        copies = []
        for i in shared:
            source, copy = held.pages[i], self._allocate()
            self._drop(source)
            held.pages[i] = copy
            copies.append((source, copy))
        held.registered = min(held.registered, first)
        return copies

    def release(self, request_id) -> None:
        """The request's pages given back (it finished, was aborted or is preempted): each held by
        nobody now is cached where keyed (its last pages queued for eviction first), free
        otherwise."""
        held = self._held.pop(request_id)
        for page in reversed(held.pages):
            self._drop(page)

    def reset_cache(self) -> None:
        """Forget every cached key (vLLM's reset_prefix_cache): pages nobody holds are free again,
        and held pages are their holders' alone; nothing later hits what was cached before."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._key_of.clear()
        self._page_of.clear()

    # ----- the pages themselves ------------------------------------------------------------------

    def _shared(self, page: int) -> bool:
        return self._refs[page] > 1 or page in self._key_of

    def _take(self, page: int) -> None:
        """One more holder of a cached or held page."""
        if self._refs[page] == 0:
            del self._cached[page]
        self._refs[page] += 1

    def _drop(self, page: int) -> None:
        """One holder fewer; a page held by nobody is cached (keyed) or free."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._key_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    def _allocate(self) -> int:
        """A page for one holder: a free one, or else the least recently used cached one, its
        key forgotten. The caller has checked that one is available."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._cached.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        self._refs[page] = 1
        return page

    def check(self) -> None:
        """AssertionError where the bookkeeping disagrees with itself (for tests): every page is
        exactly one of null, free, cached or held, with as many holders as requests hold it."""
        counts = collections.Counter(page for held in self._held.values() for page in held.pages)
        assert NULL_PAGE not in counts and NULL_PAGE not in self._free and NULL_PAGE not in self._cached
        assert len(set(self._free)) == len(self._free)
        for page in range(1, self.num_pages):
            places = (page in self._free) + (page in self._cached) + (counts[page] > 0)
            assert places == 1, (page, page in self._free, page in self._cached, counts[page])
            assert self._refs[page] == counts[page], (page, self._refs[page], counts[page])
            assert (page in self._cached) <= (page in self._key_of), page
        assert all(self._page_of[key] == page for page, key in self._key_of.items())
        assert len(self._page_of) == len(self._key_of)
