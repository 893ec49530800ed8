# Why not `transformers serve`: it loads whatever model a request names, defaults max_new_tokens to 1024 or more over
# the model's own, takes a client's generation_config, and never checks prompt + max_tokens against the model's
# positions; its extension points live under transformers.cli.serving, not a public API.
r"""Serve a causal LM over HTTP as OpenAI's chat-completions API: a training checkpoint or an exported model folder.

    python -m <package>.serve model_dir=models/my_lm
    python -m <package>.serve ckpt_path=RUN/checkpoints/last.ckpt port=8001 generation.max_new_tokens=512

One model, on one device (CUDA when there is one), one request generating at a time; binds 127.0.0.1 (a host that
is not a loopback address needs ``allow_remote=true``).  ``GET /v1/models`` lists it; ``POST /v1/chat/completions``
renders ``messages`` with the chat template the run trained with and answers whole or streamed (server-sent
events), so the official ``openai`` client works against ``http://127.0.0.1:8000/v1``.  Request fields honoured:
``model`` (must be the served id), ``messages`` (system/developer, user and assistant turns, the last a user's;
text only), ``max_completion_tokens`` (else ``max_tokens``, else ``generation.max_new_tokens``, or what the positions
leave), ``temperature`` (absent or 0: greedy; above 0 samples), ``top_p`` (when sampling), ``seed``, ``stream``,
``stream_options.include_usage`` and ``n`` (1 only).  Refused with a 400 when set: ``stop``, ``tools``/``functions``,
``tool_choice``, ``logprobs``/``top_logprobs``, ``logit_bias``, ``frequency_penalty``/``presence_penalty``,
``response_format`` (but text) and ``n`` above 1: results this server would not give as asked.  Other fields
(``user``, ``metadata``, ``store``...) are accepted and ignored.  A bad request is a 400 (404: an unknown model) with
an OpenAI error body, never a crash; prompt tokens plus ``max_tokens`` above the model's positions is a 400.

Exits 0 after Ctrl-C and 143 after SIGTERM (128 + 15), each once the open requests are answered; 1 on bad config, before
any weights load (and on a model whose tokenizer has no chat template, after).  Writes no files."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .core.config.resolvers import to_plain
from .core.errors import ConfigError
from .core.run.entry import exit_on_bad_input, hydra_main
from .generate import generation_problems, load_generator, source_problems
from .tasks import check_config

if TYPE_CHECKING:
    from fastapi import FastAPI

SERVE_EXTRA = 'pip install -e ".[serve]"'
LOOPBACK_NAMES = ("localhost",)
# Set per request (the request's temperature, top_p), or not ours to set here: refused in the config's generation.
PER_REQUEST = ("do_sample", "temperature", "top_p", "batch_size")
# Request fields whose result this server would not give as asked: refused (400) when set to anything but "off".
REFUSED = (
    "stop", "tools", "functions", "tool_choice", "function_call", "logprobs", "top_logprobs", "logit_bias",
    "frequency_penalty", "presence_penalty", "response_format",
)  # fmt: skip
OFF_VALUES = (None, False, 0, "none", [], {}, {"type": "text"})


class Part(BaseModel):
    """One part of a message's content: text only (``{"type": "text", "text": ...}``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One turn of ``messages``; ``developer`` is rendered as ``system``."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The body of ``POST /v1/chat/completions`` (the fields this server reads; others are checked by :data:`REFUSED`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    messages: list[Message]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class APIError(Exception):
    """A request this server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def is_loopback(host: str) -> bool:
    """``host`` names this machine only (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def serve_problems(cfg: DictConfig) -> list[str]:
    """What is wrong with ``serve``'s own settings: the address, the model id, ``generation`` (checked before anything
    loads; the bind rule first: a host other than a loopback address needs ``allow_remote=true``)."""
    problems = []
    host, port, remote = cfg.get("host"), cfg.get("port"), cfg.get("allow_remote")
    if not isinstance(remote, bool):
        problems.append(f"allow_remote={remote!r} must be true or false; fix: allow_remote=false (serve this machine only)")
    if not isinstance(host, str) or not host:
        problems.append(f"host={host!r} must be an address to bind; fix: host=127.0.0.1")
    elif remote is not True and not is_loopback(host):
        problems.append(
            f"host={host!r} would serve the model beyond this machine, to anyone who can reach it (there is no authentication); "
            f"fix: host=127.0.0.1, or allow_remote=true to mean it"
        )
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        problems.append(f"port={port!r} must be a TCP port, 1 to 65535; fix: e.g. port=8000")
    name = cfg.get("model_name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        problems.append(f"model_name={name!r} must be a non-empty id or null (the folder's or the run's name); fix: model_name=my-lm")
    generation = cfg.get("generation")
    if not isinstance(generation, DictConfig):
        return problems + [f"generation={generation!r} must be a mapping of generation settings; fix: generation.max_new_tokens=256"]
    for key in PER_REQUEST:
        if key in generation:
            problems.append(
                f"generation.{key} is not a server setting: each request sets its sampling (temperature absent or 0: greedy; "
                f"top_p) and is answered alone; fix: remove it (~generation.{key})"
            )
    defaults = {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "batch_size": 1}  # (what generation_problems reads besides)
    problems += generation_problems(OmegaConf.merge(defaults, {k: v for k, v in generation.items() if k not in PER_REQUEST}))
    for module in ("fastapi", "uvicorn"):
        if importlib.util.find_spec(module) is None:
            problems.append(f"serve needs the {module} package, which is not installed; fix: {SERVE_EXTRA}")
    return problems


def check_serve_config(cfg: DictConfig) -> None:
    """Refuse a ``serve`` config before any weights load: :func:`serve_problems`, then the shared checks
    (:func:`.tasks.check_config`), exactly one of ``ckpt_path``/``model_dir``, and a port already taken.

    Raises:
        ConfigError: every problem of :func:`serve_problems` (the bind rule among them, before anything else is read);
            else a config problem, not exactly one of ``ckpt_path``/``model_dir``, a ``model_dir`` without
            ``config.json``, or ``host:port`` in use.
    """
    problems = serve_problems(cfg)
    if problems:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(problems))
    check_config(cfg, resumes=False)
    problems = source_problems(cfg)
    if problems:
        raise ConfigError(problems[0])
    port_problem = address_in_use(cfg.host, cfg.port)
    if port_problem:
        raise ConfigError(port_problem)


def address_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (in use, or not an address of this machine); ``None`` when it can."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed socket's TIME_WAIT is no conflict
            probe.bind((host.strip("[]"), port))
    except OSError as error:
        return f"cannot listen on {host}:{port} ({error.strerror or error}); fix: another port=..., or stop what holds it"
    return None


def served_name(cfg: DictConfig) -> str:
    """The id clients name: ``model_name``, else the exported folder's name, else the checkpoint's run folder's name
    (``RUN`` of ``RUN/checkpoints/last.ckpt``)."""
    if cfg.model_name is not None:
        return str(cfg.model_name).strip()
    if cfg.model_dir is not None:
        return Path(cfg.model_dir).resolve().name
    checkpoint = Path(cfg.ckpt_path).resolve()
    return checkpoint.parent.parent.name if checkpoint.parent.name == "checkpoints" else checkpoint.stem


def load_served(cfg: DictConfig):
    """The checked config's model (:func:`.generate.load_generator`), on CUDA when there is one.

    Raises:
        ConfigError: a refused checkpoint, or a model whose tokenizer has no chat template (``generate`` completes plain
            text prompts).
    """
    module = load_generator(cfg)
    try:
        module.messages_ids([{"role": "user", "content": "hello"}])
    except ValueError as error:
        where = f"model_dir={cfg.model_dir}" if cfg.model_dir is not None else f"ckpt_path={cfg.ckpt_path}"
        raise ConfigError(
            f"{where} cannot answer chat messages: {error} (python -m {__package__}.generate {where} 'prompts=[...]')"
        ) from error
    if torch.cuda.is_available():
        module.to("cuda")
    return module


def build_app(module, name: str, generation: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app serving ``module`` (a loaded ``CausalLMModule`` with a chat template) as ``name``.

    ``generation``: ``model.generate`` settings of every request (``max_new_tokens``: the default when a request gives
    no ``max_tokens``, 256 if absent); a request's ``max_tokens``, ``temperature`` and ``top_p`` win.

    Raises:
        ImportError: fastapi is not installed (``pip install -e ".[serve]"``).
    """
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    from .core.models.builder import max_positions

    settings = dict(generation or {})
    default_tokens = settings.pop("max_new_tokens", 256)
    limit = max_positions(module.model.config)
    created = int(time.time())
    lock = anyio.Lock()  # one generation at a time: one model on one device
    app = FastAPI(title=f"{__package__} serve: {name}", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def refused(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"  # (no such route, method)
        body = APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind=kind).body()
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:  # (a bug or an OOM: the server keeps serving)
        return JSONResponse(
            APIError(500, f"the server failed: {type(error).__name__}: {error}", kind="server_error").body(), status_code=500
        )

    def card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "local"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != name:
            raise unknown_model(model_id, name)
        return card()

    async def chat_completions(http: Request) -> Response:  # (read whatever its Content-Type says: curl -d sends a form's)
        request = parse_request(await http.body())
        prompt, new_tokens, options = prepare(request)
        identity = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        if request.stream:
            usage = request.stream_options is not None and request.stream_options.include_usage
            return StreamingResponse(
                stream_events(prompt, new_tokens, options, request.seed, identity, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        async with lock:
            (ids,) = await run_in_threadpool(seeded, request.seed, module.complete, [prompt], **options)
        text = module.tokenizer.decode(ids, skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        return JSONResponse(
            {
                **identity,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish(len(ids), new_tokens)}],
                "usage": usage_of(len(prompt), len(ids)),
            }
        )

    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    def prepare(request: ChatRequest) -> tuple[list[int], int, dict]:
        """The prompt's ids, the new-token budget and ``model.generate``'s settings; :class:`APIError` for a refused request."""
        if request.model != name:
            raise unknown_model(request.model, name)
        extra = request.model_extra or {}
        for field in REFUSED:
            if extra.get(field) not in OFF_VALUES:
                reason = "this server does not support it (its answer would not be what was asked)"
                raise APIError(
                    400, f"{field}={extra[field]!r}: {reason}; fix: leave {field} out", param=field, code="unsupported_parameter"
                )
        if request.n not in (None, 1):
            raise APIError(400, f"n={request.n}: one choice a request here; fix: n=1 (send the request again for another)", param="n")
        if not request.messages:
            raise APIError(400, "messages is empty; fix: at least one user message", param="messages")
        if request.messages[-1].role != "user":
            raise APIError(
                400,
                f"the last message is the {request.messages[-1].role}'s; the model answers a user turn: fix: end messages with a user message",
                param="messages",
            )
        turns = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content),
            }
            for m in request.messages
        ]
        try:
            prompt = module.messages_ids(turns)
        except Exception as error:  # a template's own refusal (roles must alternate, ...): jinja2 raises its TemplateError
            raise APIError(400, f"the model's chat template refused these messages: {error}", param="messages") from error
        asked = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if limit is not None:
            room = limit - len(prompt)
            if asked is not None and len(prompt) + asked > limit:
                param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
                fix = f"{param} <= {room}" if room > 0 else "fewer or shorter messages"
                raise APIError(
                    400,
                    f"this model's maximum context length is {limit} tokens: the messages are {len(prompt)} tokens and {param} "
                    f"is {asked} ({len(prompt) + asked} in all); fix: {fix}",
                    param=param,
                    code="context_length_exceeded",
                )
            if room < 1:
                raise APIError(
                    400,
                    f"this model's maximum context length is {limit} tokens and the messages are {len(prompt)}: no room for an "
                    f"answer; fix: fewer or shorter messages",
                    param="messages",
                    code="context_length_exceeded",
                )
        new_tokens = asked if asked is not None else default_tokens if limit is None else min(default_tokens, limit - len(prompt))
        options = {**settings, "max_new_tokens": new_tokens}
        if request.temperature:  # absent or 0: greedy
            options.update(do_sample=True, temperature=request.temperature, top_p=1.0 if request.top_p is None else request.top_p)
        else:
            options["do_sample"] = False
        return prompt, new_tokens, options

    async def stream_events(
        prompt: list[int], new_tokens: int, options: dict, seed: int | None, identity: dict, usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: the role, each piece of text, the finish reason (and the usage), then ``[DONE]``."""

        def chunk(delta: dict, reason: str | None = None, **more: object) -> str:
            body = {
                **identity,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
            }
            return f"data: {json.dumps({**body, **more})}\n\n"

        stop, made = threading.Event(), []
        async with lock:
            pieces = module.stream(prompt, stop=stop, tokens=made, **options)  # (starts on its first piece)
            if seed is not None:
                torch.manual_seed(seed)
            try:
                yield chunk({"role": "assistant", "content": ""})
                while (piece := await run_in_threadpool(next, pieces, None)) is not None:
                    yield chunk({"content": piece})
                yield chunk({}, finish(len(made), new_tokens))
                if usage:
                    yield f"data: {json.dumps({**identity, 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage_of(len(prompt), len(made))})}\n\n"
            except Exception as error:  # noqa: BLE001  (the status is sent: the client reads the error as an event)
                yield f"data: {json.dumps(APIError(500, f'generation failed: {type(error).__name__}: {error}', kind='server_error').body())}\n\n"
            finally:
                stop.set()  # a client that went away: generation ends after its next token
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(pieces.close)
        yield "data: [DONE]\n\n"

    return app


def seeded(seed: int | None, function, *args: object, **kwargs: object):
    """``function(*args, **kwargs)`` after seeding torch's generators with ``seed`` (when given)."""
    if seed is not None:
        torch.manual_seed(seed)
    return function(*args, **kwargs)


def finish(made: int, new_tokens: int) -> str:
    """OpenAI's ``finish_reason``: ``length`` when the answer (its ids without the end token) used every token allowed,
    else ``stop`` (the end token came first)."""
    return "length" if made >= new_tokens else "stop"


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def unknown_model(asked: str, name: str) -> APIError:
    """The 404 of a request naming another model than the one served."""
    return APIError(
        404,
        f"the model {asked!r} does not exist here: this server serves {name!r} only; fix: model={name!r}",
        param="model",
        code="model_not_found",
    )


def parse_request(body: bytes) -> ChatRequest:
    """The body of a chat-completions request, read as JSON whatever its ``Content-Type``.

    Raises:
        APIError: 400: not JSON, not an object, or a field of the wrong type or out of range (:func:`validation_error`).
    """
    try:
        data = json.loads(body)
    except ValueError as error:  # (JSONDecodeError and UnicodeDecodeError both are)
        raise APIError(400, f"the request body is not valid JSON ({error}); fix: send a JSON object", code="invalid_json") from error
    if not isinstance(data, dict):
        raise APIError(
            400, f"the request body is JSON but not an object (a {type(data).__name__}); fix: send a JSON object", code="invalid_json"
        )
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as error:
        raise validation_error(error.errors()) from error


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's validation errors of a request as one 400 naming each field's problem (``param``: the first field)."""
    lines = []
    for error in errors:
        location = ".".join(str(part) for part in error.get("loc", ())) or "body"
        got = "" if error.get("type") == "missing" else f" (got {error.get('input')!r})"
        lines.append(f"{location}: {error.get('msg')}{got}"[:300])
    first = ".".join(str(part) for part in errors[0].get("loc", ())) if errors else None
    return APIError(400, "invalid request: " + "; ".join(lines), param=first or None, code="invalid_value")


def served_app(cfg: DictConfig) -> tuple[FastAPI, str]:
    """Check ``cfg`` (:func:`check_serve_config`), load its model (:func:`load_served`) and build its app; return the app and
    the served id.

    Raises:
        ConfigError: as :func:`check_serve_config` (before any weights load) and :func:`load_served`.
    """
    check_serve_config(cfg)
    name = served_name(cfg)
    module = load_served(cfg)
    return build_app(module, name, to_plain(cfg.generation)), name


def url_of(host: str, port: int) -> str:
    """The base URL clients give (``base_url``): ``http://host:port/v1`` (an IPv6 address in brackets)."""
    host = f"[{host.strip('[]')}]" if ":" in host else host
    return f"http://{host}:{port}/v1"


def serve(cfg: DictConfig) -> None:
    """Serve ``cfg``'s model until stopped (Ctrl-C, SIGTERM).

    Raises:
        ConfigError: as :func:`served_app`: a bad config (the bind rule first), before any weights load; a model without
            a chat template.
    """
    import uvicorn

    app, name = served_app(cfg)
    url = url_of(cfg.host, cfg.port)
    print(f"Serving {name!r} ({'cuda' if torch.cuda.is_available() else 'cpu'}) at {url} (OpenAI chat completions; Ctrl-C stops)")
    messages = json.dumps([{"role": "user", "content": "Hello"}])
    print(
        f'  from openai import OpenAI; print(OpenAI(base_url="{url}", api_key="none").chat.completions.create('
        f'model="{name}", messages={messages}).choices[0].message.content)',
        flush=True,
    )
    uvicorn.run(app, host=cfg.host.strip("[]"), port=cfg.port, log_level="info")


@hydra_main("serve")
def main(cfg: DictConfig) -> None:
    """Console script / ``python -m`` entry: bad config or data exits 1 with its message alone."""
    with exit_on_bad_input():
        serve(cfg)


if __name__ == "__main__":
    main()
