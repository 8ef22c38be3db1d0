"""The OpenAI-compatible HTTP server (aiohttp).

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`
(`responses_api.py`: a thin layer over chat completions), `GET /v1/models`
(and `/v1/models/{model}`), `GET /health`, `GET /live`, `GET /metrics`,
`GET /debug/kv` (what each KV router believes: cached blocks, load, hit rates), and
`GET /openapi.json` (`openapi.py`). The three generation routes share one code path,
their differences a table (`endpoints.py`).

The front door is hardened against hostile and overwhelming clients: an optional API key
(`auth.py`); decoding that turns every malformed body into a 400 (`openai/decoding.py`);
per-model bounds on requests in flight and waiting for a worker (`admission.py`, 503 with
`Retry-After` beyond them); deadlines on idle connections, request heads
(`listener.py`), bodies (408, `request_body.py`) and on clients that stop reading a stream
(`generation.py`).

Every failure leaves as OpenAI's error shape `{"error": {message, type, param, code}}`,
including aiohttp's own (unknown route, wrong method) via one middleware; bad input is
always a 4xx, never a 5xx or a connection left hanging. The server runs with
`handler_cancellation=True`, so a client that disconnects cancels its handler and with it
the request on the engine. aiohttp enables TCP_NODELAY on every accepted connection
(`BaseProtocol.connection_made`); streamed tokens are therefore not held back by Nagle's
algorithm (a test checks the socket option).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from dynamo.frontend.engine.beam_search import BeamSearchEngineClient
from dynamo.frontend.engine.client import EngineClient
from dynamo.frontend.engine.disagg import DisaggregatedEngineClient
from dynamo.frontend.http.admission import (
    RETRY_AFTER_S,
    AdmissionControl,
    AdmissionRejected,
    RejectReason,
)
from dynamo.frontend.http.auth import api_key_middleware
from dynamo.frontend.http.endpoints import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    RESPONSES,
    OpenAIEndpoint,
)
from dynamo.frontend.http.generation import Generation, serve
from dynamo.frontend.http.listener import (
    SHUTDOWN_DRAIN_S,
    listen,
    track_request_heads,
)
from dynamo.frontend.http.metrics import METRICS_CONTENT_TYPE, FrontendMetrics
from dynamo.frontend.http.openapi import OPENAPI_PATH, openapi_document
from dynamo.frontend.http.priority_header import header_priority
from dynamo.frontend.http.request_body import read_body
from dynamo.frontend.http.settings import HttpSettings
from dynamo.frontend.http.workers import HttpWorkerSlot
from dynamo.frontend.models.manager import ModelManager, ServedModel
from dynamo.frontend.openai.decoding import decode_request
from dynamo.frontend.openai.errors import (
    OpenAIError,
    http_error,
    internal_error,
    model_not_found,
    no_workers,
    overloaded,
)
from dynamo.frontend.openai.protocol import (
    ChatCompletionRequest,
    ModelInfo,
    ModelList,
    SamplingFields,
)
from dynamo.frontend.openai.unsupported_fields import check_request
from dynamo.frontend.parsing.chat_output import ChatOutputParser
from dynamo.frontend.parsing.chat_parsers import ChatParsingOptions, chat_output_parser
from dynamo.frontend.postprocess.chat_formatter import ChatFormatter
from dynamo.frontend.postprocess.choices import ChoicePostprocessors
from dynamo.frontend.postprocess.formatters import ResponseFormatter, encode_json
from dynamo.frontend.postprocess.postprocessor import Postprocessor
from dynamo.frontend.postprocess.responses_api import ResponsesChatRequest
from dynamo.frontend.preprocess.preprocessor import Prepared

log = logging.getLogger(__name__)

_REJECTION_WHAT = {
    RejectReason.INFLIGHT_LIMIT: "requests in flight",
    RejectReason.WORKER_WAIT_LIMIT: "requests waiting for a worker",
}


def json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


def error_response(error: OpenAIError) -> web.Response:
    response = json_response(error.body(), error.status)
    response.headers.update(error.headers)
    return response


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn every failure into OpenAI's error JSON with the right status."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(http_error(exc.status, exc.reason))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return error_response(internal_error())


class HttpService:
    """The frontend's HTTP server over a `ModelManager`."""

    def __init__(
        self,
        manager: ModelManager,
        *,
        metrics: FrontendMetrics | None = None,
        settings: HttpSettings | None = None,
        chat_parsing: ChatParsingOptions | None = None,
        http_worker: HttpWorkerSlot | None = None,
    ) -> None:
        """`settings.api_key` None or empty serves without authentication;
        `settings.write_timeout_s` 0 lets a stream wait for its client for ever."""
        settings = settings or HttpSettings()
        self.manager = manager
        self.metrics = metrics or FrontendMetrics()
        self.settings = settings
        self.host = settings.host
        self.port = settings.port  # the port listened on once started (0: the system's)
        self.admission = AdmissionControl(settings.admission)
        self.chat_parsing = chat_parsing or ChatParsingOptions()  # --tool-call-parser, ...
        self.http_worker = http_worker  # which of --http-workers N processes this is
        self._api_key = settings.api_key or None
        self._openapi = msgspec.json.encode(
            openapi_document(api_key_required=self._api_key is not None)
        )
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    # ------------------------------------------------------------------ lifecycle

    def build_app(self) -> web.Application:
        # Outermost first: the head deadline ends as soon as a request is handed over;
        # every refusal after that, the API key's included, leaves as an OpenAI error.
        middlewares = [track_request_heads, openai_errors]
        if self._api_key is not None:
            middlewares.append(api_key_middleware(self._api_key, self._count_unauthorized))
        app = web.Application(
            middlewares=middlewares, client_max_size=self.settings.max_request_bytes
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.render_metrics)
        app.router.add_get("/debug/kv", self.debug_kv)
        app.router.add_get(OPENAPI_PATH, self.render_openapi)
        return app

    async def start(self) -> None:
        """Listen on host:port (port 0 picks a free one; `self.port` then tells which)."""
        runner = web.AppRunner(
            self.build_app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_DRAIN_S,
        )
        await runner.setup()
        try:
            listener = await listen(
                runner, self.host, self.port, self.settings.timeouts, access_log=None
            )
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._listener = runner, listener
        if listener.sockets:  # the port actually bound (matters for port 0)
            self.port = listener.sockets[0].getsockname()[1]
        log.info("frontend listening on http://%s:%d", self.host, self.port)
        if self._api_key is not None:
            log.info("API key required on every route but /health, /live and /metrics")
        elif self.host in ("0.0.0.0", "::", ""):
            log.warning(
                "listening on every network interface without an API key: anyone who can "
                "reach this host can use the API (--http-host, --api-key / $DYN_API_KEY)"
            )

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()  # no new connections; the runner closes the open ones
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def connections(self) -> list[Any]:
        """Open client connections (aiohttp request handlers); for diagnostics and tests."""
        server = self._runner.server if self._runner is not None else None
        return list(server.connections) if server is not None else []

    # ------------------------------------------------------------------ OpenAI endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT_COMPLETIONS)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, RESPONSES)

    async def list_models(self, request: web.Request) -> web.Response:
        data = [_model_info(m) for m in sorted(self.manager.models(), key=lambda m: m.name)]
        return json_response(encode_json(ModelList(data=data)))

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        model = self.manager.get(name)
        if model is None:
            raise model_not_found(name)
        return json_response(encode_json(_model_info(model)))

    # ------------------------------------------------------------------ operational endpoints

    async def health(self, request: web.Request) -> web.Response:
        """200 when at least one model has a worker to serve it, else 503 (not ready)."""
        models = {
            m.name: {"instances": sorted(m.engine.instance_ids()) if m.engine else []}
            for m in self.manager.models()
        }
        ready = any(m.has_workers() for m in self.manager.models())
        body = {"status": "healthy" if ready else "unhealthy", "models": models}
        return json_response(msgspec.json.encode(body), 200 if ready else 503)

    async def live(self, request: web.Request) -> web.Response:
        """200 while the process serves HTTP at all (liveness, not readiness)."""
        return json_response(b'{"status":"live"}')

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    async def render_openapi(self, request: web.Request) -> web.Response:
        return json_response(self._openapi)

    async def debug_kv(self, request: web.Request) -> web.Response:
        """Per model and worker endpoint, the KV router's view (`debug_state()`): blocks
        cached per worker, booked and reported load, predicted hit rates, feed counters.
        Endpoints whose router keeps no such state (round-robin) are left out. Models
        with prefill workers also get their prefill placement policy and decisions under
        `disaggregation`. Under
        `--http-workers N`, `http_worker` says which process answered (each has its own
        routers)."""
        models: dict[str, dict[str, Any]] = {}
        for model in sorted(self.manager.models(), key=lambda m: m.name):
            routers = {}
            for key, endpoint in model.endpoints.items():
                state = endpoint.client.router.debug_state()
                if state:
                    routers["/".join(key)] = state
            models[model.name] = routers
        view: dict[str, Any] = {"models": models}
        disaggregation = {
            model.name: model.engine.debug_state()
            for model in self.manager.models()
            if isinstance(model.engine, DisaggregatedEngineClient)
        }
        if disaggregation:
            view["disaggregation"] = disaggregation
        if self.http_worker is not None:
            view["http_worker"] = self.http_worker.describe()
        return json_response(msgspec.json.encode(view))

    # ------------------------------------------------------------------ internals

    async def _generate(self, request: web.Request, kind: OpenAIEndpoint) -> web.StreamResponse:
        """Decode → look up the model → admit → preprocess → run on its engine."""
        req = decode_request(
            kind.decoder, await read_body(request, self.settings.max_request_bytes)
        )
        stream = bool(req.stream)
        model = self.manager.get(req.model)
        if model is None:
            self.metrics.count_rejected("", kind.name, stream, 404)
            raise model_not_found(req.model)
        try:
            with self.admission.admit(model.name):  # held until the response has ended
                return await self._admitted(request, kind, req, model)
        except AdmissionRejected as exc:
            error = overloaded(exc.model, _REJECTION_WHAT[exc.reason], RETRY_AFTER_S)
            # Per request, so debug only: a burst would flood the log; the metric counts.
            log.debug("%s: 503 (%s at its limit of %d)", exc.model, exc.reason, exc.limit)
            self.metrics.count_shed(exc.model, exc.reason)
            self.metrics.count_rejected(exc.model, kind.name, stream, error.status)
            raise error from None

    async def _admitted(
        self, request: web.Request, kind: OpenAIEndpoint, req: SamplingFields, model: ServedModel
    ) -> web.StreamResponse:
        """Preprocess and serve a request holding one of its model's in-flight places."""
        request_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        try:
            if kind.convert is not None:
                # Admitted first, then converted in a thread: an input array of thousands
                # of items costs its own request time, not the event loop's.
                req = await asyncio.to_thread(kind.convert, req)
            check_request(req)  # a field set to a value we do not serve: 400 naming it
            priority = header_priority(request.headers)  # wins over the body's, as in vLLM
            prepared = await kind.prepare(model.preprocessor, req, request_id)
            if priority is not None:
                prepared.request.priority = priority
            parsers = self._chat_output_parsers(req, model, prepared)  # 400: unservable tools
            model = await self._with_workers(model)
        except OpenAIError as exc:
            self.metrics.count_rejected(model.name, kind.name, bool(req.stream), exc.status)
            raise
        assert model.engine is not None
        formatter = (
            kind.formatter(request_id, model.name, prepared.plan)
            if parsers is None
            else ChatFormatter(request_id, model.name, prepared.plan, parser_factory=parsers)
        )
        return await serve(
            request,
            self._generation(
                model,
                model.engine,
                kind,
                prepared,
                formatter,
                report_spec_stats=self.settings.return_spec_stats or bool(req.return_spec_stats),
                choices=req.n or 1,  # 1..MAX_CHOICES: checked by the preprocessor
            ),
        )

    def _chat_output_parsers(
        self, req: SamplingFields, model: ServedModel, prepared: Prepared
    ) -> Callable[[], ChatOutputParser] | None:
        """A fresh parser per choice of a chat response (tools, reasoning); None for
        completions and for /v1/responses (text only: its own formatter). One parser is
        built here, so a request the flags cannot serve is a 400 before any worker."""
        if not isinstance(req, ChatCompletionRequest) or isinstance(req, ResponsesChatRequest):
            return None
        make = functools.partial(
            chat_output_parser,
            req,
            self.chat_parsing,
            model.preprocessor.tokenizer,
            prepared.request.token_ids,  # the prompt: has its template closed reasoning?
        )
        make()
        return make

    def _count_unauthorized(self) -> None:
        self.metrics.count_shed("", "unauthorized")

    async def _with_workers(self, model: ServedModel) -> ServedModel:
        """`model` (as registered now) once a worker can take a request; 503 if none
        becomes ready within `worker_wait_s`, or at once when `max_waiting` requests of
        the model already wait (`AdmissionRejected`)."""
        if model.has_workers():
            return model
        with self.admission.waiting_for_worker(model.name):
            return await self._wait_for_workers(model)

    async def _wait_for_workers(self, model: ServedModel) -> ServedModel:
        loop = asyncio.get_running_loop()
        start = loop.time()
        current = await self.manager.wait_for_workers(model.name, self.settings.worker_wait_s)
        if current is None:
            log.warning(
                "no worker for %s after %.1fs: 503", model.name, self.settings.worker_wait_s
            )
            raise no_workers(model.name)
        log.info("a request for %s waited %.2fs for a worker", model.name, loop.time() - start)
        return current

    def _generation(
        self,
        model: ServedModel,
        engine: EngineClient,
        kind: OpenAIEndpoint,
        prepared: Prepared,
        formatter: ResponseFormatter,
        report_spec_stats: bool = False,
        choices: int = 1,
    ) -> Generation:
        pre = model.preprocessor
        plan = prepared.plan
        if prepared.beam_search is not None:
            engine = BeamSearchEngineClient(engine, prepared.beam_search, pre.beam_eos_token_id)
        metrics = self.metrics.request(model.name, kind.name, plan.stream)
        metrics.prompt(len(prepared.request.token_ids))
        postprocessor = ChoicePostprocessors(
            choices,
            lambda: Postprocessor(
                plan,
                prepared.request.token_ids,
                pre.decode_fn(plan.skip_special_tokens),
                pre.token_texts,
            ),
            report_spec_stats=report_spec_stats,
        )
        return Generation(
            model.name,
            prepared,
            engine,
            postprocessor,
            formatter,
            metrics,
            write_timeout_s=self.settings.write_timeout_s or None,
        )


def _model_info(model: ServedModel) -> ModelInfo:
    return ModelInfo(id=model.name, created=model.created)
