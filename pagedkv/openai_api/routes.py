"""The generation endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
GET /health (the tokenizer, model, version and metrics endpoints: extras.py).

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

from base.logs import get_logger
from base.v1 import engine_pb2
from pagedkv.client import ClientError
from pagedkv.openai_api.chat_template import template_for
from pagedkv.openai_api.errors import ApiError, bad_request, from_client_error
from pagedkv.openai_api.extras import adapter_card, model_card
from pagedkv.openai_api.front import Front
from pagedkv.openai_api.generation import EngineStreams, UsageTotals, build_requests, collect
from pagedkv.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.openai_api.responses import ChunkMaker, Envelope, View
from pagedkv.openai_api.streaming import (
    DONE_EVENT,
    ClientDisconnected,
    SSEResponse,
    sse_event,
    until_disconnect,
)
from pagedkv.openai_api.tools import ToolCalling

router = APIRouter()
health_router = APIRouter()
log = get_logger("pagedkv.openai")
IGNORED_FIELDS_HEADER = "x-pagedkv-ignored-fields"


@dataclass
class Job:
    """One OpenAI request, ready to run: its engine requests and how to answer."""

    requests: list[engine_pb2.GenerateRequest]
    envelope: Envelope
    num_choices: int
    view: View
    stream: bool
    include_usage: bool
    ignored: list[str]  # body fields nothing read (x-pagedkv-ignored-fields)


def _front(request: Request) -> Front:
    return request.app.state.front


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    front = _front(request)
    info = await front.model_info()
    adapters = [adapter_card(front, info, a) for a in await front.adapters()]
    return {"object": "list", "data": [model_card(front, info), *adapters]}


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
    front = _front(request)
    info, model, adapter = await front.resolve_model(body.model)
    prompts = body.prompts()
    sampling = body.engine_sampling()
    texts = front.token_texts(info)
    view = View(
        chat=False,
        texts=texts.with_ids() if body.return_tokens_as_token_ids else texts,
        top=body.top_logprobs(),
        echo_texts=await _echo_texts(front, prompts) if body.echo else None,
        prompt_only=body.prompt_only,
        prompt_k=body.prompt_logprobs,
    )
    rid = f"cmpl-{uuid.uuid4().hex}"
    job = Job(
        build_requests(rid, prompts, sampling, body.priority, body.cache_salt or "", adapter=adapter),
        Envelope(rid, "text_completion", model),
        len(prompts) * body.n,
        view,
        body.stream,
        body.include_usage,
        body.ignored_fields(),
    )
    return await _run(request, job)


async def _echo_texts(front: Front, prompts: list) -> list[str]:
    """Each prompt's text as echo shows it: a text prompt as sent, token ids decoded (special
    tokens included: the prompt is shown as the model read it)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append(prompt)
            continue
        try:
            out.append((await front.client.detokenize(prompt, timeout=30.0)).text)
        except ClientError as e:
            raise from_client_error(e) from None
    return out


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    body.check_refused()
    front = _front(request)
    info, model, adapter = await front.resolve_model(body.model)
    template = template_for(front.chat_template, info.facts.tokenizer_kind)
    calls = ToolCalling.of(body, template.text)
    images: list[bytes] | None = [] if info.facts.image_patch_size else None
    messages = body.template_messages(images, f"model {model!r} takes no images (a text-only model)")
    images = images or []
    prompt = template.render(
        messages, body.add_generation_prompt, body.chat_template_kwargs, calls.definitions
    )
    top = body.top_logprobs_count()
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        max_tokens = default_chat_max_tokens(info, prompt, len(images))
    texts = front.token_texts(info)
    view = View(
        chat=True,
        texts=texts.with_ids() if body.return_tokens_as_token_ids else texts,
        top=top,
        prompt_k=body.prompt_logprobs,
        tool_format=calls.parse_format,
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    job = Job(
        build_requests(
            rid,
            [prompt],
            body.sampling(max_tokens, top, calls.constraint),
            body.priority,
            body.cache_salt or "",
            images,
            adapter,
        ),
        Envelope(rid, "chat.completion", model),
        body.n,
        view,
        body.stream,
        body.include_usage,
        body.ignored_fields(),
    )
    return await _run(request, job)


def default_chat_max_tokens(info: engine_pb2.ModelInfo, prompt: str, num_images: int = 0) -> int:
    """OpenAI's chat default is "as many as fit". The front does not tokenize, so it bounds
    the prompt's tokens from above: its UTF-8 bytes (exact for the byte tokenizer), + 1 for a
    Hugging Face tokenizer (each token covers at least one byte; a prefix-space token may be
    added), + each image's most placeholder tokens (max_pixels / (patch x merge)^2). What
    fits: the model's max length, and in a paged pool its blocks."""
    prompt_bound = len(prompt.encode("utf-8")) + (0 if info.facts.tokenizer_kind == "byte" else 1)
    if num_images:
        token_pixels = (info.facts.image_patch_size * info.facts.image_merge_size) ** 2
        prompt_bound += num_images * (info.facts.image_max_pixels // token_pixels)
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


def _ignored_headers(job: Job) -> dict[str, str]:
    """Fields accepted but not acted on are named, never silently dropped (and logged)."""
    if not job.ignored:
        return {}
    log.warning("openai.ignored_fields", fields=job.ignored, request_id=job.envelope.fields["id"])
    return {IGNORED_FIELDS_HEADER: ",".join(job.ignored)[:1024]}


async def _run(request: Request, job: Job) -> Response:
    front = _front(request)
    headers = _ignored_headers(job)
    usage = UsageTotals(job.view.prompt_only)
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
        return SSEResponse(_events(job, streams, first, usage), headers=headers)

    async def whole():
        async with EngineStreams(front.client, job.requests) as streams:
            choices = await collect(streams, job.num_choices, usage)
        await job.view.texts.fetch(job.view.token_ids(choices))
        return choices

    try:
        choices = await until_disconnect(request.receive, whole())
    except ClientDisconnected:
        return Response(status_code=499)  # never delivered
    return JSONResponse(job.view.body(job.envelope, choices, usage.json()), headers=headers)


async def _events(job: Job, streams: EngineStreams, first: list, usage: UsageTotals) -> AsyncIterator[bytes]:
    """The SSE body: chunks for the messages already read, then the rest, then usage, [DONE].
    An engine failure after the 200 is sent as an error event (OpenAI's and vLLM's way)."""
    env = job.envelope
    env.fields["object"] = "chat.completion.chunk" if job.view.chat else "text_completion"
    usage_extra = {"usage": None} if job.include_usage else {}
    maker = ChunkMaker(job.view)
    try:
        if job.view.chat:
            for i in range(job.num_choices):
                yield sse_event(env.body([maker.role_chunk(i)], **usage_extra))
        pending = iter(first)
        while True:
            event = next(pending, None) or await streams.next()
            if event is None:
                break
            index, prompt, msg = event
            usage.add(prompt, msg)
            choice = await maker.choice(index, prompt, msg)
            if choice is not None:
                yield sse_event(env.body([choice], **usage_extra))
        if job.include_usage:
            yield sse_event(env.body([], usage=usage.json()))
    except ApiError as e:
        yield sse_event(e.body())
    finally:
        await streams.close()
    yield DONE_EVENT
