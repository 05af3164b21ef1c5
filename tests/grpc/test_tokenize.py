"""Tokenize / Detokenize through the served stack: the ids are the ones Generate computes
from the same text, Detokenize round-trips them with each token's own bytes, and every
refusal names its problem.

Stacks: the torch-free ScriptedWorker with a Hugging Face byte-level tokenizer that has
special tokens (its tokens hash the context read back through the paged KV, so equal
outputs mean equal prompts), the real embedded default worker with the byte tokenizer, and
a ScriptedWorker with no tokenizer.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from base.tokenizer import ByteTokenizer, token_display
from control_plane.engine_loop import AsyncEngine
from control_plane.limits import MAX_CHARS_PER_TOKEN, MAX_DETOKENIZE_IDS
from control_plane.service import create_server, shutdown
from control_plane.sim_worker import sim_next_token
from control_plane.worker_client import WorkerClient
from pagedkv.client import AsyncClient, ClientError, build_request
from tests.grpc.conftest import ScriptedWorker
from tests.grpc.harness import Stack

tokenizers = pytest.importorskip("tokenizers")

TEXT = "naïve café 日本語 🙂"
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def hf_tokenizer_json() -> str:
    """A byte-level BPE (256 byte tokens, one merge that cuts 日 in two) + special tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str("日")[0][0]
    vocab = {c: i for i, c in enumerate(alphabet)} | {split[:2]: len(alphabet)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(split[0], split[1])]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok.to_str()


@pytest.fixture(scope="module")
def hf_json() -> str:
    return hf_tokenizer_json()


def _hf_worker(tokenizer_json: str, vocab_size: int):
    def make():
        w = ScriptedWorker(tokenizer="hf", vocab_size=vocab_size, num_blocks=64, block_size=16)
        w._info = dataclasses.replace(w._info, tokenizer_json=tokenizer_json)
        return w

    return make


@pytest.fixture(scope="module")
def hf_stack(hf_json):
    vocab = tokenizers.Tokenizer.from_str(hf_json).get_vocab_size(with_added_tokens=True)
    stack = Stack(_hf_worker(hf_json, vocab + 16))  # the model's vocab padded past the tokenizer's
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def byte_stack():
    from worker import Worker, WorkerConfig

    stack = Stack(lambda: Worker(WorkerConfig(num_blocks=128)))
    yield stack
    stack.close()


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ClientError) as e:
        call()
    return e.value.code, e.value.details


# -- Tokenize is Generate's tokenization ------------------------------------------------------
def test_tokenize_equals_generate_on_the_hf_tokenizer(hf_stack, hf_json):
    c = hf_stack.client
    text = f"<|im_start|>user\n{TEXT}<|im_end|>"
    resp = c.tokenize(text)
    ids = list(resp.token_ids)
    assert ids == tokenizers.Tokenizer.from_str(hf_json).encode(text, add_special_tokens=False).ids
    assert resp.max_model_len == c.model_info().facts.max_model_len
    by_text = c.complete(text, max_tokens=4)[0]
    by_ids = c.complete(token_ids=ids, max_tokens=4)[0]
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.token_ids == by_ids.token_ids
    vocab = c.model_info().facts.vocab_size
    assert by_text.token_ids[0] == sim_next_token(ids, 0, vocab)  # the prompt the worker read
    hf_stack.wait_idle()


def test_tokenize_equals_generate_on_the_real_byte_model(byte_stack):
    c = byte_stack.client
    resp = c.tokenize(TEXT)
    assert list(resp.token_ids) == list(TEXT.encode())
    assert resp.max_model_len == c.model_info().facts.max_model_len
    req = build_request(TEXT, max_tokens=2)
    req.sampling.prompt_logprobs = 0
    msgs = list(c.generate_request(req))
    assert [p.token_id for p in msgs[0].prompt_logprobs] == list(resp.token_ids)
    assert msgs[-1].usage.prompt_tokens == len(resp.token_ids)
    with_bos = c.tokenize(TEXT, add_special_tokens=True).token_ids
    assert list(with_bos) == [ByteTokenizer.BOS, *resp.token_ids]
    byte_stack.wait_idle()


def test_tokenize_empty_text_is_no_ids(hf_stack):
    assert list(hf_stack.client.tokenize("").token_ids) == []


# -- Detokenize -------------------------------------------------------------------------------
def test_detokenize_round_trip_with_token_bytes(hf_stack):
    c = hf_stack.client
    text = f"{TEXT}<|im_end|>"
    ids = list(c.tokenize(text).token_ids)
    resp = c.detokenize(ids)
    assert resp.text == text  # special tokens shown by default, as transformers' decode()
    assert c.detokenize(ids, skip_special_tokens=True).text == TEXT
    assert b"".join(resp.token_bytes) == text.encode()
    assert list(resp.special) == [False] * (len(ids) - 1) + [True]
    assert resp.token_bytes[-1] == b"<|im_end|>"
    # 日 is cut in two by the merge: neither half is text, and their displays differ
    cut = [i for i, b in enumerate(resp.token_bytes) if b in (b"\xe6\x97", b"\xa5")]
    assert [resp.token_bytes[i] for i in cut] == [b"\xe6\x97", b"\xa5"]
    assert [token_display(resp.token_bytes[i]) for i in cut] == ["bytes:\\xe6\\x97", "bytes:\\xa5"]


