"""/v1/completions through the real openai SDK (and raw SSE through httpx), checked against the
gRPC `Generate` of the same engine for the same request."""

from __future__ import annotations

import codecs
import json

import pytest

from pagedkv.openai_api.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS


def sse_payloads(text: str) -> list:
    """The `data:` payloads of an SSE body, asserting the framing: events separated by a blank
    line, each one `data: ...` line, the last one `[DONE]`."""
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def shown_bytes(token: str) -> bytes:
    """A logprobs token string back to its bytes (`bytes:\\xNN..` for a part of a character)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:") :].split("\\x")[1:])
    return token.encode()


# -- the real model: equal tokens, logprobs ------------------------------------------------
def test_greedy_completion_equals_grpc_generate(real):
    """Same text, same per-token logprobs (so the same tokens) and the same usage as Generate."""
    ref = real.stack.client.complete("The paged KV cache", max_tokens=24, logprobs=True, ignore_eos=True)[0]
    r = real.sdk().completions.create(
        model=real.model,
        prompt="The paged KV cache",
        max_tokens=24,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    real.stack.wait_idle()
    choice = r.choices[0]
    assert choice.text == ref.text
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=0)
    tokens = choice.logprobs.tokens
    assert len(tokens) == 24
    # each token shows its own bytes (ids >= 256 are the byte tokenizer's special tokens, not text)
    pieces = [shown_bytes(t) for t, i in zip(tokens, ref.token_ids, strict=True) if i < 256]
    assert pieces == [bytes([i]) for i in ref.token_ids if i < 256]
    assert b"".join(pieces).decode("utf-8", errors="replace") == ref.text
    # logprobs: 0 -> no alternatives, only the chosen token (vLLM's shape)
    assert choice.logprobs.top_logprobs == [{t: lp} for t, lp in zip(tokens, ref.logprobs, strict=True)]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens == len(b"The paged KV cache")
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert r.model == real.model and r.object == "text_completion" and r.id.startswith("cmpl-")


def test_use_beam_search_equals_grpc_beam_search(real):
    """vLLM-style beam search in the body: width best_of (default n), the n best beams, in the
    Engine's order (best first), each equal to gRPC Generate's beam."""
    ref = real.stack.client.complete(
        "Beams share blocks", max_tokens=12, beam_width=4, n=2, length_penalty=0.5, ignore_eos=True
    )
    r = real.sdk().completions.create(
        model=real.model,
        prompt="Beams share blocks",
        max_tokens=12,
        n=2,
        best_of=4,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True},
    )
    real.stack.wait_idle()
    assert [c.text for c in r.choices] == [c.text for c in ref]
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 24


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
        ({"use_beam_search": True, "best_of": 1, "n": 2}, "best_of"),
        ({"length_penalty": 0.5}, "length_penalty"),
    ],
)
def test_use_beam_search_refuses_sampling_fields(real, extra, param):
    body = {"model": real.model, "prompt": "x", "max_tokens": 4, **extra}
    with real.http() as http:
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_token_id_prompt_and_one_top_logprob_at_temperature_zero(real):
    ref = real.stack.client.complete(token_ids=[1, 2, 3, 300], max_tokens=8, logprobs=True, ignore_eos=True)[
        0
    ]
    r = real.sdk().completions.create(
        model=real.model,
        prompt=[1, 2, 3, 300],
        max_tokens=8,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    real.stack.wait_idle()
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == ref.logprobs
    # greedy: the most likely alternative is the chosen token itself
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, ref.logprobs, strict=True)]
    # a token starts after the characters completed before it (special tokens add none)
    decoder, chars, want = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0, []
    for t in ref.token_ids:
        want.append(chars)
        chars += len(decoder.decode(bytes([t]) if t < 256 else b""))
    assert lp.text_offset == want


def test_streaming_concatenates_to_the_non_streaming_text(real):
    client = real.sdk()
    kw = dict(
        model=real.model, prompt="stream me", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    real.stack.wait_idle()
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_seeded_samples_match_grpc_by_index(real):
    """n > 1 runs natively in the engine; choice i is the engine's sample i (seed + index)."""
    ref = real.stack.client.complete("fan out", max_tokens=10, n=3, temperature=0.9, seed=11, ignore_eos=True)
    r = real.sdk().completions.create(
        model=real.model,
        prompt="fan out",
        max_tokens=10,
        n=3,
        temperature=0.9,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    real.stack.wait_idle()
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in ref]
    assert len({c.text for c in r.choices}) > 1  # the samples differ: the index mapping is tested
    assert r.usage.prompt_tokens == len(b"fan out") and r.usage.completion_tokens == 30


