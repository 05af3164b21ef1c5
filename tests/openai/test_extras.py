"""vLLM's extra endpoints: /tokenize and /detokenize agree with what the generation routes
count, /tokenizer_info, GET /v1/models/{id} (the openai SDK's models.retrieve), /version, and
/metrics (the front's request metrics and the Engine's gauges under vLLM's names)."""

from __future__ import annotations

import importlib.metadata
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.openai_api.chat_template import DEFAULT_TEMPLATE, load_chat_template
from tests.openai.conftest import serve_sim
from tests.openai.harness import CHATML_TEMPLATE, TIMEOUT_S, HttpFront
from tests.openai.test_errors import assert_error, wait_for

PROMPTS = {"sim": "<|im_start|>héllo wörld<|im_end|>", "real": "héllo wörld"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <3"}]
VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
)


@pytest.fixture(params=["sim", "real"])
def served(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def slow(hf_model_dir):
    """sim with 10 ms per engine step: a long request stays running while the test looks."""
    served = serve_sim(hf_model_dir, worker={"delay_s": 0.01})
    yield served
    served.close()


def post(served, path: str, body: dict) -> dict:
    with served.http() as http:
        resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


# -- /tokenize, /detokenize ------------------------------------------------------------------
def test_tokenize_counts_what_completions_counts(served):
    """lm-eval's body; the ids are Generate's (gRPC Tokenize), the count its usage."""
    name = "sim" if served.model == "sim" else "real"
    prompt = PROMPTS[name]
    r = served.sdk().completions.create(model=served.model, prompt=prompt, max_tokens=1)
    served.stack.wait_idle()
    out = post(served, "/tokenize", {"prompt": prompt, "add_special_tokens": False})
    assert out["count"] == len(out["tokens"]) == r.usage.prompt_tokens
    assert out["tokens"] == list(served.stack.client.tokenize(prompt).token_ids)
    assert out["max_model_len"] == served.stack.client.model_info().facts.max_model_len
    assert out["token_strs"] is None
    assert post(served, "/tokenize", {"model": served.model, "prompt": prompt}) == out  # the default
    if name == "sim":  # special-token text is one id, as in a rendered chat
        assert len(out["tokens"]) == len("héllo wörld".encode()) + 2


def test_add_special_tokens_adds_the_byte_tokenizers_bos(real):
    plain = post(real, "/tokenize", {"prompt": "ab"})["tokens"]
    assert plain == [97, 98]
    assert post(real, "/tokenize", {"prompt": "ab", "add_special_tokens": True})["tokens"] == [256, 97, 98]


def test_tokenize_messages_counts_what_chat_counts(served):
    r = served.sdk().chat.completions.create(model=served.model, messages=CHAT, max_tokens=1)
    served.stack.wait_idle()
    out = post(served, "/tokenize", {"messages": CHAT})
    assert out["count"] == r.usage.prompt_tokens
    without = post(served, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert 0 < without["count"] < out["count"]
    assert out["tokens"][: without["count"]] == without["tokens"]


def test_tokenize_messages_renders_the_chat_template(sim):
    """The checkpoint's ChatML template, rendered; its special tokens are single ids."""
    out = post(sim, "/tokenize", {"messages": CHAT[1:], "return_token_strs": True})
    rendered = load_chat_template(str(sim.model_dir)).render(CHAT[1:], add_generation_prompt=True)
    assert "".join(out["token_strs"]) == rendered and rendered.startswith("<|endoftext|>")
    assert out["token_strs"][0] == "<|endoftext|>"
    assert out["token_strs"].count("<|im_start|>") == 2 and out["token_strs"].count("<|im_end|>") == 1


def test_token_strs_show_each_token_alone(sim):
    out = post(sim, "/tokenize", {"prompt": "<|im_start|>hé", "return_token_strs": True})
    assert out["token_strs"] == ["<|im_start|>", "h", "bytes:\\xc3", "bytes:\\xa9"]


def test_detokenize_round_trips(served):
    name = "sim" if served.model == "sim" else "real"
    tokens = post(served, "/tokenize", {"prompt": PROMPTS[name]})["tokens"]
    assert post(served, "/detokenize", {"tokens": tokens}) == {"prompt": PROMPTS[name]}
    assert post(served, "/detokenize", {"model": served.model, "tokens": []}) == {"prompt": ""}


def test_tokenize_and_detokenize_errors(sim):
    vocab = sim.stack.client.model_info().facts.vocab_size
    with sim.http() as http:
        neither = http.post("/tokenize", json={"add_special_tokens": False})
        both = http.post("/tokenize", json={"prompt": "x", "messages": CHAT})
        empty = http.post("/tokenize", json={"messages": []})
        bad_role = http.post("/tokenize", json={"messages": [{"role": "tool", "content": "x"}]})
        other_model = http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"})
        negative = http.post("/detokenize", json={"tokens": [-1]})
        too_big = http.post("/detokenize", json={"tokens": [vocab]})
    assert "exactly one of 'prompt'" in assert_error(neither, 400, "prompt")["message"]
    assert_error(both, 400, "prompt")
    assert_error(empty, 400, "messages")
    assert "unknown role tool" in assert_error(bad_role, 400, "messages")["message"]
    assert_error(other_model, 404, "model", "model_not_found")
    assert_error(negative, 400, "tokens")
    assert_error(too_big, 400)


# -- /tokenizer_info, /v1/models/{id}, /version ----------------------------------------------
def test_tokenizer_info(sim, real):
    with sim.http() as http:
        info = http.get("/tokenizer_info").json()
    facts = sim.stack.client.model_info().facts
    assert info == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": None,
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": facts.max_model_len,
        "vocab_size": facts.vocab_size,
    }
    with real.http() as http:
        info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "ByteTokenizer" and info["chat_template"] == DEFAULT_TEMPLATE
    assert info["eos_token"] is info["bos_token"] is info["pad_token"] is info["unk_token"] is None


def test_models_retrieve(sim):
    model = sim.sdk().models.retrieve("sim")
    assert (model.id, model.object, model.owned_by) == ("sim", "model", "pagedkv")
    with sim.http() as http:
        listed = http.get("/v1/models").json()["data"]
        card = http.get("/v1/models/sim").json()
        missing = http.get("/v1/models/nope")
        nothing = http.get("/v1/models/")
    assert listed == [card]
    assert "'sim'" in assert_error(missing, 404, "model", "model_not_found")["message"]
    assert_error(nothing, 404, code="model_not_found")
    with pytest.raises(openai.NotFoundError) as e:
        sim.sdk().models.retrieve("gpt-4")
    assert e.value.code == "model_not_found"


def test_models_retrieve_an_alias_with_a_slash(sim):
    aliased = HttpFront(sim.stack.address, sim.stack.loop, model_aliases=("org/served",))
    try:
        sdk = openai.OpenAI(base_url=aliased.base_url + "/v1", api_key="x", max_retries=0)
        model = sdk.models.retrieve("org/served")
        assert model.id == "org/served" and model.model_extra["max_model_len"] > 0
    finally:
        aliased.close()


def test_version(sim):
    with sim.http() as http:
        assert http.get("/version").json() == {"version": importlib.metadata.version("pagedkv")}


def test_api_key_guards_tokenizer_routes_not_metrics_version_health(sim):
    keyed = HttpFront(sim.stack.address, sim.stack.loop, api_key="sekret")
    try:
        with httpx.Client(base_url=keyed.base_url, timeout=TIMEOUT_S) as http:
            assert_error(http.post("/tokenize", json={"prompt": "x"}), 401, code="invalid_api_key")
            assert_error(http.post("/detokenize", json={"tokens": [1]}), 401)
            assert_error(http.get("/tokenizer_info"), 401)
            assert_error(http.get("/v1/models/sim"), 401)
            for path in ("/metrics", "/version", "/health"):
                assert http.get(path).status_code == 200, path
            auth = {"authorization": "Bearer sekret"}
            assert http.post("/tokenize", json={"prompt": "x"}, headers=auth).json()["count"] == 1
    finally:
        keyed.close()


# -- /metrics ------------------------------------------------------------------------------
def scrape(served) -> dict:
    with served.http() as http:
        resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    """The one sample of family `name` named `sample` (default: the family's name) whose labels
    include `labels`; 0 if there is none (a series not yet created)."""
    found = [
        s.value
        for s in families[name].samples
        if s.name == (sample or name) and labels.items() <= s.labels.items()
    ]
    assert len(found) <= 1, found
    return found[0] if found else 0.0


def test_metrics_have_vllms_names_and_the_pool_geometry(sim):
    families = scrape(sim)
    for name in VLLM_NAMES:
        assert name in families, name
        assert families[name].samples[0].labels["engine"] == "0"
    assert value(families, "pagedkv_engine_up") == 1 and value(families, "pagedkv_worker_available") == 1
    assert value(families, "vllm:num_requests_running", model_name="sim") == 0
    assert 0 <= value(families, "vllm:kv_cache_usage_perc", model_name="sim") <= 1
    assert families["vllm:prefix_cache_queries"].type == "counter"
    facts = sim.stack.client.model_info().facts
    (config,) = families["vllm:cache_config_info"].samples
    assert config.value == 1
    assert config.labels["block_size"] == str(facts.block_size) == "16"
    assert config.labels["num_gpu_blocks"] == str(facts.num_blocks - 1) == "63"  # the null block is no block
    assert config.labels["cache_dtype"] == facts.dtype


def test_request_metrics_count_each_request(sim):
    key = {"endpoint": "/v1/completions", "method": "POST", "status": "200"}
    before = scrape(sim)
    sim.sdk().completions.create(model="sim", prompt="x", max_tokens=2)
    with sim.http() as http:
        http.get("/v1/models/nope")
        http.get("/no/such/path")
    sim.stack.wait_idle()
    after = scrape(sim)
    total, hist = "pagedkv_http_requests", "pagedkv_http_request_duration_seconds"
    assert value(after, total, total + "_total", **key) == value(before, total, total + "_total", **key) + 1
    assert value(after, hist, hist + "_count", **key) == value(before, hist, hist + "_count", **key) + 1
    assert value(after, hist, hist + "_bucket", le="+Inf", **key) == value(
        after, hist, hist + "_count", **key
    )
    # a route's template, not the URL: ids in paths make no new series
    model_404 = {"endpoint": "/v1/models/{model_id:path}", "status": "404"}
    assert value(after, total, total + "_total", **model_404) >= 1
    assert value(after, total, total + "_total", endpoint="unmatched", status="404") >= 1
    assert not any(s.labels.get("endpoint") == "/metrics" for s in after[total].samples)  # scrapes uncounted


def test_running_gauge_mid_stream_and_stream_latency(slow):
    """While a long stream runs, the Engine's gauge and the front's in-progress gauge show it;
    a stream is measured to its last event, not to its first byte; one the client leaves is
    counted too."""
    hist = "pagedkv_http_request_duration_seconds"
    key = {"endpoint": "/v1/completions", "status": "200"}

    def recorded() -> tuple[float, float]:
        families = scrape(slow)
        return value(families, hist, hist + "_count", **key), value(families, hist, hist + "_sum", **key)

    count0, _ = recorded()
    with slow.http() as http:
        body = {"prompt": "x", "max_tokens": 900, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # held: a dropped iterator closes the connection
            next(line for line in lines if line.startswith("data: {"))
            mid = scrape(slow)
    assert value(mid, "vllm:num_requests_running", model_name="sim") >= 1
    assert value(mid, "pagedkv_http_requests_in_progress") >= 1
    slow.stack.wait_idle(TIMEOUT_S)  # the client left: the stream was aborted
    wait_for(lambda: recorded()[0] == count0 + 1, "the abandoned stream to be recorded", recorded)
    count1, sum1 = recorded()
    with slow.http() as http:
        body = {"prompt": "x", "max_tokens": 20, "stream": True, "ignore_eos": True}
        events = http.post("/v1/completions", json=body).text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and '"finish_reason":"length"' in events[-3]
    count2, sum2 = recorded()
    assert count2 == count1 + 1
    assert sum2 - sum1 >= 20 * 0.01  # 20 engine steps of >= 10 ms, the last after the first byte
    assert value(scrape(slow), "pagedkv_http_requests_in_progress") == 0


def test_metrics_answer_while_the_engine_is_unreachable():
    front = HttpFront("127.0.0.1:1")  # nothing listens on port 1
    try:
        with httpx.Client(base_url=front.base_url, timeout=TIMEOUT_S) as http:
            assert http.get("/v1/models").status_code == 503
            resp = http.get("/metrics")
        assert resp.status_code == 200
        families = {f.name: f for f in text_string_to_metric_families(resp.text)}
        assert families["pagedkv_engine_up"].samples[0].value == 0
        assert not any(name.startswith("vllm:") for name in families)
        assert value(families, "pagedkv_http_requests", "pagedkv_http_requests_total", status="503") == 1
    finally:
        front.close()


def test_tokenize_json_shape_is_vllms(sim):
    """Key order and types as vLLM's TokenizeResponse serializes them."""
    with sim.http() as http:
        raw = http.post("/tokenize", json={"prompt": "ab"}).text
    assert list(json.loads(raw)) == ["count", "max_model_len", "tokens", "token_strs"]
