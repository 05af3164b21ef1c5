"""vLLM's LoRA endpoints, behind the API key: POST /v1/load_lora_adapter {lora_name,
lora_path} and POST /v1/unload_lora_adapter {lora_name}. They call Engine.LoadAdapter /
UnloadAdapter; a request then names the adapter as its `model` (GET /v1/models lists it with
its `parent`). Errors: 400 for a checkpoint the model cannot serve (the engine's message),
404 for unloading a name that is not loaded."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictStr

from pagedkv.client import ClientError
from pagedkv.openai_api.errors import from_client_error
from pagedkv.openai_api.front import Front

router = APIRouter()
ENGINE_TIMEOUT_S = 120.0  # a load waits for the plans already sent, then reads the files


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_int_id: int | None = None  # vLLM's optional field; the name is what identifies it


def _front(request: Request) -> Front:
    return request.app.state.front


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    try:
        client = _front(request).client
        info = await client.load_adapter(body.lora_name, body.lora_path, timeout=ENGINE_TIMEOUT_S)
    except ClientError as e:
        raise from_client_error(e) from None
    message = f"Success: LoRA adapter '{info.name}' added successfully (id {info.adapter_id})."
    return PlainTextResponse(message)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    try:
        await _front(request).client.unload_adapter(body.lora_name, timeout=ENGINE_TIMEOUT_S)
    except ClientError as e:
        raise from_client_error(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
