"""The page pool's host side (specjax/serve/pages.py): allocation, the prefix cache's keys, sharing,
eviction, copy on write, and a long random run checked against a simulated device pool, whose
pages hold the tokens written into them: a row must always read its own tokens back, and a cached
page must always hold what its key says."""

import random

import numpy as np
import pytest

from specjax.serve.pages import NULL_PAGE, PagePool, page_keys


def test_keys_chain_over_full_pages():
    a = page_keys(list(range(10)), 4)
    assert len(a) == 2  # the last 2 tokens are no full page
    assert a == page_keys(list(range(8)), 4)  # a page's key reads no later token
    b = page_keys([0, 1, 2, 3, 9, 5, 6, 7], 4)
    assert b[0] == a[0] and b[1] != a[1]
    c = page_keys([99, 1, 2, 3, 4, 5, 6, 7], 4)
    assert c[0] != a[0] and c[1] != a[1]  # page 1's tokens agree, but not what precedes them
    assert page_keys(list(range(8)), 4, salt=b"x") != a
    assert page_keys(list(range(8)), 8) != a[1:]


def test_admission_shares_cached_pages_and_counts_hits():
    pool = PagePool(num_pages=16, page_size=4)
    prompt = list(range(10))
    first = pool.admit("a", prompt, slots=14)
    assert first.cached_tokens == 0 and len(first.pages) == 4 and NULL_PAGE not in first.pages
    pool.register("a", prompt)  # pages 0 and 1 of the prompt are full
    second = pool.admit("b", prompt[:8] + [50, 51], slots=12)
    assert second.cached_tokens == 8 and second.pages[:2] == first.pages[:2]
    assert second.pages[2] not in first.pages
    assert (pool.queries, pool.hits) == (20, 8)
    pool.check()
    pool.release("a")
    pool.release("b")
    pool.check()
    third = pool.admit("c", prompt, slots=11)  # the shared pages are cached, held by nobody
    assert third.pages[:2] == first.pages[:2] and third.cached_tokens == 8
    pool.check()


def test_max_cached_tokens_keeps_pages_back():
    pool = PagePool(num_pages=8, page_size=4)
    pool.admit("a", list(range(8)), slots=9)
    pool.register("a", list(range(8)))
    assert pool.admit("b", list(range(8)), slots=9, max_cached_tokens=7).cached_tokens == 4
    assert pool.admit("c", list(range(8)), slots=9).cached_tokens == 8


def test_no_prefix_caching():
    pool = PagePool(num_pages=8, page_size=4, prefix_caching=False)
    pool.admit("a", list(range(8)), slots=9)
    pool.register("a", list(range(8)))
    assert pool.admit("b", list(range(8)), slots=9).cached_tokens == 0
    assert (pool.queries, pool.hits) == (0, 0)
    pool.check()


def test_eviction_is_least_recently_used_last_page_first():
    pool = PagePool(num_pages=7, page_size=2)  # 6 usable pages
    pool.admit("a", [1, 2, 3, 4, 5, 6], slots=6)
    pool.register("a", [1, 2, 3, 4, 5, 6])
    pages = pool.pages("a")
    pool.release("a")  # all three cached; the last page is evicted first
    pool.admit("b", [9, 9, 9, 9, 9, 9], slots=6)  # takes the 3 free pages
    pool.admit("c", [8, 8], slots=2)  # evicts one cached page: a's last
    assert pool.pages("c") == [pages[2]]
    assert pool.cached_prefix([1, 2, 3, 4, 5, 6]) == pages[:2]
    pool.check()


def test_running_out_takes_nothing_and_too_long_is_an_error():
    pool = PagePool(num_pages=5, page_size=4)  # 4 usable pages, 16 tokens
    assert pool.admit("a", [1] * 10, slots=12) is not None
    assert pool.admit("b", [2] * 6, slots=8) is None  # 2 needed, 1 left
    assert not pool.holds("b")
    assert pool.grow("a", 17) is None and len(pool.pages("a")) == 3
    assert pool.grow("a", 16) and len(pool.pages("a")) == 4
    pool.check()
    with pytest.raises(ValueError, match="17 token slots needs 5 pages of 4; the pool has 4 .16 tokens"):
        pool.admit("c", [1] * 17, slots=17)
    with pytest.raises(ValueError, match="already holds"):
        pool.admit("a", [1], slots=1)
    with pytest.raises(ValueError, match="num_pages=1"):
        PagePool(num_pages=1, page_size=4)


