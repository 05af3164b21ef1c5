"""One OpenAI request's engine work: a `Generate` stream per prompt, merged into one.

A request carries P prompts (a batch, /v1/completions only) of n samples each; the Engine runs
n natively per prompt, so there are P gRPC streams and choice `prompt * n + sample` (OpenAI's
order). Each stream is read by its own task into one queue. Closing an `EngineStreams`
cancels the tasks, which cancels their gRPC calls: the Engine then aborts the requests and
frees their KV blocks within one step. That is how a client's disconnect, a failure of one
prompt of a batch, or a server shutdown all release the engine's memory.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from base.v1 import engine_pb2
from pagedkv.client import AsyncClient, ClientError
from pagedkv.openai_api.errors import ApiError, from_client_error
from pagedkv.openai_api.logprobs import TokenLogprobs

_DONE = object()


def build_requests(
    request_id: str,
    prompts: list,
    sampling: engine_pb2.SamplingParams,
    priority: int,
    cache_salt: str,
    images: list[bytes] = (),
    adapter: str = "",
) -> list[engine_pb2.GenerateRequest]:
    """One GenerateRequest per prompt; ids `request_id` (one prompt) or `request_id-i`, so
    `pagedkv block-table ID` finds an HTTP request's blocks. `images`: a chat's (one prompt)."""
    out = []
    for i, prompt in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        text, ids = (prompt, []) if isinstance(prompt, str) else ("", prompt)
        out.append(
            engine_pb2.GenerateRequest(
                request_id=rid,
                text=text,
                token_ids=ids,
                sampling=sampling,
                priority=priority,
                cache_salt=cache_salt,
                images=[engine_pb2.ImageInput(data=data) for data in images],
                adapter=adapter,
            )
        )
    return out


class EngineStreams:
    """The merged messages of several Generate streams, as (choice index, prompt index,
    GenerateResponse). Use as `async with`: leaving cancels whatever still runs."""

    def __init__(self, client: AsyncClient, requests: list[engine_pb2.GenerateRequest]) -> None:
        self._client = client
        self._requests = requests
        self._queue: asyncio.Queue = asyncio.Queue()  # unbounded: a put never waits
        self._tasks: list[asyncio.Task] = []
        self._open = len(requests)
        self._n = max(1, requests[0].sampling.n) if requests else 1  # samples per prompt

    async def __aenter__(self) -> EngineStreams:
        self._tasks = [asyncio.ensure_future(self._pump(i, r)) for i, r in enumerate(self._requests)]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, prompt: int, request: engine_pb2.GenerateRequest) -> None:
        try:
            async for msg in self._client.generate_request(request):
                self._queue.put_nowait((prompt, msg))
        except ClientError as e:
            self._queue.put_nowait((prompt, from_client_error(e)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- reported to the HTTP client as a 500
            self._queue.put_nowait((prompt, ApiError(500, f"engine call failed: {e!r}", type="server_error")))
        else:
            self._queue.put_nowait((prompt, _DONE))

    async def next(self):
        """The next (choice index, prompt index, message), or None when every stream has ended.
        A failed stream raises its ApiError (the others are cancelled by `close`)."""
        while self._open:
            prompt, item = await self._queue.get()
            if item is _DONE:
                self._open -= 1
                continue
            if isinstance(item, ApiError):
                raise item
            return prompt * self._n + item.index, prompt, item
        return None

    async def first_of_each(self) -> list:
        """Messages up to the first of every prompt: a request the Engine refuses fails here,
        before a streaming response has sent its 200 status. Returns the messages read."""
        seen: set[int] = set()
        read = []
        while len(seen) < len(self._requests):
            event = await self.next()
            if event is None:
                break
            read.append(event)
            seen.add(event[1])
        return read


@dataclass
class ChoiceOutput:
    """One sample's output, accumulated from its messages."""

    index: int
    prompt_index: int = 0
    text: str = ""
    generated: TokenLogprobs = field(default_factory=TokenLogprobs.empty)
    prompt: TokenLogprobs | None = None  # SamplingParams.prompt_logprobs: every prompt token
    finish_reason: int = 0
    usage: engine_pb2.Usage | None = None

    def add(self, msg: engine_pb2.GenerateResponse) -> None:
        self.text += msg.text
        self.generated.extend_generated(msg)
        if len(msg.prompt_logprobs):
            self.prompt = TokenLogprobs.of_prompt(msg.prompt_logprobs)
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
            self.usage = msg.usage


class UsageTotals:
    """OpenAI usage over a request: each prompt counted once (its samples share it), every
    sample's completion tokens (none when the request only scores its prompt: echo with
    max_tokens 0 leaves out the one token the Engine made), and the prompt tokens the prefix
    cache served."""

    def __init__(self, prompt_only: bool = False) -> None:
        self._prompts: dict[int, engine_pb2.Usage] = {}
        self.completion_tokens = 0
        self._prompt_only = prompt_only

    def add(self, prompt: int, msg: engine_pb2.GenerateResponse) -> None:
        if not msg.finish_reason:
            return
        self._prompts.setdefault(prompt, msg.usage)
        if not self._prompt_only:
            self.completion_tokens += msg.usage.completion_tokens

    def json(self) -> dict:
        prompt_tokens = sum(u.prompt_tokens for u in self._prompts.values())
        cached = sum(u.cached_prompt_tokens for u in self._prompts.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


async def collect(streams: EngineStreams, num_choices: int, usage: UsageTotals) -> list[ChoiceOutput]:
    """Every choice's whole output (a non-streaming response), counted into `usage`."""
    choices = [ChoiceOutput(i) for i in range(num_choices)]
    while (event := await streams.next()) is not None:
        index, prompt, msg = event
        choices[index].prompt_index = prompt
        choices[index].add(msg)
        usage.add(prompt, msg)
    return choices
