"""lm-eval 0.4's `local-completions` model against the HTTP front, run as its own CLI from its
own venv (`make lmeval-env`, a prerequisite of `make test`), offline, on the two local tasks in
lm_eval_tasks/: multiple choice (loglikelihood requests: `echo`, `logprobs: 1`, `max_tokens: 1`
on token ids) and generate_until (greedy, stopped at a newline).

The oracle is transformers on the same checkpoint (`hf_real`): every loglikelihood lm-eval
logged is transformers' log-probability of the continuation given the context, tokenized as
lm-eval tokenizes it (`TemplateAPI._encode_pair` on the Hugging Face tokenizer); the task's
accuracy is the one those oracle log-probabilities give; every generation is transformers'
greedy `generate`, cut at EOS and at the first newline. Once with `tokenizer_backend=remote`
(the front's /tokenizer_info, /tokenize and /detokenize) and once with the Hugging Face
tokenizer directory the server loads: the two runs log identical results.

`max_retries=1`: lm-eval retries a refused request with back-off (1 s, 2 s, ... per retry);
here a refusal fails the run at once and its log shows the front's error body.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
MC_TASK, GEN_TASK = "pagedkv_mc", "pagedkv_gen"
BACKENDS = ("remote", "huggingface")
RUN_TIMEOUT_S = 300  # a hang guard only: one run takes a few seconds
REL = 1e-4  # fp32 checkpoint, fp32 forward (as tests/openai/test_logprobs.py)


def lm_eval_exe() -> Path:
    venv = Path(os.environ.get("PAGEDKV_LMEVAL_VENV", REPO / ".venv-lmeval"))
    if not venv.is_absolute():
        venv = REPO / venv
    exe = venv / "bin" / "lm_eval"
    if not exe.exists():
        pytest.fail(
            f"lm-eval is not installed: {exe} is missing. Run `make lmeval-env` (`make test` builds it "
            "first), or set PAGEDKV_LMEVAL_VENV to a venv that has lm_eval[api]==0.4.13"
        )
    return exe


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class LmEvalRun:
    """One `lm_eval run` of both tasks: its results JSON and logged samples, by task."""

    def __init__(self, out: Path, log: str) -> None:
        (results_file,) = out.rglob("results_*.json")
        self.results = json.loads(results_file.read_text())["results"]
        self.samples = {}
        for task in (MC_TASK, GEN_TASK):
            (samples_file,) = out.rglob(f"samples_{task}_*.jsonl")
            self.samples[task] = sorted(read_jsonl(samples_file), key=lambda s: s["doc_id"])
        self.log = log


def run_lm_eval(served, backend: str, out: Path) -> LmEvalRun:
    exe = lm_eval_exe()
    model_args = {
        "base_url": f"{served.front.base_url}/v1/completions",
        "model": served.model,
        "tokenizer_backend": backend,
        "tokenized_requests": "True",
        "num_concurrent": "1",
        "max_retries": "1",
        "max_length": str(served.stack.client.model_info().facts.max_model_len),
        "timeout": "60",
    }
    if backend == "huggingface":
        model_args["tokenizer"] = str(served.model_dir)
    cmd = [
        str(exe),
        "run",
        "--model",
        "local-completions",
        "--model_args",
        ",".join(f"{k}={v}" for k, v in model_args.items()),
        "--tasks",
        f"{MC_TASK},{GEN_TASK}",
        "--include_path",
        str(TASKS_DIR),
        "--output_path",
        str(out / "results"),
        "--log_samples",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(out / "hf-home"),  # the datasets cache too: nothing outside the test's folder
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        TOKENIZERS_PARALLELISM="false",
    )
    # cwd: the task YAMLs name their data files relative to the working directory
    proc = subprocess.run(
        cmd,
        cwd=TASKS_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    served.stack.wait_idle()
    assert proc.returncode == 0, f"lm_eval ({backend}) exited {proc.returncode}:\n{proc.stdout[-8000:]}"
    return LmEvalRun(out / "results", proc.stdout)


@pytest.fixture(scope="module")
def lm_eval_runs(hf_real, tmp_path_factory):
    """backend -> LmEvalRun, each backend run at most once per module."""
    runs: dict[str, LmEvalRun] = {}

    def get(backend: str) -> LmEvalRun:
        if backend not in runs:
            runs[backend] = run_lm_eval(hf_real, backend, tmp_path_factory.mktemp(f"lm-eval-{backend}"))
        return runs[backend]

    return get


@pytest.fixture(scope="module")
def hf_tokenizer(hf_real):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(hf_real.model_dir))


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateAPI._encode_pair (causal): trailing spaces of the context move to the
    continuation; the whole string is encoded and split at the context's length."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    context_ids = tok(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids) :]


def oracle_loglikelihood(model, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
    ids = context_ids + continuation_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(context_ids) - 1 : len(ids) - 1]
    target = torch.tensor(continuation_ids)
    logprob = float(rows.gather(1, target[:, None]).sum())
    return logprob, bool((rows.argmax(dim=-1) == target).all())


def oracle_generation(model, tok, prompt: str, max_new_tokens: int, eos_id: int) -> str:
    ids = tok(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    generated = out[0, len(ids) :].tolist()
    if eos_id in generated:  # the server stops at EOS (lm-eval sends no ignore_eos)
        generated = generated[: generated.index(eos_id)]
    return tok.decode(generated, skip_special_tokens=True).split("\n", 1)[0]


def mc_arguments(sample: dict) -> list[tuple[str, str]]:
    """The (context, continuation) pairs of one logged multiple-choice sample, by choice."""
    return [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_loglikelihoods_are_transformers_log_probabilities(hf_real, lm_eval_runs, hf_tokenizer, backend):
    run = lm_eval_runs(backend)
    docs = read_jsonl(TASKS_DIR / f"{MC_TASK}.jsonl")
    samples = run.samples[MC_TASK]
    assert [s["doc_id"] for s in samples] == list(range(len(docs)))
    num_greedy = 0
    for sample, doc in zip(samples, docs, strict=True):
        pairs = mc_arguments(sample)
        assert pairs == [(doc["question"], " " + c) for c in doc["choices"]]
        assert len(sample["resps"]) == len(pairs)
        for (context, continuation), resp in zip(pairs, sample["resps"], strict=True):
            (logprob, is_greedy) = resp[0]
            context_ids, continuation_ids = encode_pair(hf_tokenizer, context, continuation)
            want, want_greedy = oracle_loglikelihood(hf_real.hf_model, context_ids, continuation_ids)
            assert float(logprob) == pytest.approx(want, rel=REL, abs=1e-4), (context, continuation)
            # lm-eval logs the pair's members as strings ("-3.1", "False")
            assert str(is_greedy) == str(want_greedy), (context, continuation)
            num_greedy += want_greedy
    print(f"{backend}: {num_greedy} greedy continuations")


@pytest.mark.parametrize("backend", BACKENDS)
def test_multiple_choice_accuracy_is_the_oracles(hf_real, lm_eval_runs, hf_tokenizer, backend):
    run = lm_eval_runs(backend)
    docs = read_jsonl(TASKS_DIR / f"{MC_TASK}.jsonl")
    correct = []
    for sample, doc in zip(run.samples[MC_TASK], docs, strict=True):
        scores = [
            oracle_loglikelihood(hf_real.hf_model, *encode_pair(hf_tokenizer, ctx, cont))[0]
            for ctx, cont in mc_arguments(sample)
        ]
        best = max(range(len(scores)), key=scores.__getitem__)
        correct.append(float(best == doc["answer"]))
        assert sample["acc"] == correct[-1]
    assert run.results[MC_TASK]["acc,none"] == pytest.approx(sum(correct) / len(correct))


@pytest.mark.parametrize("backend", BACKENDS)
def test_generations_are_transformers_greedy_generate(hf_real, lm_eval_runs, hf_tokenizer, backend):
    run = lm_eval_runs(backend)
    docs = read_jsonl(TASKS_DIR / f"{GEN_TASK}.jsonl")
    samples = run.samples[GEN_TASK]
    assert len(samples) == len(docs)
    eos_id = hf_tokenizer.convert_tokens_to_ids(hf_tokenizer.eos_token)
    got, want = [], []
    for sample, doc in zip(samples, docs, strict=True):
        (args,) = sample["arguments"].values()
        assert args["arg_0"] == doc["prompt"]
        assert args["arg_1"]["until"][0] == "\n" and args["arg_1"]["max_gen_toks"] == 8
        got.append(sample["resps"][0][0])
        want.append(oracle_generation(hf_real.hf_model, hf_tokenizer, doc["prompt"], 8, eos_id))
    assert got == want
    exact = [float(g == d["answer"]) for g, d in zip(got, docs, strict=True)]
    assert run.results[GEN_TASK]["exact_match,none"] == pytest.approx(sum(exact) / len(exact))


def test_remote_and_huggingface_tokenizers_give_identical_results(lm_eval_runs):
    remote, hf = lm_eval_runs("remote"), lm_eval_runs("huggingface")
    for task in (MC_TASK, GEN_TASK):
        assert [s["resps"] for s in remote.samples[task]] == [s["resps"] for s in hf.samples[task]]
        assert [s["arguments"] for s in remote.samples[task]] == [s["arguments"] for s in hf.samples[task]]
    assert remote.results[MC_TASK]["acc,none"] == hf.results[MC_TASK]["acc,none"]
    assert remote.results[GEN_TASK]["exact_match,none"] == hf.results[GEN_TASK]["exact_match,none"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_request_was_refused(lm_eval_runs, backend):
    log = lm_eval_runs(backend).log
    assert "API request failed" not in log and "Retry attempt" not in log, log[-4000:]
