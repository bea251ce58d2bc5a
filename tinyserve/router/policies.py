"""Routing policies: which live backend gets a request, and the reason, for the router's span.

A policy is an object with `async choose(request, backends) -> Choice` (backends: the ones
up now, never empty) and `forwarded(request, choice)`, told as the request goes out, before
any answer (the next request may be chosen meanwhile).
round_robin and least_load are here; prefix-aware, which needs the backends' KV cache
events, is prefix_aware.py.
"""

import itertools
from dataclasses import dataclass, field

from tinyserve.router.backends import Backend

POLICIES = ("round_robin", "least_load", "prefix-aware")


@dataclass
class RoutedRequest:
    path: str  # /v1/chat/completions, /v1/completions
    body: dict  # the JSON the client sent
    facts: dict = field(default_factory=dict)  # what a policy worked out, for its span (prefix hashes ...)


@dataclass
class Choice:
    backend: Backend
    reason: str  # one line: why this one (the router span's tinyserve.router.reason)
    attributes: dict = field(default_factory=dict)  # the policy's own span attributes


class RoundRobin:
    """Each request to the next live backend in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    async def choose(self, request: RoutedRequest, backends: list[Backend]) -> Choice:
        backend = backends[next(self._turn) % len(backends)]
        return Choice(backend, f"turn {backend.index} of {len(backends)}")

    def forwarded(self, request: RoutedRequest, choice: Choice) -> None:
        pass


class LeastLoad:
    """The backend with the fewest requests waiting there (its latest ORCA report) plus the router's
    own in flight there; ties go to the lower KV cache usage, then to the first listed."""

    name = "least_load"

    async def choose(self, request: RoutedRequest, backends: list[Backend]) -> Choice:
        return least_loaded(backends)

    def forwarded(self, request: RoutedRequest, choice: Choice) -> None:
        pass


def least_loaded(backends: list[Backend], why: str = "") -> Choice:
    backend = min(backends, key=Backend.load)
    waiting, usage, _, _ = backend.load()
    return Choice(backend, f"{why}least loaded: {waiting:g} waiting or in flight, KV usage {usage:.2f}")
