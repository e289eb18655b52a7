"""How the engine admits waiting requests into its slots (specjax/serve/engine.py, whose class
`Engine` this mixin's methods are part of, reading its attributes): a short prompt's prefill in
one pass (several packed together on pages the kernel reads in place), a long one's chunks between
the running rows' chunks, a row handed over by a prefiller (handoff.py), and on a paged cache the
pages each needs, with the newest request preempted when the pool runs out."""

from __future__ import annotations

import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from specjax.serve.engine_config import Request
from specjax.serve.engine_rows import COUNTERS, PromptInChunks, Restart, Running
from specjax.serve.handoff import HandoffError
from specjax.sharding import fetch
from specjax.speculate.logprobs import Logprobs


class Admissions:
    """The admission half of `Engine` (module docstring)."""

    def _admit_waiting(self) -> None:
        """Admit what waits into free slots (`_take_waiting`), then prefill together the prompts
        that wait for it (`_prefill_pending`)."""
        self._take_waiting()
        self._prefill_pending()

    def _take_waiting(self) -> None:
        """Admit what waits into free slots, first come first served: a prompt of at most
        `prefill_chunk` tokens in one pass, a longer one in chunks. One long prompt is in chunks
        at a time; its chunks run one per step while other rows run (back to back when none
        does), and it takes a free slot when its last chunk has run; shorter prompts behind it
        are admitted meanwhile (on pages the kernel reads in place, their passes shared)."""
        ran_chunk = False
        while True:
            free = [b for b, slot in enumerate(self._slots) if slot is None]
            if self._in_chunks is None and free:
                self._in_chunks = self._start_long_prompt(free)
            prompt = self._in_chunks
            while prompt is not None and not prompt.complete and not (ran_chunk and self.num_running):
                self._run_chunk(prompt)
                self.stats.prompt_chunks += 1
                ran_chunk = True
            if prompt is not None and prompt.complete:
                b = self._slot_for_chunked(prompt.request_id, free)
                if b is not None and self._fits(b, prompt.request):  # (its pages it holds since
                    # its first chunk)
                    self._in_chunks = None
                    self._admit(b, prompt.request_id, prompt.request, prompt.partial)
                    self.stats.admissions += 1
                    continue
            short = next((i for i, (j, r) in enumerate(self._waiting) if self._short(j, r)), None)
            if not free or short is None:
                return
            request_id, request = self._waiting[short]
            if not self._fits(free[0], request):
                return  # it waits (first in line) until running requests with other automata finish
            b, cached = self._take_slot(request_id, request, free)
            if cached is None:
                return  # (or until a pool has its pages)
            del self._waiting[short]
            row = None
            if self._handoffs.has(request_id):  # its row, made elsewhere (handoff.py)
                try:
                    row = self._batch.placed_row(self._handoffs.take(request_id))
                except (HandoffError, ValueError) as error:
                    warnings.warn(f"request {request_id}: {error}", RuntimeWarning, stacklevel=2)
                    self._failed.append(self._final(request_id, [], "error", None))
                    if self._pages is not None:
                        self._pages.drop(request_id)
                    continue
            self._admit(b, request_id, request, cached=cached, prefilled=row)
            self.stats.admissions += 1

    def _take_slot(self, request_id: int, request: Request, free: list[int]) -> tuple[int, int | None]:
        """(the free slot a request is admitted into, how many of its prompt's tokens the prefix
        cache gave it there): paged, the first of `SlotPages.slot_choices` whose data group has
        its pages now; None for the tokens where no group has them (it waits)."""
        choices = free[:1] if self._pages is None else self._pages.slot_choices(free, request.prompt)
        for b in choices:
            cached = self._take_pages(request_id, request, b)
            if cached is not None:
                return b, cached
        return choices[0], None

    def _slot_for_chunked(self, request_id: int, free: list[int]) -> int | None:
        """The free slot a prompt whose chunks have run goes into: the first (paged: the first of
        the data group holding its pages), None where there is none."""
        if self._pages is not None:
            group = self._pages.group_of(request_id)
            free = [b for b in free if self._pages.group_of_slot(b) == group]
        return free[0] if free else None

    def _short(self, request_id: int, request: Request) -> bool:
        """Whether a waiting request is admitted in one step: its prompt in one pass, or its row
        arrived from a prefiller (one still on its way waits, the others passing it)."""
        if self._handoffs.has(request_id):
            return not self._handoffs.waits_for(request_id)
        return not self._long(request)

    def _long(self, request: Request) -> bool:
        """Whether the request's prompt is prefilled in chunks (EngineConfig.prefill_chunk; paged,
        what the prefix cache does not hold of it); not one whose prompt is scored
        (prompt_logprobs: the scoring runs in the one-pass prefill)."""
        if self._chunk is None or request.prompt_logprobs is not None:
            return False
        cached = 0 if self._pages is None else self._pages.cached_tokens(request.prompt)
        return len(request.prompt) - cached > self._chunk

    def _start_long_prompt(self, free: list[int]) -> PromptInChunks | None:
        """The first waiting long prompt, taken out of the queue before its first chunk (None if
        none waits); paged, its pages taken in the data group of the slot it would take of the
        `free` ones now (it takes one of that group's when its chunks have run)."""
        at = next(
            (i for i, (j, r) in enumerate(self._waiting) if self._long(r) and not self._handoffs.has(j)), None
        )
        if at is None:
            return None
        request_id, request = self._waiting[at]
        if self._pages is not None:  # its pages from its first chunk on (the chunks write there)
            _, cached = self._take_slot(request_id, request, free)
            if cached is None:
                return None
            del self._waiting[at]
            return PromptInChunks(request_id, request, None, self._chunk, done=cached)
        del self._waiting[at]
        partial = self._batch.run("start_prompt", self._chunk, self._params)
        return PromptInChunks(request_id, request, partial, self._chunk)

    def _run_chunk(self, prompt: PromptInChunks) -> None:
        """The next chunk of the long prompt in chunks: into its dense partial row, or its pages."""
        if self._pages is None:
            args = (self._params, prompt.partial, *prompt.next_chunk())
            prompt.partial = self._batch.run("prompt_chunk", self._chunk, *args)
            return
        request_id = prompt.request_id
        table, group = self._pages.table_of(request_id), self._pages.group_of(request_id)
        prompt.partial = self._batch.prefill_pages(
            table, prompt.request.prompt, prompt.done, 1, prompt.partial, group
        )
        prompt.done += self._chunk

    def _admit(
        self, b: int, request_id: int, request: Request, partial=None, cached: int = 0, prefilled=None
    ) -> None:
        """Prefill the request into slot b (one compiled program per prompt bucket), or, for a
        long prompt whose chunks have run (`partial`), make its row from them. Paged, into the
        pages it holds from `cached` on (the end of its cached prefix)."""
        sampling = request.sampling
        if self._stops is not None and not self._stops.has(sampling.stop):  # (before the slot
            # changes: it may refuse)
            states = np.asarray(fetch(self._batch.state.stop_states))
            moved = self._stops.grow(self._running_stop_strings(b), sampling.stop, states)
            self._batch.replace(stop_states=jnp.asarray(moved))
        start = -1 if sampling.constraint is None else self._constraints.acquire(sampling.constraint)
        self._samplings[b] = sampling
        self._slots[b] = Running(
            request_id,
            request,
            self._stop_ids(request),
            reported=len(request.prompt),
            tokens=[],
            seen={name: 0 for name in COUNTERS},
            started=time.perf_counter(),
            constraint_start=start,
            admitted=next(self._admitted),
        )
        restart = self._restarts.pop(request_id, None)
        if restart is not None:
            self._slots[b].resend, self._slots[b].updated = restart.tokens, restart.reported
        self._inputs.changed()
        n = len(request.prompt)
        bucket = self._bucket(n) if partial is None else min(1 << (n - 1).bit_length(), self.spec.capacity)
        # (scored, or made by a prefiller: a dense row, copied into its pages)
        paged = self._pages is not None and request.prompt_logprobs is None and prefilled is None
        if paged:
            bucket = self._bucket(n)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :n] = request.prompt
        row = self._inputs.row(b, padded, n, request.max_new_tokens, request_id, request.key)
        if paged and partial is None and self._batch.packs:  # with the others admitted beside it
            self._pending.append((b, request_id, request, cached, row, bucket))
            return
        if paged:  # its chunks into its pages (those a long prompt's steps have not run), its row
            table, group = self._pages.table_of(request_id), self._pages.group_of(request_id)
            if partial is None:
                count = -(-(n - cached) // self._batch.page_chunk)
                partial = self._batch.prefill_pages(table, request.prompt, cached, count, group=group)
            row = self._batch.pages_row(bucket, table, partial, row, group)
        elif partial is None and request.prompt_logprobs is not None:  # scored in its one pass
            row = self._batch.run("scored_prefill", bucket, self._params, self._proposer_params, row)
            scored = fetch(row.prompt_logprobs)  # (the running state keeps none)
            if not self._slots[b].updated:  # (a restarted request sent them already)
                self._slots[b].prompt_logprobs = Logprobs.of_row(scored, request.prompt[1:], 0, 0).first(
                    request.prompt_logprobs
                )
            row = row.replace(prompt_logprobs=None)
        elif prefilled is not None:  # (a prefiller's)
            row = prefilled
        elif partial is None:
            row = self._batch.run("prefill", bucket, self._params, self._proposer_params, row)
        else:
            row = self._batch.run("finish_prompt", bucket, self._params, self._proposer_params, partial, row)
        register = prefilled is None or not self.spec.proposer_reads_features
        self._place_row(b, request_id, request, row, paged, register)

    def _place_row(
        self, b: int, request_id: int, request: Request, row, paged: bool, register: bool = True
    ) -> None:
        """A request's prefilled row into slot b (paged: its cache in its pages already, or with
        `paged` False a dense row copied into them). Its prompt's full pages go into the prefix
        cache, except a handed-over row's where the proposer reads features: those the feature
        pool does not hold (only this engine's prefills put them there): `register` False."""
        width = min(w for w in self._widths if w > b)
        self._batch.resize(max(width, self._batch.width))
        if self._pages is None:
            self._batch.write(row, b)
            return
        self._pages.place(b, request_id)
        self._batch.write(row, b, None if paged else self._pages.table_of(request_id))
        if register:
            self._pages.register(request_id, request.prompt)  # its prompt's full pages, for later hits

    def _prefill_pending(self) -> None:
        """The prompts admitted in this step on pages the kernel reads in place, prefilled
        together (their tokens packed into the same passes), then each one's row."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        tables = np.stack([self._pages.table_of(request_id) for _, request_id, *_ in pending])
        prompts, starts = [p[2].prompt for p in pending], [p[3] for p in pending]
        last = self._batch.prefill_packed(tables, prompts, starts)
        for i, (b, request_id, request, _, row, bucket) in enumerate(pending):
            hidden = jax.lax.dynamic_slice_in_dim(last, jnp.int32(i), 1)
            self._place_row(
                b, request_id, request, self._batch.pages_row(bucket, tables[i], hidden, row), True
            )

    # ----- pages (EngineConfig.page_size) -----------------------------------------------------

    def _take_pages(self, request_id: int, request: Request, b: int) -> int | None:
        """Pages for a request about to be prefilled for slot b (`SlotPages.take`, in b's data
        group): how many of its prompt's tokens the prefix cache gave, or None (it waits); 0 for
        a dense cache."""
        if self._pages is None:
            return 0
        running = [(i, slot) for i, slot in enumerate(self._slots) if slot is not None]
        # (a handed-over row brings its whole cache: it takes no cached pages, which it would write)
        cached = not self._handoffs.has(request_id)
        group = self._pages.group_of_slot(b)
        return self._pages.take(request_id, request, running, self.chunk_steps, group, cached)

    def _grow_rows(self, steps: int) -> None:
        """Pages for every running row's next chunk of `steps` steps, oldest request first; where
        the pool has too few, the newest running request is preempted (`_preempt`) until they fit,
        and before the last running one, a prompt part-way through its chunks (queued first again,
        its chunks to run again); on data groups, the newest of the row's group, whose pool it is.
        The oldest always fits alone (a group's pool holds one request of max_model_len:
        engine_pages.py)."""
        pages = self._pages
        for b in sorted((i for i, s in enumerate(self._slots) if s is not None), key=self._age):
            slot = self._slots[b]  # (None: preempted for an older row's pages)
            group = pages.group_of_slot(b)
            while (
                slot is not None
                and slot is self._slots[b]
                and not pages.grow(b, pages.row_slots(slot, steps))
            ):
                mine = [
                    i for i, s in enumerate(self._slots) if s is not None and pages.group_of_slot(i) == group
                ]
                newest = max(mine, key=self._age)
                chunks = self._in_chunks
                if newest == b and chunks is not None and pages.group_of(chunks.request_id) == group:
                    # a prompt in chunks goes first
                    prompt, self._in_chunks = self._in_chunks, None
                    self._pages.drop(prompt.request_id)
                    self._waiting.appendleft((prompt.request_id, prompt.request))
                    self.stats.preemptions += 1
                    continue
                self._preempt(newest)

    def _age(self, b: int) -> int:
        return self._slots[b].admitted

    def _preempt(self, b: int) -> None:
        """Take slot b's request out of the batch, its pages freed, and queue it first to start
        again from its prompt (`Restart`: what it reported is regenerated, not sent twice)."""
        slot = self._slots[b]
        sent = slot.tokens if len(slot.tokens) > len(slot.resend) else slot.resend
        self._restarts[slot.request_id] = Restart(list(sent), slot.updated)
        self._waiting.appendleft((slot.request_id, slot.request))
        self._batch.finish_row(b)
        self._free(b)
        self.stats.preemptions += 1
