"""The endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health.

Each request becomes one Engine `Generate` per prompt (generation.py). Non-streaming
responses are collected whole; streaming ones wait for every prompt's first message before
sending their 200 (so a refused request still gets its proper 4xx/5xx status), then send one
SSE chunk per Engine message and `data: [DONE]`. Either way a client disconnect cancels the
engine requests (streaming.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from base.v1 import engine_pb2
from pagedkv.client import ClientError
from pagedkv.openai_api.chat_template import template_for
from pagedkv.openai_api.errors import ApiError, bad_request
from pagedkv.openai_api.front import Front
from pagedkv.openai_api.generation import EngineStreams, UsageTotals, build_requests, collect
from pagedkv.openai_api.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from pagedkv.openai_api.responses import ChunkMaker, Envelope, chat_choice, completion_choice
from pagedkv.openai_api.streaming import (
    DONE_EVENT,
    ClientDisconnected,
    SSEResponse,
    sse_event,
    until_disconnect,
)

router = APIRouter()
health_router = APIRouter()


@dataclass
class Job:
    """One OpenAI request, ready to run: its engine requests and how to answer."""

    requests: list[engine_pb2.GenerateRequest]
    envelope: Envelope
    num_choices: int
    chat: bool
    want_logprobs: bool
    top: int
    stream: bool
    include_usage: bool


def _front(request: Request) -> Front:
    return request.app.state.front


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    front = _front(request)
    info = await front.model_info()
    card = {
        "id": info.facts.model_name,
        "object": "model",
        "created": front.started,
        "owned_by": "pagedkv",
        "max_model_len": info.facts.max_model_len,
    }
    return {"object": "list", "data": [card]}


@health_router.get("/health")
async def health(request: Request) -> Response:
    """200 while the Engine reports SERVING (a worker is connected), else 503."""
    try:
        status = await _front(request).client.health(timeout=5.0)
    except ClientError as e:
        status = e.code.name
    return JSONResponse({"engine": status}, status_code=200 if status == "SERVING" else 503)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    body.check_refused()
    _, model = await _front(request).resolve_model(body.model)
    want_logprobs, top = body.logprobs_mode()
    prompts = body.prompts()
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    rid = f"cmpl-{uuid.uuid4().hex}"
    job = Job(
        build_requests(
            rid, prompts, body.sampling(max_tokens, want_logprobs), body.priority, body.cache_salt or ""
        ),
        Envelope(rid, "text_completion", model),
        len(prompts) * body.n,
        False,
        want_logprobs,
        top,
        body.stream,
        body.include_usage,
    )
    return await _run(request, job)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    body.check_refused()
    front = _front(request)
    info, model = await front.resolve_model(body.model)
    template = template_for(front.chat_template, info.facts.tokenizer_kind)
    prompt = template.render(body.template_messages(), body.add_generation_prompt, body.chat_template_kwargs)
    want_logprobs, top = body.logprobs_mode()
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        max_tokens = default_chat_max_tokens(info, prompt)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    job = Job(
        build_requests(
            rid, [prompt], body.sampling(max_tokens, want_logprobs), body.priority, body.cache_salt or ""
        ),
        Envelope(rid, "chat.completion", model),
        body.n,
        True,
        want_logprobs,
        top,
        body.stream,
        body.include_usage,
    )
    return await _run(request, job)


def default_chat_max_tokens(info: engine_pb2.ModelInfo, prompt: str) -> int:
    """OpenAI's chat default is "as many as fit". The front does not tokenize, so it bounds
    the prompt's tokens from above: its UTF-8 bytes (exact for the byte tokenizer), + 1 for a
    Hugging Face tokenizer (each token covers at least one byte; a prefix-space token may be
    added). What fits: the model's max length, and in a paged pool its blocks."""
    prompt_bound = len(prompt.encode("utf-8")) + (0 if info.facts.tokenizer_kind == "byte" else 1)
    limit = info.facts.max_model_len
    if info.facts.kv_layout == engine_pb2.KV_LAYOUT_PAGED:
        limit = min(limit, (info.facts.num_blocks - 1) * info.facts.block_size)
    room = limit - prompt_bound
    if room < 1:
        raise bad_request(
            f"no room left for output after the prompt (up to {prompt_bound} tokens, limit {limit}); "
            "shorten the messages or set max_tokens",
            "messages",
        )
    return room


async def _run(request: Request, job: Job) -> Response:
    front = _front(request)
    if job.stream:
        streams = EngineStreams(front.client, job.requests)
        await streams.__aenter__()
        try:
            first = await until_disconnect(request.receive, streams.first_of_each())
        except BaseException as e:
            await streams.close()
            if isinstance(e, ClientDisconnected):
                return Response(status_code=499)  # never delivered
            raise
        return SSEResponse(_events(job, streams, first))

    async def whole():
        async with EngineStreams(front.client, job.requests) as streams:
            return await collect(streams, job.num_choices)

    try:
        choices, usage = await until_disconnect(request.receive, whole())
    except ClientDisconnected:
        return Response(status_code=499)  # never delivered
    make = chat_choice if job.chat else completion_choice
    body = job.envelope.body([make(c, job.want_logprobs, job.top) for c in choices], usage=usage.json())
    return JSONResponse(body)


async def _events(job: Job, streams: EngineStreams, first: list) -> AsyncIterator[bytes]:
    """The SSE body: chunks for the messages already read, then the rest, then usage, [DONE].
    An engine failure after the 200 is sent as an error event (OpenAI's and vLLM's way)."""
    env = job.envelope
    env.fields["object"] = "chat.completion.chunk" if job.chat else "text_completion"
    usage_extra = {"usage": None} if job.include_usage else {}
    maker = ChunkMaker(job.chat, job.want_logprobs, job.top)
    usage = UsageTotals()
    try:
        if job.chat:
            for i in range(job.num_choices):
                yield sse_event(env.body([maker.role_chunk(i)], **usage_extra))
        pending = iter(first)
        while True:
            event = next(pending, None) or await streams.next()
            if event is None:
                break
            index, prompt, msg = event
            usage.add(prompt, msg)
            choice = maker.choice(index, msg)
            if choice is not None:
                yield sse_event(env.body([choice], **usage_extra))
        if job.include_usage:
            yield sse_event(env.body([], usage=usage.json()))
    except ApiError as e:
        yield sse_event(e.body())
    finally:
        await streams.close()
    yield DONE_EVENT
