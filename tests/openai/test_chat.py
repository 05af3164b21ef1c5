"""/v1/chat/completions: the chat template rendered as transformers renders it, special tokens
reaching the engine as single ids, the default model's template, streaming and n > 1."""

from __future__ import annotations

import openai
import pytest
from tokenizers import Tokenizer

from pagedkv.openai_api.chat_template import DEFAULT_TEMPLATE, ChatTemplate, load_chat_template
from tests.openai.harness import SPECIAL_TOKENS, HttpFront

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": 'Hi <there> & "you"'},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
]
# Whitespace-control and helper cases transformers handles specially: trim_blocks/lstrip_blocks,
# tojson without HTML escaping, loop controls, a namespace, bos_token from the config.
TRICKY_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'assistant' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}] {{ m.role }}: {{ m.content | tojson }}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT ({{ eos_token }}):{% endif %}"""


def _transformers_render(model_dir, template: str, messages: list) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("template", ["model", "tricky", "default"])
def test_rendering_matches_transformers(hf_model_dir, template):
    loaded = load_chat_template(str(hf_model_dir))
    text = {"model": loaded.text, "tricky": TRICKY_TEMPLATE, "default": DEFAULT_TEMPLATE}[template]
    mine = ChatTemplate("test", text, loaded.special_tokens)
    as_text = [
        {**m, "content": "part one\npart two"} if isinstance(m["content"], list) else m for m in MESSAGES
    ]
    expected = _transformers_render(hf_model_dir, text, as_text)
    assert mine.render(as_text) == expected
    assert loaded.special_tokens["bos_token"] == "<|endoftext|>"  # read from its AddedToken dict form


def test_special_tokens_in_the_template_reach_the_engine_as_single_ids(sim):
    """The rendered prompt goes to the engine as text; its HF tokenizer must turn every
    `<|im_start|>` into the one special id, not 12 byte tokens. Proof: the chat's output equals
    Generate's for the token ids transformers' tokenizer makes (the sim worker's tokens are a
    hash of the whole context), and the prompt token count matches."""
    messages = MESSAGES[1:3]  # user first: the template starts with bos_token
    rendered = _transformers_render(sim.model_dir, load_chat_template(str(sim.model_dir)).text, messages)
    tok = Tokenizer.from_file(str(sim.model_dir / "tokenizer.json"))
    ids = tok.encode(rendered, add_special_tokens=False).ids
    special_ids = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert rendered.startswith("<|endoftext|>")
    assert sum(i in special_ids for i in ids) == 6  # bos, 2 x (start, end), the generation prompt's start
    ref = sim.stack.client.complete(token_ids=ids, max_tokens=12)[0]
    r = sim.sdk().chat.completions.create(model=sim.model, messages=messages, max_tokens=12)
    sim.stack.wait_idle()
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-") and r.model == sim.model


def test_streaming_chat_and_n(sim):
    client = sim.sdk()
    whole = client.chat.completions.create(model=sim.model, messages=MESSAGES, max_tokens=6, n=2)
    chunks = list(
        client.chat.completions.create(
            model=sim.model,
            messages=MESSAGES,
            max_tokens=6,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    sim.stack.wait_idle()
    assert [c.message.content for c in whole.choices] == [
        "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
        for i in range(2)
    ]
    assert whole.choices[0].message.content != whole.choices[1].message.content
    roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]  # one role chunk per choice, first
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)


def test_template_errors_and_unsupported_parts_are_400(sim):
    client = sim.sdk()
    with pytest.raises(openai.BadRequestError, match="unknown role tool"):
        client.chat.completions.create(
            model=sim.model, messages=[{"role": "tool", "content": "x"}], max_tokens=2
        )
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError, match="takes no images"):  # a text-only model
        client.chat.completions.create(
            model=sim.model, messages=[{"role": "user", "content": image}], max_tokens=2
        )
    audio = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    with pytest.raises(openai.BadRequestError, match="only text and image_url parts"):
        client.chat.completions.create(
            model=sim.model, messages=[{"role": "user", "content": audio}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match="function.name"):
        client.chat.completions.create(
            model=sim.model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            tools=[{"type": "function", "function": {"parameters": {}}}],
        )
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        client.chat.completions.create(model=sim.model, messages=[], max_tokens=2)


def test_a_model_without_a_template_cannot_chat_but_can_complete(sim):
    """An HF-tokenizer model and no template given: a clear 400, never a guessed format."""
    bare = HttpFront(sim.stack.address, sim.stack.loop)
    try:
        client = openai.OpenAI(base_url=bare.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--chat-template") as e:
            client.chat.completions.create(model=sim.model, messages=[{"role": "user", "content": "x"}])
        assert e.value.code == "no_chat_template"
        assert (
            client.completions.create(model=sim.model, prompt="x", max_tokens=2).choices[0].text is not None
        )
    finally:
        bare.close()
    sim.stack.wait_idle()


def test_default_model_uses_the_documented_template(real):
    """No template given and a byte tokenizer: DEFAULT_TEMPLATE, rendered as plain bytes."""
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "héllo"}]
    prompt = ChatTemplate("test", DEFAULT_TEMPLATE).render(messages)
    assert (
        prompt
        == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    )
    ref = real.stack.client.complete(prompt, max_tokens=10, ignore_eos=True, logprobs=True)[0]
    r = real.sdk().chat.completions.create(
        model=real.model,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    real.stack.wait_idle()
    assert r.choices[0].message.content == ref.text
    assert [t.logprob for t in r.choices[0].logprobs.content] == ref.logprobs
    assert r.usage.prompt_tokens == len(prompt.encode())


def test_default_chat_max_tokens_fills_the_room_left(sim):
    """No max_tokens: as many as surely fit. The front bounds the prompt's tokens by its UTF-8
    bytes + 1 (it does not tokenize); the limit here is the KV pool, below max_model_len."""
    info = sim.stack.client.model_info()
    messages = [{"role": "user", "content": "fill the pool"}]
    rendered = load_chat_template(str(sim.model_dir)).render(messages)
    r = sim.sdk().chat.completions.create(model=sim.model, messages=messages)
    sim.stack.wait_idle()
    pool_tokens = (info.facts.num_blocks - 1) * info.facts.block_size
    assert pool_tokens < info.facts.max_model_len
    assert r.usage.completion_tokens == pool_tokens - (len(rendered.encode()) + 1)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens < len(rendered.encode())  # special tokens: fewer tokens than bytes
