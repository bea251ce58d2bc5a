"""The router's health checks: every backend's GET /health, on a timer, in the router's event loop.

    every --health-check-interval-secs (10 s), all backends at once:
      GET /health, its status line within --health-check-timeout-secs (5 s)
        200                          → up (again); its failed checks back to 0
        anything else, or no answer  → one more failed check; --health-failure-threshold (3) in a row → down

The names are those of vLLM's router (and SGLang's). A request that fails at a backend marks it
down at once (proxy.py); only a check that succeeds brings it back. The router's own /health
reads these states, without asking anyone: 200 while a request can be served (any backend up; in
prefill/decode mode, a server of each pool), else 503 naming why each is down. The check reads a
status line and headers, never the body: a backend cannot make the router hold a large answer.
"""

import asyncio
import logging
from dataclasses import dataclass

import httpx

from tinyserve.router.backends import Backend
from tinyserve.router.defaults import (
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
    DEFAULT_HEALTH_CHECK_TIMEOUT_S,
    DEFAULT_HEALTH_FAILURE_THRESHOLD,
)

logger = logging.getLogger("tinyserve.router")


@dataclass(frozen=True)
class HealthChecks:
    interval_s: float = DEFAULT_HEALTH_CHECK_INTERVAL_S
    timeout_s: float = DEFAULT_HEALTH_CHECK_TIMEOUT_S
    failure_threshold: int = DEFAULT_HEALTH_FAILURE_THRESHOLD


async def check(client: httpx.AsyncClient, backend: Backend, timeout_s: float) -> str | None:
    """None if the backend answers GET /health with 200 in time; else what went wrong, in one line."""
    async def status() -> int:
        async with client.stream("GET", backend.url + "/health") as answer:  # closed unread
            return answer.status_code

    try:
        code = await asyncio.wait_for(status(), timeout_s)
    except asyncio.TimeoutError:
        return f"no answer to GET /health within {timeout_s:g} s (--health-check-timeout-secs)"
    except httpx.HTTPError as error:
        return f"GET /health failed: {type(error).__name__}: {error}"
    return None if code == 200 else f"GET /health answered {code}"


async def watch(client: httpx.AsyncClient, backends: list[Backend], checks: HealthChecks) -> None:
    """Check every backend, then wait the interval; for as long as the router runs (cancelled at its stop)."""
    while True:
        errors = await asyncio.gather(*(check(client, backend, checks.timeout_s) for backend in backends))
        for backend, error in zip(backends, errors):
            backend.checked(error, checks.failure_threshold)
        await asyncio.sleep(checks.interval_s)
