"""Prometheus metrics of the server (prometheus_client, one registry per app): requests by
endpoint and status, tokens (prompt, cached, completion), DFlash drafts and acceptances, time to
first token, and, read at scrape time, KV pages by state, running and waiting requests, queued
HTTP requests and live sessions."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentflash.usage import Usage


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("agentflash_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("agentflash_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("agentflash_cached_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.completion_tokens = Counter("agentflash_completion_tokens", "Generated tokens",
                                         registry=r)
        self.draft_tokens = Counter("agentflash_draft_tokens", "DFlash draft tokens verified",
                                    registry=r)
        self.accepted_tokens = Counter("agentflash_accepted_tokens",
                                       "DFlash draft tokens accepted", registry=r)
        self.ttft = Histogram("agentflash_time_to_first_token_seconds",
                              "Submitted to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.kv_pages = Gauge("agentflash_kv_pages", "KV pool pages by state", ["state"],
                              registry=r)
        self.engine_requests = Gauge("agentflash_engine_requests",
                                     "Engine requests running or waiting for KV", ["state"],
                                     registry=r)
        self.queue = Gauge("agentflash_http_requests_in_flight",
                           "Generation requests the server holds", registry=r)
        self.sessions = Gauge("agentflash_sessions", "Sessions with pinned KV", registry=r)

    def count(self, usage: Usage) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.prompt_tokens_details.cached_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        self.draft_tokens.inc(usage.speculative.draft_tokens)
        self.accepted_tokens.inc(usage.speculative.accepted_tokens)
        self.ttft.observe(usage.timing.ttft_s)

    def render(self, stats: dict[str, int], in_flight: int, sessions: int) -> bytes:
        """The text exposition, with the gauges set from `stats` (Runtime.stats())."""
        for state in ("total", "free", "pinned", "referenced", "cached"):
            self.kv_pages.labels(state).set(stats[f"pages_{state}"])
        self.engine_requests.labels("running").set(stats["running"])
        self.engine_requests.labels("waiting").set(stats["waiting"])
        self.queue.set(in_flight)
        self.sessions.set(sessions)
        return generate_latest(self.registry)


CONTENT_TYPE: str = "text/plain; version=0.0.4; charset=utf-8"
