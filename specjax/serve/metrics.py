"""The server's Prometheus metrics (/metrics), named as vLLM names them.

vLLM exposes its metrics as `vllm:<name>` with a `model_name` label; these are the same names
and labels with the prefix `specjax:` (e.g. `specjax:spec_decode_num_accepted_tokens_total`).
The prefix says which server produced a series: a Prometheus that scrapes a vLLM and a specjax
server side by side, to compare them, keeps the two apart by name, and a vLLM dashboard or
script reads specjax's numbers by changing the prefix alone. `make_app(..., metrics_prefix=
"vllm:")` gives vLLM's exact names for tools that cannot change it.

Each app has a registry of its own (not prometheus_client's global one), so several apps in one
process, as in the tests, do not clash.

    num_requests_running, num_requests_waiting     gauges: the engine's slots in use, its queue
    kv_cache_usage_perc                            gauge: the KV cache in use, 0 to 1 (a paged
                                                   engine's pages held; a dense one's slots)
    num_preemptions                                counter: requests preempted for their pages
    prefix_cache_queries, prefix_cache_hits        counters: prompt tokens looked up in the prefix
                                                   cache, and of them the tokens found there
    request_success{finished_reason}               counter: finished requests (stop, length, abort)
    request_overloaded                             counter: requests refused with 503, max_waiting
                                                   waiting already (specjax's own; vLLM has none)
    prompt_tokens, generation_tokens               counters: prompt tokens admitted, tokens generated
    time_to_first_token_seconds                    histogram: arrival to the first token
    inter_token_latency_seconds                    histogram: between two tokens (see observe_tokens)
    e2e_request_latency_seconds                    histogram: arrival to the last token
    spec_decode_num_drafts                         counter: drafting steps (a row with >= 1 draft)
    spec_decode_num_draft_tokens                   counter: tokens drafted
    spec_decode_num_accepted_tokens                counter: drafts accepted
    spec_decode_num_accepted_tokens_per_pos{position}  counter: drafts accepted at each position
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds; a CPU serves tiny models in milliseconds and real ones in tenths of a second a token,
# an accelerator in milliseconds: the buckets span both.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class ServerMetrics:
    """The metrics of one app, labelled with the served model's name. Thread-safe (prometheus_client's
    own locks): the scheduler thread updates them, the /metrics route reads them."""

    def __init__(self, model_name: str, prefix: str = "specjax:"):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def metric(kind, name, doc, extra=(), **options):
            return kind(prefix + name, doc, labels + list(extra), registry=self.registry, **options)

        self.running = metric(Gauge, "num_requests_running", "Requests in the engine's slots.")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests waiting for a slot.")
        self.cache_usage = metric(Gauge, "kv_cache_usage_perc", "KV cache in use (1: all of it).")
        self.preemptions = metric(Counter, "num_preemptions", "Requests preempted as the KV cache ran out.")
        self.prefix_queries = metric(
            Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}  # the engine's, at the last set_cache
        self.success = metric(
            Counter, "request_success", "Finished requests by finish reason.", ["finished_reason"]
        )
        self.overloaded = metric(
            Counter, "request_overloaded", "Requests refused (HTTP 503) as max_waiting requests waited."
        )
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated.")
        self.ttft = metric(
            Histogram, "time_to_first_token_seconds", "Time to the first token.", buckets=TTFT_BUCKETS
        )
        self.itl = metric(
            Histogram, "inter_token_latency_seconds", "Time between two tokens.", buckets=LATENCY_BUCKETS
        )
        self.e2e = metric(
            Histogram, "e2e_request_latency_seconds", "Arrival to the last token.", buckets=E2E_BUCKETS
        )
        self.num_drafts = metric(Counter, "spec_decode_num_drafts", "Drafting steps.")
        self.num_draft_tokens = metric(Counter, "spec_decode_num_draft_tokens", "Tokens drafted.")
        self.num_accepted_tokens = metric(Counter, "spec_decode_num_accepted_tokens", "Drafts accepted.")
        self.accepted_per_pos = metric(
            Counter,
            "spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted at each draft position.",
            ["position"],
        )
        for gauge in (self.running, self.waiting, self.cache_usage):
            gauge.labels(model_name).set(0)
        for counter in (
            self.overloaded,
            self.preemptions,
            self.prefix_queries,
            self.prefix_hits,
            self.prompt_tokens,
            self.generation_tokens,
            self.num_drafts,
        ):
            counter.labels(model_name)  # listed from the start, at 0
        self.num_draft_tokens.labels(model_name)
        self.num_accepted_tokens.labels(model_name)

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)

    def set_cache(self, usage: float, preemptions: int, queries: int = 0, hits: int = 0) -> None:
        """The engine's KV cache in use (0 to 1), and its counts since it started: preemptions, and
        the prompt tokens its prefix cache was asked for and found."""
        self.cache_usage.labels(self.model_name).set(usage)
        for name, counter, now in (
            ("preemptions", self.preemptions, preemptions),
            ("queries", self.prefix_queries, queries),
            ("hits", self.prefix_hits, hits),
        ):
            if now > self._seen[name]:
                counter.labels(self.model_name).inc(now - self._seen[name])
                self._seen[name] = now

    def rejected(self) -> None:
        """A request refused because the waiting queue was full."""
        self.overloaded.labels(self.model_name).inc()

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def observe_tokens(self, num_tokens: int, since_arrival: float, since_last: float | None) -> None:
        """`num_tokens` committed together, `since_arrival` seconds after the request arrived and
        `since_last` after its previous tokens (None: these are its first). A chunk of the
        compiled loop commits many tokens at once, so each of them is counted at the mean
        interval, since_last / num_tokens (the first token's at the time to first token)."""
        if num_tokens <= 0:
            return
        self.generation_tokens.labels(self.model_name).inc(num_tokens)
        itl = self.itl.labels(self.model_name)
        if since_last is None:
            self.ttft.labels(self.model_name).observe(since_arrival)
            gaps, between = num_tokens - 1, since_arrival  # tokens after the first, in that time
        else:
            gaps, between = num_tokens, since_last
        for _ in range(gaps):
            itl.observe(between / num_tokens)

    def finished(self, finish_reason: str, since_arrival: float) -> None:
        self.success.labels(self.model_name, finish_reason).inc()
        self.e2e.labels(self.model_name).observe(since_arrival)

    def speculated(self, num_drafts: int, num_draft_tokens: int, num_accepted: int, per_pos) -> None:
        """One Update's speculative counts (deltas since the request's previous Update)."""
        self.num_drafts.labels(self.model_name).inc(num_drafts)
        self.num_draft_tokens.labels(self.model_name).inc(num_draft_tokens)
        self.num_accepted_tokens.labels(self.model_name).inc(num_accepted)
        for position, count in enumerate(per_pos):
            self.accepted_per_pos.labels(self.model_name, str(position)).inc(count)

    def exposition(self) -> tuple[bytes, str]:
        """(the Prometheus text, its content type) for /metrics."""
        return prometheus_client.generate_latest(self.registry), prometheus_client.CONTENT_TYPE_LATEST
