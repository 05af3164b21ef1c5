"""vLLM's endpoints besides the OpenAI API: POST /tokenize, POST /detokenize, GET
/tokenizer_info, GET /v1/models/{model}, GET /version and GET /metrics.

Clients that use them: lm-eval's RemoteTokenizer (`/tokenizer_info`, then `/tokenize` with
{"prompt", "add_special_tokens": false} and `/detokenize` with {"tokens"}), prompt-length
checks before a request, the openai SDK's `models.retrieve`, Prometheus and the Gateway API
inference extension's endpoint picker (`/metrics`, front_metrics.py).

Tokenizing is the Engine's (`Tokenize` / `Detokenize`): the front holds no tokenizer, so the
ids are exactly those Generate uses. The chat form of /tokenize renders the messages with
the chat template exactly as /v1/chat/completions does, so its count equals that route's
usage.prompt_tokens.

`router` goes behind the API key like /v1/*; `open_router` (/version, /metrics) does not:
vLLM leaves /metrics open too, for scrapers that carry no key (it shows no request content).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from base.tokenizer import token_display
from base.v1 import engine_pb2
from pagedkv.client import ClientError
from pagedkv.openai_api.chat_template import ChatTemplate, default_template, template_for
from pagedkv.openai_api.errors import ApiError, bad_request, from_client_error
from pagedkv.openai_api.front import Front
from pagedkv.openai_api.front_metrics import CONTENT_TYPE, exposition, read_engine
from pagedkv.openai_api.protocol import ChatMessage

router = APIRouter()
open_router = APIRouter()

_UINT32 = 2**32
ENGINE_TIMEOUT_S = 30.0  # a hang guard: tokenizing even 64 x max_model_len characters is fast
# transformers' class for what the Engine tokenizes with: a tokenizer.json is a fast tokenizer.
_TOKENIZER_CLASS = {"hf": "PreTrainedTokenizerFast", "byte": "ByteTokenizer"}


def _front(request: Request) -> Front:
    return request.app.state.front


async def _engine(call):
    try:
        return await call
    except ClientError as e:
        raise from_client_error(e) from None


class TokenizeRequest(BaseModel):
    """vLLM's two /tokenize bodies in one: {prompt} or {messages} (exactly one)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    # False for both forms. vLLM defaults a prompt's to True because its /v1/completions adds
    # BOS; pagedkv's Generate never adds special tokens, so False is what makes the count equal
    # /v1/completions' usage.prompt_tokens (a chat template writes its own BOS).
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def text(self, loaded: ChatTemplate | None, info: engine_pb2.ModelInfo) -> str:
        """The prompt, or the messages rendered as /v1/chat/completions renders them."""
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send exactly one of 'prompt' (a string) or 'messages' (a chat)", "prompt")
        if self.prompt is not None:
            return self.prompt
        if not self.messages:
            raise bad_request("messages is empty", "messages")
        template = template_for(loaded, info.facts.tokenizer_kind)  # as routes.chat_completions
        messages = [m.for_template() for m in self.messages]
        return template.render(messages, self.add_generation_prompt, self.chat_template_kwargs)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[StrictInt]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """{count, max_model_len, tokens, token_strs}: token_strs (with return_token_strs) shows
    each token on its own, bytes that are not UTF-8 on their own escaped (token_display)."""
    front = _front(request)
    info, _, _ = await front.resolve_model(body.model)
    text = body.text(front.chat_template, info)
    reply = await _engine(
        front.client.tokenize(text, add_special_tokens=body.add_special_tokens, timeout=ENGINE_TIMEOUT_S)
    )
    ids = list(reply.token_ids)
    token_strs = None
    if body.return_token_strs:
        pieces = await _engine(front.client.detokenize(ids, timeout=ENGINE_TIMEOUT_S))
        token_strs = [token_display(b) for b in pieces.token_bytes]
    return {"count": len(ids), "max_model_len": reply.max_model_len, "tokens": ids, "token_strs": token_strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    """{prompt}: the ids decoded together, special tokens shown (transformers' decode())."""
    front = _front(request)
    await front.resolve_model(body.model)
    if any(not 0 <= t < _UINT32 for t in body.tokens):
        raise bad_request("tokens must be token ids (>= 0)", "tokens")
    reply = await _engine(front.client.detokenize(body.tokens, timeout=ENGINE_TIMEOUT_S))
    return {"prompt": reply.text}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    """What a client-side tokenizer facade needs: the special-token strings and the chat
    template the front renders with (null where there is none: the byte tokenizer has no
    special-token strings; a checkpoint without a template has no template)."""
    front = _front(request)
    info = await front.model_info()
    kind = info.facts.tokenizer_kind
    template = front.chat_template or (default_template() if kind == "byte" else None)
    special = template.special_tokens if template is not None else {}
    return {
        "tokenizer_class": _TOKENIZER_CLASS.get(kind),
        **{k: special.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
        "chat_template": template.text if template is not None else None,
        "model_max_length": info.facts.max_model_len,
        "vocab_size": info.facts.vocab_size,
    }


def model_card(front: Front, info: engine_pb2.ModelInfo, model_id: str | None = None) -> dict:
    """One entry of GET /v1/models: OpenAI's Model object, plus vLLM's max_model_len."""
    return {
        "id": model_id or info.facts.model_name,
        "object": "model",
        "created": front.started,
        "owned_by": "pagedkv",
        "max_model_len": info.facts.max_model_len,
    }


def adapter_card(front: Front, info: engine_pb2.ModelInfo, adapter: engine_pb2.AdapterInfo) -> dict:
    """A LoRA adapter's entry (vLLM's): `parent` is the base model, `root` its directory."""
    card = model_card(front, info, adapter.name)
    return {**card, "root": adapter.path, "parent": info.facts.model_name}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict:
    """The served model's card under the id asked for (its name or an alias), else a 404."""
    front = _front(request)
    if not model_id:  # resolve_model reads "" as "the served model"; a URL must name one
        raise ApiError(404, "no model id in the URL: GET /v1/models/{model}", code="model_not_found")
    info, name, adapter = await front.resolve_model(model_id)
    if adapter:
        return adapter_card(front, info, next(a for a in await front.adapters() if a.name == adapter))
    return model_card(front, info, name)


def pagedkv_version() -> str:
    try:
        return importlib.metadata.version("pagedkv")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "0+unknown"


@open_router.get("/version")
async def version() -> dict:
    return {"version": pagedkv_version()}


@open_router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text: the front's request metrics and the Engine's gauges (front_metrics.py);
    200 also while the Engine is down (then pagedkv_engine_up is 0)."""
    snapshot = await read_engine(_front(request))
    body = exposition(request.app.state.request_metrics, snapshot)
    return Response(body, media_type=CONTENT_TYPE)
