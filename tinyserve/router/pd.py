"""The router's prefill/decode mode (`--prefill URL ... --decode URL ...`): disaggregated serving.

Each request goes to two servers, as vLLM's disaggregated proxy sends it
(examples/online_serving/disaggregated_serving/):

    1. a prefill server (--kv-transfer-config kv_role kv_producer): the request as sent, but max_tokens=1,
       not streamed, with kv_transfer_params {"do_remote_decode": true}. It computes the prompt's K/V,
       keeps them, and answers with kv_transfer_params saying where they are.
    2. a decode server (kv_role kv_consumer): the request as sent, with those kv_transfer_params. It pulls
       the blocks (tinyserve/distributed/kv_transfer/), computes the last prompt token, and decodes; its
       answer, streamed or whole, is the client's.

A prefill that answers with an error is the client's answer as it is; one that ended before its
length (EOS as the first token) hands nothing over, and the decode server computes the prompt itself.
kv_transfer_params come from the prefill server only: a client's own are refused (400, app.py's
request_object), where vLLM's proxy would pass them to the decode server when the prefill hands
nothing over, and a decode server would pull K/V from wherever they point. The prefill's answer is
read whole, at most MAX_BACKEND_ANSWER_BYTES of it.
Each leg is a `tinyserve.route` span under the router's HTTP span, and its context goes to that server
as `traceparent`: one trace holds the router, the prefill and the decode. Servers are taken in turn
within each pool; one that cannot be reached or fails is taken out until a health check finds it
answering (backends.py, health.py), as in Router. The router's /health is 200 only while both pools
have a server up: with every decode server up but no prefill server, each request would be a 503.
"""

import itertools
import json

import httpx
from opentelemetry import trace

from tinyserve.lifecycle import schema
from tinyserve.lifecycle.tracing import inject_context
from tinyserve.router.app import Router, _end, _error, _finished, _none_available, _route_span, request_object
from tinyserve.router.backends import Backend
from tinyserve.router.defaults import MAX_BACKEND_ANSWER_BYTES
from tinyserve.router.policies import Choice
from tinyserve.router.proxy import (
    AnswerTooLarge,
    BackendFailed,
    BackendUnreachable,
    forwarded_headers,
    open_response,
    pass_back,
    read_bounded,
)
from tinyserve.entrypoints.api.load_reports import FORMAT_HEADER

POLICY = "pd"


def prefill_body(body: dict) -> dict:
    """What the prefill server gets: one token, whole, its K/V kept for a decode server (vLLM's proxy's)."""
    prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    prefill.pop("stream_options", None)
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    return prefill


class PDRouter(Router):
    """Prefill servers and decode servers; `dispatch` runs one request over one of each."""

    def __init__(self, prefills: list[Backend], decodes: list[Backend], **settings) -> None:
        """settings: Router's (health, header_timeout_s)."""
        super().__init__([*prefills, *decodes], policy=None, **settings)
        self.pools = {"prefill": prefills, "decode": decodes}
        self._turns = {leg: itertools.count() for leg in self.pools}

    def unavailable(self) -> str | None:
        """A request needs a prefill server and a decode server: why not, while either pool has none up."""
        for leg, pool in self.pools.items():
            if not any(b.is_up() for b in pool):
                return f"no {leg} server is up: " + _none_available(pool, [])
        return None

    async def dispatch(self, request) -> object:
        body = request_object(await request.body())
        if not isinstance(body, dict):
            return body  # the client's 400: not a JSON object, or its own kv_transfer_params
        prefill = await self._leg("prefill", request, prefill_body(body))
        if not isinstance(prefill, dict):
            return prefill  # the prefill server's error, or the router's
        params = prefill.get("kv_transfer_params")
        decode = {**body, "kv_transfer_params": params} if isinstance(params, dict) and params else body
        return await self._leg("decode", request, decode)

    async def _leg(self, leg: str, request, body: dict):
        """Send `body` to the next live server of the leg's pool: the prefill's answer as a dict (or the
        response to give back if it failed); the decode's answer passed back as it arrives."""
        content, unreachable = json.dumps(body).encode(), []
        while live := [b for b in self.pools[leg] if b.is_up() and b.url not in unreachable]:
            backend = live[next(self._turns[leg]) % len(live)]
            span = _route_span(POLICY, Choice(backend, f"{leg}: each {leg} server in turn",
                                              {schema.ROUTER_PD_LEG: leg}))
            headers = forwarded_headers(request.headers, inject_context(trace.set_span_in_context(span)))
            headers["content-type"] = "application/json"
            backend.in_flight += 1
            backend.routed += 1
            try:
                response = await open_response(self.client, backend, "POST", request.url.path, content, headers,
                                               self.header_timeout_s)
            except (BackendUnreachable, BackendFailed) as error:
                backend.in_flight -= 1
                status = error.status if isinstance(error, BackendFailed) else 502
                _end(span, status, str(error))
                if isinstance(error, BackendFailed):
                    return _error(status, str(error))
                unreachable.append(backend.url)
                continue
            if leg == "decode" or response.status_code != 200:
                return pass_back(response, backend, FORMAT_HEADER in request.headers,
                                 on_close=lambda error, b=backend, s=span, r=response:
                                 _finished(b, s, r.status_code, error))
            return await self._prefill_answer(backend, span, response)
        return _error(503, _none_available(self.pools[leg], unreachable))

    async def _prefill_answer(self, backend: Backend, span, response):
        """The prefill server's answer as a dict, or the client's 502 if it is not a JSON object of a sane size."""
        try:
            answer = json.loads(await read_bounded(response, MAX_BACKEND_ANSWER_BYTES,
                                                   f"prefill server {backend.url}'s answer"))
            problem = None if isinstance(answer, dict) else f"prefill server {backend.url} answered with no JSON object"
        except (AnswerTooLarge, ValueError, RecursionError, httpx.HTTPError) as error:
            problem = f"prefill server {backend.url} failed: {error}"
        finally:
            await response.aclose()
        _finished(backend, span, response.status_code, problem)
        return answer if problem is None else _error(502, problem)
