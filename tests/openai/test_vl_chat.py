"""Images through the OpenAI front: the SDK sends chat content parts with data-URL images and
gets the text that gRPC (and transformers) give for the same messages; remote URLs, bad data
URLs and images for a text-only model are 400s that say what to do."""

from __future__ import annotations

import base64

import openai
import pytest

from bench.vl_checkpoint import build_vl_checkpoint, hf_generate, make_image, processor
from pagedkv.openai_api.chat_template import load_chat_template
from tests.grpc.harness import Stack
from tests.openai.harness import HttpFront

NUM_TOKENS = 6


@pytest.fixture(scope="module")
def vl_front(tmp_path_factory):
    from worker import Worker, WorkerConfig

    path = tmp_path_factory.mktemp("qwen3vl-openai")
    reference = build_vl_checkpoint(path, seed=5)
    stack = Stack(lambda: Worker(WorkerConfig(model=str(path), num_blocks=256)))
    front = HttpFront(stack.address, stack.loop, chat_template=load_chat_template(str(path)))
    sdk = openai.OpenAI(base_url=front.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield stack, sdk, reference, processor(path)
    front.close()
    stack.close()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_sdk_image_chat_equals_grpc_and_transformers(vl_front):
    stack, sdk, reference, proc = vl_front
    images = [make_image(100, 60, 61), make_image(60, 90, 62)]
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_url(images[0])}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": data_url(images[1])}},
    ]
    hf_messages = [
        {"role": "user", "content": [p if p["type"] == "text" else {"type": "image"} for p in parts]}
    ]
    _, _, expected, _ = hf_generate(reference, proc, hf_messages, images, NUM_TOKENS)
    reply = sdk.chat.completions.create(
        model=stack.client.model_info().facts.model_name,
        messages=[{"role": "user", "content": parts}],
        max_tokens=NUM_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = proc.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    (via_grpc,) = stack.client.complete(text, images=images, max_tokens=NUM_TOKENS, ignore_eos=True)
    assert via_grpc.token_ids == expected
    assert reply.choices[0].message.content == via_grpc.text
    assert reply.usage.prompt_tokens == via_grpc.usage.prompt_tokens
    stack.wait_idle()


@pytest.mark.parametrize(
    "url,message",
    [
        ("https://example.com/cat.png", "remote image URLs are not fetched"),
        ("data:image/png;base64,@@@", "base64 does not decode"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "cannot be decoded"),
    ],
    ids=["remote", "bad-base64", "undecodable"],
)
def test_bad_image_parts_are_400(vl_front, url, message):
    stack, sdk, _, _ = vl_front
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(
            model=stack.client.model_info().facts.model_name,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            max_tokens=2,
        )
    assert message in info.value.message
    stack.wait_idle()


def test_images_for_a_text_only_model_are_400(sim):
    png = make_image(32, 32, 1)
    with pytest.raises(openai.BadRequestError) as info:
        sim.sdk().chat.completions.create(
            model=sim.model,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}}]}
            ],
            max_tokens=2,
        )
    assert "takes no images" in info.value.message