def test_detokenize_on_the_real_byte_model(byte_stack):
    c = byte_stack.client
    ids = [ByteTokenizer.BOS, *TEXT.encode(), ByteTokenizer.EOS]
    resp = c.detokenize(ids)
    assert resp.text == f"<|bos|>{TEXT}<|eos|>"
    assert c.detokenize(ids, skip_special_tokens=True).text == TEXT
    assert resp.token_bytes[0] == b"<|bos|>" and resp.token_bytes[-1] == b"<|eos|>"
    assert b"".join(resp.token_bytes[1:-1]) == TEXT.encode()
    assert list(resp.special) == [True] + [False] * len(TEXT.encode()) + [True]


def test_detokenize_id_past_the_tokenizer_but_inside_the_model_vocab(hf_stack):
    """A padded vocab's extra ids: valid, and they stand for nothing."""
    last = hf_stack.client.model_info().facts.vocab_size - 1
    (a,) = hf_stack.client.tokenize("a").token_ids
    resp = hf_stack.client.detokenize([a, last])
    assert resp.text == "a" and list(resp.token_bytes) == [b"a", b""] and list(resp.special) == [False, False]


def test_detokenize_many_ids(hf_stack):
    """Past DETOKENIZE_INLINE_IDS the work runs on a thread: same answer."""
    ids = list(hf_stack.client.tokenize("ab" * 5000).token_ids)
    assert len(ids) == 10_000
    resp = hf_stack.client.detokenize(ids)
    assert resp.text == "ab" * 5000 and len(resp.token_bytes) == len(resp.special) == 10_000


def test_async_client(hf_stack):
    async def run():
        async with AsyncClient(hf_stack.address) as c:
            ids = (await c.tokenize(TEXT)).token_ids
            return list(ids), await c.detokenize(ids)

    ids, resp = asyncio.run(run())
    assert ids == list(hf_stack.client.tokenize(TEXT).token_ids)
    assert resp.text == TEXT


# -- refusals ---------------------------------------------------------------------------------
def test_text_over_the_limit_is_refused(hf_stack):
    max_len = hf_stack.client.model_info().facts.max_model_len
    limit = max_len * MAX_CHARS_PER_TOKEN
    assert len(hf_stack.client.tokenize("a" * limit).token_ids) == limit  # the limit itself is fine
    code, details = _code(lambda: hf_stack.client.tokenize("a" * (limit + 1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{limit + 1} characters" in details and str(limit) in details


def test_id_outside_the_vocab_is_refused_by_name(hf_stack):
    vocab = hf_stack.client.model_info().facts.vocab_size
    code, details = _code(lambda: hf_stack.client.detokenize([1, 2, vocab + 7]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"token id {vocab + 7}" in details and str(vocab) in details


def test_too_many_ids_are_refused(hf_stack):
    code, details = _code(lambda: hf_stack.client.detokenize([1] * (MAX_DETOKENIZE_IDS + 1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAX_DETOKENIZE_IDS) in details and str(MAX_DETOKENIZE_IDS + 1) in details
    assert len(hf_stack.client.detokenize([1] * MAX_DETOKENIZE_IDS).token_bytes) == MAX_DETOKENIZE_IDS


def test_a_model_without_a_tokenizer(make_stack):
    stack = make_stack(worker={"tokenizer": "none"})
    for call in (lambda: stack.client.tokenize("hi"), lambda: stack.client.detokenize([1])):
        code, details = _code(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "this model has no tokenizer on the server" in details


def test_unavailable_before_a_worker_connected(tmp_path):
    """Nothing listens at the worker address: the engine has no tokenizer yet."""

    async def run():
        engine = AsyncEngine(WorkerClient(f"unix://{tmp_path}/none.sock"))
        server, address = await create_server("127.0.0.1:0", engine)
        try:
            async with AsyncClient(address, timeout=30) as c:
                codes = []
                for call in (c.tokenize("hi"), c.detokenize([1])):
                    with pytest.raises(ClientError) as e:
                        await call
                    codes.append((e.value.code, e.value.details))
                return codes
        finally:
            await shutdown(server, engine, grace=0)

    for code, details in asyncio.run(run()):
        assert code == grpc.StatusCode.UNAVAILABLE and "no worker has connected" in details


def test_grpcurl_reflection_knows_the_new_rpcs(hf_stack):
    from tests.grpc.test_grpcurl import grpcurl

    desc = grpcurl(hf_stack.address, "describe", "pagedkv.v1.Engine")
    assert "rpc Tokenize" in desc and "rpc Detokenize" in desc
    out = grpcurl(hf_stack.address, "pagedkv.v1.Engine/Tokenize", data={"text": "hi"})
    assert '"tokenIds"' in out or '"token_ids"' in out
