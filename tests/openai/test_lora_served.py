"""LoRA adapters served end to end: the real CPU worker behind the control plane's gRPC Engine
API and the HTTP front. Adapters load at start (WorkerConfig.loras, i.e. `--lora`, adopted by
the control plane when it connects) and at run time (LoadAdapter, /v1/load_lora_adapter); a
request's tokens on an adapter equal peft's greedy tokens (gRPC), and the OpenAI `model` field
naming the adapter gives the same text; /v1/models lists every adapter with its parent;
unknown adapters are NOT_FOUND / 404 naming them; bad checkpoints INVALID_ARGUMENT / 400; the
LoRA endpoints sit behind the API key."""

from __future__ import annotations

import grpc
import httpx
import pytest

from pagedkv.client import ClientError
from tests.grpc.harness import Stack
from tests.openai.harness import HttpFront, write_hf_checkpoint
from tests.worker.lora_adapters import make_adapter, peft_greedy

KEY = "lora-test-key"
PROMPT = [5, 17, 42, 9, 77, 3, 120, 64, 11]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from worker import Worker, WorkerConfig

    path = tmp_path_factory.mktemp("lora-served")
    (path / "base").mkdir()
    hf_model = write_hf_checkpoint(path / "base")
    peft_models = {
        "A": make_adapter(hf_model, path / "A", seed=21),
        "B": make_adapter(hf_model, path / "B", seed=22, rank=4, targets=["q_proj", "down_proj"]),
    }
    config = WorkerConfig(model=str(path / "base"), num_blocks=128, loras=(("A", str(path / "A")),))
    stack = Stack(lambda: Worker(config))
    try:
        front = HttpFront(stack.address, stack.loop, api_key=KEY)
    except BaseException:
        stack.close()
        raise
    yield stack, front, path, hf_model, peft_models
    front.close()
    stack.close()


def _tokens(stack, adapter: str) -> tuple[list[int], str]:
    [done] = stack.client.complete(
        token_ids=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, adapter=adapter
    )
    return done.token_ids, done.text


def test_grpc_requests_on_adapters_match_peft(served):
    stack, _, path, hf_model, peft_models = served
    assert [a.name for a in stack.client.list_adapters()] == ["A"]  # --lora, adopted at connect
    info = stack.client.load_adapter("B", str(path / "B"))
    assert info.rank == 4 and info.adapter_id.startswith("B@")
    assert _tokens(stack, "A")[0] == peft_greedy(peft_models["A"], PROMPT, 6)
    assert _tokens(stack, "B")[0] == peft_greedy(peft_models["B"], PROMPT, 6)
    assert _tokens(stack, "")[0] == peft_greedy(hf_model, PROMPT, 6)
    with pytest.raises(ClientError) as err:
        _tokens(stack, "nope")
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.details
    with pytest.raises(ClientError) as err:
        stack.client.load_adapter("C", str(path / "base"))  # a model, not an adapter
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json" in err.value.details
    stack.client.unload_adapter("B")
    with pytest.raises(ClientError) as err:
        stack.client.unload_adapter("B")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert [a.name for a in stack.client.list_adapters()] == ["A"]
    assert _tokens(stack, "A")[0] == peft_greedy(peft_models["A"], PROMPT, 6)  # others unharmed


def test_openai_model_field_names_an_adapter(served):
    stack, front, path, _, _ = served
    with httpx.Client(base_url=front.base_url, timeout=60.0) as http:
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"lora_name": "B", "lora_path": str(path / "B")}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 401  # behind the key
        reply = http.post("/v1/load_lora_adapter", json=body, headers=auth)
        assert reply.status_code == 200 and "'B'" in reply.text
        models = http.get("/v1/models", headers=auth).json()["data"]
        base = models[0]["id"]
        assert [(m["id"], m.get("parent")) for m in models] == [(base, None), ("A", base), ("B", base)]
        for name in ("A", "B"):
            request = {"model": name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            reply = http.post("/v1/completions", json=request, headers=auth)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == name
            assert reply.json()["choices"][0]["text"] == _tokens(stack, name)[1]
        request = {"model": "nope", "prompt": PROMPT, "max_tokens": 2}
        reply = http.post("/v1/completions", json=request, headers=auth)
        assert reply.status_code == 404 and "'nope'" in reply.json()["error"]["message"]
        bad = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "C", "lora_path": "/nowhere"}, headers=auth
        )
        assert bad.status_code == 400 and "/nowhere" in bad.json()["error"]["message"]
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "B"}, headers=auth)
        assert gone.status_code == 200
        again = http.post("/v1/unload_lora_adapter", json={"lora_name": "B"}, headers=auth)
        assert again.status_code == 404
        assert [m["id"] for m in http.get("/v1/models", headers=auth).json()["data"]] == [base, "A"]
