"""Logprobs, echo and prompt logprobs through the HTTP front, against transformers' own model
of the served checkpoint (`hf_real`): every logprob and alternative a response shows is
log_softmax of transformers' logits at that position (the raw distribution), at any
temperature; tokens show as their own bytes."""

from __future__ import annotations

import pytest
import torch

from base.tokenizer import HFTokenizer, token_display

REL = 1e-4  # fp32 checkpoint, fp32 forward: logits agree to float rounding


def hf_logprobs(served, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row i = log_softmax of the logits after token_ids[: i + 1]."""
    with torch.no_grad():
        logits = served.hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def tokenizer(served) -> HFTokenizer:
    return HFTokenizer((served.model_dir / "tokenizer.json").read_text())


def shown(served, token_id: int) -> str:
    return token_display(tokenizer(served).token_bytes(token_id))


def assert_top(entry: dict, row: torch.Tensor, k: int, served, also: int | None = None) -> None:
    """A completions top_logprobs dict: the k most likely tokens of `row` (and `also`)."""
    values, ids = torch.topk(row, k)
    want = {shown(served, int(t)): float(v) for t, v in zip(ids, values, strict=True)}
    if also is not None:
        want.setdefault(shown(served, also), float(row[also]))
    assert entry.keys() == want.keys()
    for key, value in want.items():
        assert entry[key] == pytest.approx(value, rel=REL, abs=1e-5)


PROMPT = "Paged attention: 日本 naïve!"


def test_echo_with_max_tokens_0_scores_the_prompt_like_transformers(hf_real):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0 -> the prompt's text, its
    tokens and their logprobs (the first has none), nothing generated."""
    ids = tokenizer(hf_real).encode(PROMPT)
    r = hf_real.sdk().completions.create(
        model=hf_real.model, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0, temperature=0
    )
    hf_real.stack.wait_idle()
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [shown(hf_real, t) for t in ids]
    assert any(t.startswith("bytes:") for t in lp.tokens)  # parts of 日 and 本 show as bytes
    want = hf_logprobs(hf_real, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(float(want[p - 1, ids[p]]), rel=REL, abs=1e-5)
        assert_top(lp.top_logprobs[p], want[p - 1], 3, hf_real, also=ids[p])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] == len(PROMPT) - 1  # the last token is "!"


def test_echo_with_generation_appends_the_generated_tokens(hf_real):
    kw = dict(model=hf_real.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    plain = hf_real.sdk().completions.create(**kw).choices[0]
    echoed = hf_real.sdk().completions.create(echo=True, **kw).choices[0]
    hf_real.stack.wait_idle()
    num_prompt = len(tokenizer(hf_real).encode(PROMPT))
    assert echoed.text == PROMPT + plain.text
    assert echoed.logprobs.tokens[num_prompt:] == plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[num_prompt:] == plain.logprobs.token_logprobs
    assert echoed.logprobs.top_logprobs[num_prompt:] == plain.logprobs.top_logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chat_top_logprobs_are_transformers_raw_distribution(hf_real, temperature):
    """At any temperature each token's logprob and its 5 alternatives are log_softmax of the
    raw logits at its position; `bytes` are the token's own bytes."""
    common = dict(
        model=hf_real.model,
        messages=[{"role": "user", "content": "Say something in 日本語"}],
        max_tokens=8,
        temperature=temperature,
        seed=7,
        logprobs=True,
    )
    r = hf_real.sdk().chat.completions.create(
        top_logprobs=5,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": False},
        **common,
    )
    ids_r = hf_real.sdk().chat.completions.create(
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **common
    )
    hf_real.stack.wait_idle()
    content = r.choices[0].logprobs.content
    generated = [int(e.token.removeprefix("token_id:")) for e in ids_r.choices[0].logprobs.content]
    assert len(content) == len(generated) == 8
    chat = hf_real.front.front.chat_template.render(
        [{"role": "user", "content": "Say something in 日本語"}], True, None
    )
    prompt = tokenizer(hf_real).encode(chat)
    assert r.usage.prompt_tokens == len(prompt)
    want = hf_logprobs(hf_real, prompt + generated)
    pieces = tokenizer(hf_real)
    for i, (entry, token) in enumerate(zip(content, generated, strict=True)):
        row = want[len(prompt) - 1 + i]
        assert entry.token == token_display(pieces.token_bytes(token))
        assert bytes(entry.bytes) == pieces.token_bytes(token)
        assert entry.logprob == pytest.approx(float(row[token]), rel=REL, abs=1e-5)
        values, top_ids = torch.topk(row, 5)
        assert [e.token for e in entry.top_logprobs] == [shown(hf_real, int(t)) for t in top_ids]
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(values.tolist(), rel=REL, abs=1e-5)
    if temperature == 0.0:
        assert all(e.token == e.top_logprobs[0].token for e in content)


def test_prompt_logprobs_extra_skips_the_prefix_cache(hf_real):
    """vLLM's prompt_logprobs: every prompt position computed, even when the same prompt's
    blocks sit in the prefix cache (a cached block has no logits)."""
    prompt = "a prompt long enough to fill more than one block of sixteen tokens, twice over"
    ids = tokenizer(hf_real).encode(prompt)
    client = hf_real.sdk()
    client.completions.create(model=hf_real.model, prompt=prompt, max_tokens=1)  # fills the cache
    warm = client.completions.create(model=hf_real.model, prompt=prompt, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    r = client.completions.create(
        model=hf_real.model, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    hf_real.stack.wait_idle()
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    entries = r.choices[0].model_extra["prompt_logprobs"]
    want = hf_logprobs(hf_real, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry = entries[p]
        values, top_ids = torch.topk(want[p - 1], 2)
        for rank, (t, v) in enumerate(zip(top_ids.tolist(), values.tolist(), strict=True), start=1):
            assert entry[str(t)]["rank"] == rank
            assert entry[str(t)]["logprob"] == pytest.approx(v, rel=REL, abs=1e-5)
        assert entry[str(ids[p])]["logprob"] == pytest.approx(float(want[p - 1, ids[p]]), rel=REL, abs=1e-5)
        assert entry[str(ids[p])]["decoded_token"] == shown(hf_real, ids[p])


def test_streamed_echo_equals_the_whole_response(hf_real):
    kw = dict(model=hf_real.model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True)
    client = hf_real.sdk()
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    hf_real.stack.wait_idle()
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert chunks[-1].finish_reason == "length"


def test_repetition_penalty_greedy_equals_transformers_generate(hf_real):
    """The penalties in extra_body, and Hugging Face's repetition penalty exactly."""
    ids = tokenizer(hf_real).encode("abcabcabc")
    r = hf_real.sdk().completions.create(
        model=hf_real.model,
        prompt=ids,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"repetition_penalty": 1.8, "ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    hf_real.stack.wait_idle()
    got = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    with torch.no_grad():
        out = hf_real.hf_model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=12, repetition_penalty=1.8
        )
    assert got == out[0, len(ids) :].tolist()


def test_logit_bias_allowed_ids_min_tokens_and_penalties_reach_the_sampler(hf_real):
    client = hf_real.sdk()
    kw = dict(model=hf_real.model, prompt="x", max_tokens=6, temperature=0, logprobs=0)

    def ids_of(r):
        return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]

    as_ids = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    biased = client.completions.create(logit_bias={"65": 100}, extra_body=as_ids, **kw)
    assert ids_of(biased) == [65] * 6
    allowed = client.completions.create(extra_body={"allowed_token_ids": [66, 67], **as_ids}, **kw)
    assert set(ids_of(allowed)) <= {66, 67}
    # EOS (<|im_end|>, 257) pushed to the top: it ends the sample as soon as min_tokens allows
    eos_first = {"return_tokens_as_token_ids": True}
    stop = client.completions.create(logit_bias={"257": 100}, extra_body={"min_tokens": 3, **eos_first}, **kw)
    assert ids_of(stop)[:3] != [257] * 3 and 257 not in ids_of(stop)[:3]
    assert stop.choices[0].finish_reason == "stop" and stop.usage.completion_tokens == 4
    plain = client.completions.create(extra_body=as_ids, **{**kw, "prompt": "aaaa", "max_tokens": 12})
    penalized = client.completions.create(
        presence_penalty=2.0,
        frequency_penalty=2.0,
        extra_body=as_ids,
        **{**kw, "prompt": "aaaa", "max_tokens": 12},
    )
    hf_real.stack.wait_idle()
    ref = hf_real.stack.client.complete(
        "aaaa", max_tokens=12, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True
    )[0]
    assert ids_of(penalized) == list(ref.token_ids) != ids_of(plain)