def test_copy_on_write_of_a_shared_page():
    pool = PagePool(num_pages=8, page_size=4)
    pool.admit("a", list(range(8)), slots=9)
    pool.register("a", list(range(8)))
    shared = pool.admit("b", list(range(8)), slots=9)
    assert shared.cached_tokens == 8
    copies = pool.make_writable("b", 7)  # b must rewrite slot 7, in a page a holds and the cache names
    assert copies == [(shared.pages[1], pool.pages("b")[1])] and pool.pages("b")[1] != shared.pages[1]
    assert pool.make_writable("b", 8) == []  # its last page is its own
    assert pool.cached_prefix(list(range(8))) == pool.pages("a")[:2]  # the cache still names a's page
    pool.check()


def test_a_page_the_cache_names_is_copied_before_its_own_holder_rewrites_it():
    pool = PagePool(num_pages=8, page_size=4)
    pool.admit("a", list(range(8)), slots=9)
    pool.register("a", list(range(8)))
    before = pool.pages("a")
    (copy,) = pool.make_writable("a", 4)
    assert copy[0] == before[1] and pool.pages("a") == [before[0], copy[1], before[2]]
    assert pool.cached_prefix(list(range(8))) == before[:2]
    pool.check()


def test_table_pads_with_the_null_page():
    pool = PagePool(num_pages=8, page_size=4)
    pool.admit("a", [1] * 5, slots=6)
    table = pool.table("a", 4)
    assert (
        table.dtype == np.int32 and list(table[2:]) == [NULL_PAGE] * 2 and list(table[:2]) == pool.pages("a")
    )
    with pytest.raises(ValueError, match="holds 2 pages; its table has 1"):
        pool.table("a", 1)