# -- the sim worker: stop conditions, batches, SSE framing ---------------------------------
def test_stop_string_cuts_the_text(sim):
    full = sim.stack.client.complete("stop here", max_tokens=40)[0].text
    stop = next(full[i : i + 2] for i in range(10, 30) if "\ufffd" not in full[i : i + 2])
    r = sim.sdk().completions.create(model=sim.model, prompt="stop here", max_tokens=40, stop=stop)
    sim.stack.wait_idle()
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_stop_token_ids(sim):
    ids = sim.stack.client.complete("stop ids", max_tokens=30)[0].token_ids
    target = ids[12]
    r = sim.sdk().completions.create(
        model=sim.model, prompt="stop ids", max_tokens=30, extra_body={"stop_token_ids": [target]}
    )
    sim.stack.wait_idle()
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == ids.index(target) + 1


def test_batch_of_prompts_orders_choices_prompt_major(sim):
    prompts = ["first", "second prompt"]
    refs = [sim.stack.client.complete(p, max_tokens=6, n=2) for p in prompts]
    r = sim.sdk().completions.create(model=sim.model, prompt=prompts, max_tokens=6, n=2)
    sim.stack.wait_idle()
    assert [c.text for c in r.choices] == [c.text for ref in refs for c in ref]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(b"first") + len(b"second prompt")  # once per prompt, not per sample
    assert r.usage.completion_tokens == 4 * 6


def test_batch_of_token_id_prompts(sim):
    refs = [sim.stack.client.complete(token_ids=p, max_tokens=4)[0].text for p in ([5, 6, 7], [8, 9])]
    r = sim.sdk().completions.create(model=sim.model, prompt=[[5, 6, 7], [8, 9]], max_tokens=4)
    sim.stack.wait_idle()
    assert [c.text for c in r.choices] == refs


def test_default_max_tokens_is_openais(sim):
    r = sim.sdk().completions.create(model=sim.model, prompt="defaults")
    sim.stack.wait_idle()
    assert r.usage.completion_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS


def test_raw_sse_stream_with_usage_and_n(sim):
    ref = sim.stack.client.complete("raw", max_tokens=5, n=2)
    with sim.http() as http:
        body = {"model": sim.model, "prompt": "raw", "max_tokens": 5, "n": 2, "stream": True}
        body["stream_options"] = {"include_usage": True}
        resp = http.post("/v1/completions", json=body)
    sim.stack.wait_idle()
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(resp.text)
    *chunks, last = payloads
    assert all(p["usage"] is None and len(p["choices"]) == 1 for p in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert last["usage"]["prompt_tokens"] == 3 and "cached_tokens" in last["usage"]["prompt_tokens_details"]
    for i in range(2):
        mine = [p["choices"][0] for p in chunks if p["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == ref[i].text
        assert [c["finish_reason"] for c in mine][-1] == "length"
    assert {p["id"] for p in payloads} == {payloads[0]["id"]} and payloads[0]["model"] == sim.model


def test_cached_tokens_report_prefix_cache_hits(sim):
    prompt = "a shared prefix that spans more than two blocks of sixteen tokens each!"
    client = sim.sdk()
    client.completions.create(model=sim.model, prompt=prompt, max_tokens=2)
    r = client.completions.create(model=sim.model, prompt=prompt, max_tokens=2)
    sim.stack.wait_idle()
    # Whole blocks of the repeated prompt come from the cache (the last partial one never does).
    assert r.usage.prompt_tokens_details.cached_tokens == (len(prompt.encode()) - 1) // 16 * 16


def test_model_may_be_omitted_and_is_reported_back(sim):
    with sim.http() as http:
        r = http.post("/v1/completions", json={"prompt": "no model", "max_tokens": 2})
        named = http.post("/v1/completions", json={"model": sim.model, "prompt": "x", "max_tokens": 2})
    sim.stack.wait_idle()
    assert r.status_code == 200 and r.json()["model"] == sim.model
    assert named.json()["model"] == sim.model


def test_models_lists_the_served_model(sim):
    models = sim.sdk().models.list().data
    assert [m.id for m in models] == [sim.model] == ["sim"]
    assert models[0].owned_by == "pagedkv" and models[0].model_extra["max_model_len"] == 4096


def test_unknown_and_ignored_fields_are_named_not_silently_dropped(sim, caplog):
    with sim.http() as http:
        body = {"prompt": "x", "max_tokens": 2, "user": "u", "frobnicate": 3, "guided_decoding_backend": "x"}
        resp = http.post("/v1/completions", json=body)
        clean = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        streamed = http.post("/v1/completions", json={**body, "stream": True})
    sim.stack.wait_idle()
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pagedkv-ignored-fields"] == "frobnicate,guided_decoding_backend,user"
    assert streamed.headers["x-pagedkv-ignored-fields"] == "frobnicate,guided_decoding_backend,user"
    assert "x-pagedkv-ignored-fields" not in clean.headers
