"""Qwen3-VL served: client -> Engine (gRPC) -> control plane (image checks, placeholder
expansion, image-aware prefix hashes) -> worker. Greedy tokens equal transformers' generate on
the same chat-templated prompt and images; the prefix cache hits for the same image and never
for a different image behind the same placeholder ids; bad images are INVALID_ARGUMENT naming
the limit, leak nothing and do not disturb other requests."""

from __future__ import annotations

import io
import threading

import grpc
import pytest
from PIL import Image

from bench.vl_checkpoint import build_vl_checkpoint, hf_generate, make_image, processor
from pagedkv.client import ClientError
from tests.grpc.harness import Stack

NUM_TOKENS = 6
SYSTEM = "You are a careful assistant who looks at pictures and answers briefly. " * 2


@pytest.fixture(scope="module")
def vl_stack(tmp_path_factory):
    from worker import Worker, WorkerConfig

    path = tmp_path_factory.mktemp("qwen3vl-served")
    reference = build_vl_checkpoint(path, seed=3)
    stack = Stack(lambda: Worker(WorkerConfig(model=str(path), num_blocks=256, block_size=16)))
    yield stack, reference, processor(path)
    stack.close()


def chat(proc, *parts, system: str | None = None) -> tuple[list[dict], str]:
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    return messages, proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def complete(stack, text: str, images: list[bytes], **kw):
    (c,) = stack.client.complete(text, images=images, max_tokens=NUM_TOKENS, ignore_eos=True, **kw)
    return c


@pytest.mark.parametrize(
    "sizes,parts",
    [([(100, 60)], (None, "What is this?")), ([(100, 60), (50, 120)], ("Compare", None, "to", None))],
    ids=["single", "multi"],
)
def test_served_greedy_equals_transformers(vl_stack, sizes, parts):
    stack, reference, proc = vl_stack
    images = [make_image(w, h, seed=i + 40) for i, (w, h) in enumerate(sizes)]
    messages, text = chat(proc, *parts)
    prompt, _, expected, _ = hf_generate(reference, proc, messages, images, NUM_TOKENS)
    c = complete(stack, text, images)
    assert c.token_ids == expected
    assert c.usage.prompt_tokens == len(prompt)  # expanded exactly as the processor does
    stack.wait_idle()


def test_prefix_cache_hits_the_same_image_and_never_another(vl_stack):
    stack, reference, proc = vl_stack
    image_a, image_b = make_image(96, 64, seed=7), make_image(96, 64, seed=8)  # same size: same ids
    messages, text = chat(proc, None, "Describe it.", system=SYSTEM)
    prompt, _, expected_a, _ = hf_generate(reference, proc, messages, [image_a], NUM_TOKENS)
    _, _, expected_b, _ = hf_generate(reference, proc, messages, [image_b], NUM_TOKENS)
    assert expected_a != expected_b, "the test needs images that change the answer"
    first = complete(stack, text, [image_a])
    again = complete(stack, text, [image_a])
    other = complete(stack, text, [image_b])
    assert first.token_ids == again.token_ids == expected_a
    assert other.token_ids == expected_b
    image_offset = prompt.index(reference.config.image_token_id)
    full_blocks = (len(prompt) - 1) // 16 * 16
    assert again.usage.cached_prompt_tokens == full_blocks  # every full block, image included
    # a different image: only the blocks wholly before its placeholders are shared
    assert other.usage.cached_prompt_tokens == image_offset // 16 * 16
    stack.wait_idle()


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _huge_png_header() -> bytes:
    """A PNG claiming 100000 x 100000 pixels (header only; nothing to decode)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)  # the start of the first row; the rest is missing
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


BAD = {
    "undecodable": ([b"definitely not an image"], 1, "cannot be decoded"),
    "truncated": ([make_image(64, 64, 1)[:80]], 1, "cannot be decoded"),
    "empty": ([b""], 1, "empty"),
    "one-pixel": ([_png(1, 1)], 1, "at least 2"),
    "enormous": ([_huge_png_header()], 1, "limit is 67108864 pixels"),
    "elongated": ([_png(600, 2)], 1, "aspect ratio"),
    "too-many": ([_png(32, 32)] * 9, 9, "at most 8 images"),
    "count-mismatch": ([_png(32, 32)] * 2, 1, "2 images"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_images_are_invalid_argument_and_leak_nothing(vl_stack, case):
    stack, _, proc = vl_stack
    images, num_markers, message = BAD[case]
    _, text = chat(proc, *([None] * num_markers), "hi")
    result = {}
    good = threading.Thread(target=lambda: result.update(c=complete(stack, text[:0] + "plain text", [])))
    good.start()  # another request runs meanwhile and is unaffected
    with pytest.raises(ClientError) as info:
        complete(stack, text, images)
    good.join(60)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details
    assert len(result["c"].token_ids) == NUM_TOKENS
    stack.wait_idle()


def test_model_info_reports_the_image_facts_and_limits(vl_stack, real_stack):
    stack, reference, _ = vl_stack
    info = stack.client.model_info()
    assert info.facts.image_token_id == reference.config.image_token_id
    assert (info.facts.image_patch_size, info.facts.image_merge_size) == (16, 2)
    assert info.image_limits.max_images == 8 and info.image_limits.max_image_pixels == 64 * 1024 * 1024
    text_only = real_stack.client.model_info()
    assert text_only.facts.image_patch_size == 0 and not text_only.HasField("image_limits")


def test_images_for_a_text_only_model_are_refused(real_stack):
    with pytest.raises(ClientError) as info:
        real_stack.client.complete(token_ids=[1, 2, 3], images=[_png(32, 32)], max_tokens=2)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "takes no images" in info.value.details
    real_stack.wait_idle()


def test_cli_generate_with_image_files(vl_stack, tmp_path, capsys):
    """`pagedkv generate PROMPT --image FILE`: the marker is put before a prompt without one,
    and the ids equal the gRPC client's for the same prompt and image."""
    from pagedkv.cli import main

    stack, _, _ = vl_stack
    png = make_image(80, 60, 90)
    (tmp_path / "a.png").write_bytes(png)
    code = main(["generate", "--server", stack.address, "Describe.", "--image", str(tmp_path / "a.png"),
                 "--max-tokens", str(NUM_TOKENS), "--ignore-eos", "--ids"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    expected = complete(stack, "<|vision_start|><|image_pad|><|vision_end|>Describe.", [png])
    assert [int(t) for t in out.split()] == expected.token_ids
    assert main(["generate", "--server", stack.address, "x", "--image", str(tmp_path / "missing.png")]) != 0
    stack.wait_idle()
