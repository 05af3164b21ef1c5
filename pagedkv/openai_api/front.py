"""What every route needs besides its request: the Engine client, the chat template, the
served model's name and aliases, the API key (`request.app.state.front`).

The front is a client of the Engine like any other: one `pagedkv.client.AsyncClient` channel,
made in the server's event loop when it starts (lifespan). It holds no engine state; the
ModelInfo it needs (name, limits, tokenizer kind) is re-read at most every
`MODEL_INFO_TTL_S`, so a restarted worker with another model is noticed.
"""

from __future__ import annotations

import time

from base.security import ClientSecurity
from base.v1 import engine_pb2
from pagedkv.client import AsyncClient, ClientError
from pagedkv.openai_api.chat_template import ChatTemplate
from pagedkv.openai_api.errors import ApiError, from_client_error
from pagedkv.openai_api.logprobs import TokenTexts

MODEL_INFO_TTL_S = 2.0


class Front:
    """Everything a route needs besides its request."""

    def __init__(
        self,
        engine: str,
        *,
        security: ClientSecurity | None = None,
        chat_template: ChatTemplate | None = None,
        model_aliases: tuple[str, ...] = (),
        api_key: str | None = None,
    ) -> None:
        self.engine = engine
        self.security = security or ClientSecurity()
        self.chat_template = chat_template
        self.model_aliases = model_aliases  # names accepted besides ModelInfo.model_name
        self.api_key = api_key
        self.client: AsyncClient | None = None
        self.started = int(time.time())
        self._info: engine_pb2.ModelInfo | None = None
        self._info_at = 0.0
        self._texts: TokenTexts | None = None
        self._texts_instance = ""

    async def open(self) -> None:
        self.client = AsyncClient(self.engine, security=self.security)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def model_info(self) -> engine_pb2.ModelInfo:
        now = time.monotonic()
        if self._info is None or now - self._info_at > MODEL_INFO_TTL_S:
            try:
                self._info = await self.client.model_info(timeout=10.0)
            except ClientError as e:
                raise from_client_error(e) from None
            self._info_at = now
        return self._info

    def token_texts(self, info: engine_pb2.ModelInfo) -> TokenTexts:
        """The token-text cache of the model `info` describes (a new worker instance may serve
        another tokenizer: its cache starts empty)."""
        if self._texts is None or self._texts_instance != info.facts.instance_id:
            has_tokenizer = info.facts.tokenizer_kind not in ("", "none")
            self._texts = TokenTexts(self.client, has_tokenizer)
            self._texts_instance = info.facts.instance_id
        return self._texts

    async def resolve_model(self, requested: str | None) -> tuple[engine_pb2.ModelInfo, str, str]:
        """(ModelInfo, the model name to report, the LoRA adapter to run: "" = the base). A
        missing or empty `model` means the served model; its name or an alias too; a loaded
        adapter's name (vLLM's convention) runs that adapter; anything else is a 404."""
        info = await self.model_info()
        if not requested:
            return info, info.facts.model_name, ""
        if requested == info.facts.model_name or requested in self.model_aliases:
            return info, requested, ""
        if any(a.name == requested for a in await self.adapters()):
            return info, requested, requested
        raise ApiError(
            404,
            f"the model {requested!r} does not exist; this server serves {info.facts.model_name!r} "
            "and the LoRA adapters GET /v1/models lists",
            param="model",
            code="model_not_found",
        )

    async def adapters(self) -> list[engine_pb2.AdapterInfo]:
        """The loaded LoRA adapters, asked each time (loads and unloads show at once)."""
        try:
            return await self.client.list_adapters(timeout=10.0)
        except ClientError as e:
            raise from_client_error(e) from None