class Device:
    """A simulated device pool: the token each slot of each page holds (-1: never written)."""

    def __init__(self, pool: PagePool):
        self.slots = np.full((pool.num_pages, pool.page_size), -1, np.int64)
        self.page_size = pool.page_size

    def write(self, pages, start, tokens):
        for offset, token in enumerate(tokens):
            slot = start + offset
            self.slots[pages[slot // self.page_size], slot % self.page_size] = token

    def read(self, pages, length):
        return [int(self.slots[pages[s // self.page_size], s % self.page_size]) for s in range(length)]

    def copy(self, copies):
        for source, copy in copies:
            self.slots[copy] = self.slots[source]


@pytest.mark.parametrize("seed", range(4))
def test_random_run_against_a_simulated_device(seed):
    rng = random.Random(seed)
    pool = PagePool(num_pages=24, page_size=4)
    device = Device(pool)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    running = {}  # request -> its committed tokens
    order = []  # admission order, newest last: who is preempted
    preempted = served = 0
    for step in range(600):
        if rng.random() < 0.3 or not running:  # a new request, often sharing a prefix
            prompt = list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            request = f"r{step}"
            most = rng.choice([None, len(prompt) - 1])  # a whole prompt cached, or its last token not
            admission = pool.admit(request, prompt, slots=len(prompt) + 3, max_cached_tokens=most)
            if admission is None:
                continue
            cached = admission.cached_tokens
            assert device.read(admission.pages, cached) == prompt[:cached]  # a hit holds the prompt
            start = min(cached, len(prompt) - 1)  # the last prompt token is run again: its logits
            copies = pool.make_writable(request, start)
            if copies is None:
                pool.release(request)
                continue
            device.copy(copies)
            device.write(pool.pages(request), start, prompt[start:])
            running[request] = prompt
            order.append(request)
            pool.register(request, prompt)
        elif rng.random() < 0.15:  # a request ends
            request = rng.choice(sorted(running))
            pool.release(request)
            del running[request]
            order.remove(request)
            served += 1
        else:  # a running request commits 1-3 tokens, after a verify pass wrote 4 slots
            request = rng.choice(sorted(running))
            tokens = running[request]
            while pool.grow(request, len(tokens) + 4) is None:  # preempt the newest other
                victim = next(r for r in reversed(order) if r != request)
                pool.release(victim)
                del running[victim]
                order.remove(victim)
                preempted += 1
            copies = pool.make_writable(request, len(tokens))
            assert copies is not None
            device.copy(copies)
            drafts = [rng.randrange(50) for _ in range(4)]
            device.write(pool.pages(request), len(tokens), drafts)  # the pass writes them all
            kept = rng.randrange(1, 4)
            tokens.extend(drafts[:kept])
            pool.register(request, tokens)
        for request, tokens in running.items():  # every row reads its own tokens back
            assert device.read(pool.pages(request), len(tokens)) == tokens
        for tokens in [*running.values(), *prefixes]:  # a hit, now, would read its prompt's tokens
            hit = pool.cached_prefix(tokens)
            assert device.read(hit, len(hit) * 4) == tokens[: len(hit) * 4]
        pool.check()
    assert served and preempted and pool.hits > 0


def test_reset_cache_forgets_every_key():
    pool = PagePool(8, 4)
    tokens = list(range(12))
    pool.admit("a", tokens, 12)
    pool.register("a", tokens)
    pool.admit("b", tokens, 12)  # holds a's pages too
    pool.release("a")
    pool.reset_cache()
    pool.check()
    assert pool.cached_prefix(tokens) == []
    pool.release("b")
    pool.check()
    assert pool.available_pages == pool.usable_pages


def test_slot_pages_on_data_groups_keep_each_groups_pages_apart():
    """On a mesh of 2 data groups (engine_pages.SlotPages): slots 0-1 are group 0's, 2-3 group 1's;
    a request takes pages in its slot's group, named there (1..n-1: each group's page 0 is its own
    null page); each group's prefix cache is its own, and a request goes to the group that holds
    its prefix, else to the one with the most pages available (or, where that one has too few
    now, to the next)."""
    from types import SimpleNamespace

    from specjax.models.config import LlamaConfig
    from specjax.serve.engine_batch import PagedLayout
    from specjax.serve.engine_config import EngineConfig, Request
    from specjax.serve.engine_pages import SlotPages

    config = EngineConfig(max_batch=4, max_model_len=48, page_size=16)
    model = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1
    )
    spec = SimpleNamespace(config=model, cache_dtype="float32", num_drafted=0)  # what SlotPages reads
    pages = SlotPages(PagedLayout(page_size=16, num_pages=2 * 8, table_width=4, groups=2), config, spec)
    assert [pages.group_of_slot(b) for b in range(4)] == [0, 0, 1, 1]
    assert [pool.usable_pages for pool in pages.pools] == [7, 7]
    prompt = list(range(40))
    assert pages.slot_choices([0, 1, 2, 3], prompt) == [0, 2]  # (a tie: in order)
    assert pages.take(0, Request(prompt, max_new_tokens=4), [], 1, group=1) == 0
    pages.place(2, 0)
    table = pages.table_of(0)
    assert table[:3].tolist() == [1, 2, 3] and table[3] == NULL_PAGE  # group 1's own ids
    assert [pool.available_pages for pool in pages.pools] == [7, 4]
    pages.register(0, prompt)
    assert pages.cached_tokens(prompt, group=1) == 32 and pages.cached_tokens(prompt, group=0) == 0
    assert pages.slot_choices([0, 1, 3], prompt) == [3, 0]  # where its prefix is first
    assert pages.slot_choices([0, 1, 3], list(range(1, 41))) == [0, 3]  # no hit: the emptier first
    with pytest.raises(AssertionError):
        pages.place(0, 0)  # a slot of another group than its pages'
    pages.release(2)
    assert pages.tables[2].tolist() == [NULL_PAGE] * 4
    assert [pool.available_pages for pool in pages.pools] == [7, 7]  # (group 1's prefix cached)
    for pool in pages.pools:
        pool.check()
