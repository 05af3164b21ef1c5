"""The client-side CLI commands against in-process servers (`main(argv)`, output captured)."""

from __future__ import annotations

import json
import re
import threading

import pytest

from pagedkv.cli import build_parser, main, parse_bytes


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_streams_text_and_summarises(stack, capsys):
    code, out, err = run(capsys, "generate", "--server", stack.address, "hello", "--max-tokens", "6")
    assert code == 0 and out.endswith("\n")
    assert "LENGTH, 6 tokens, prompt 5" in err


def test_generate_json_prints_one_object_per_message(stack, capsys):
    code, out, _ = run(
        capsys,
        "generate",
        "--server",
        stack.address,
        "--token-ids",
        "1,2,3",
        "--max-tokens",
        "3",
        "--n",
        "2",
        "--json",
    )
    msgs = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(msgs) == 6
    assert {m.get("index", 0) for m in msgs} == {0, 1}
    assert sum(1 for m in msgs if m.get("finish_reason") == "FINISH_REASON_LENGTH") == 2


def test_generate_n_prints_each_sample(stack, capsys):
    code, out, err = run(
        capsys, "generate", "--server", stack.address, "--token-ids", "5,6", "--max-tokens", "2", "--n", "3"
    )
    assert code == 0 and [f"--- sample {i} ---" in out for i in range(3)] == [True] * 3
    assert err.count("LENGTH, 2 tokens") == 3


def test_stats_block_table_and_model_info(stack, capsys):
    code, out, _ = run(capsys, "stats", "--server", stack.address)
    assert code == 0 and "KV blocks free / total    63 / 63" in out
    code, out, _ = run(capsys, "stats", "--server", stack.address, "--json")
    assert json.loads(out)["num_blocks_total"] == 63
    code, out, _ = run(capsys, "model-info", "--server", stack.address, "--json")
    assert json.loads(out)["facts"]["block_size"] == 16
    code, out, _ = run(capsys, "model-info", "--server", stack.address)
    assert code == 0 and re.search(r"^block_size +16$", out, re.M) and re.search(r"^max_n +\d+$", out, re.M)

    stack.worker.gate.clear()
    it = stack.client.generate(token_ids=list(range(1, 40)), max_tokens=5, request_id="live")
    t = threading.Thread(target=lambda: list(it))
    t.start()
    try:
        import time

        deadline = time.monotonic() + 10
        while stack.client.stats().num_live_requests == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        code, out, _ = run(capsys, "block-table", "live", "--server", stack.address)
        assert code == 0 and "sample 0: 3 blocks, 39 tokens" in out
    finally:
        stack.worker.gate.set()
        t.join(10)


def test_errors_exit_1_with_the_status(stack, capsys):
    code, _, err = run(capsys, "block-table", "nope", "--server", stack.address)
    assert code == 1 and "NOT_FOUND" in err
    code, _, err = run(
        capsys, "generate", "--server", stack.address, "--token-ids", "1", "--max-tokens", "9999"
    )
    assert code == 1 and "INVALID_ARGUMENT" in err and "max length" in err


def usage_error(capsys, *argv: str) -> str:
    """A usage error: exit status 2 before anything runs; returns stderr."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_prompt_and_token_ids_are_exclusive(capsys):
    err = usage_error(capsys, "generate", "hi", "--token-ids", "1")
    assert "usage: pagedkv generate" in err and "give a PROMPT or --token-ids, not both" in err
    err = usage_error(capsys, "generate")
    assert "usage: pagedkv generate" in err and "give a PROMPT (text) or --token-ids" in err
    assert "not both" not in err


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["generate", "--token-ids", "-1"], ["argument --token-ids", "0..4294967295", "got -1"]),
        (["generate", "--token-ids", "1,x"], ["argument --token-ids", "comma-separated integers"]),
        (["generate", "--token-ids", "4294967296"], ["argument --token-ids", "0..4294967295"]),
        (["generate", "hi", "--stop-token-ids", "-5"], ["argument --stop-token-ids", "0..4294967295"]),
        (["generate", "hi", "--seed", "-1"], ["argument --seed", "0..18446744073709551615"]),
        (["generate", "hi", "--top-k", "-1"], ["argument --top-k", "0..4294967295"]),
        (["generate", "hi", "--max-tokens", "0"], ["argument --max-tokens", "1..4294967295"]),
        (["generate", "hi", "--priority", str(2**31)], ["argument --priority", "-2147483648..2147483647"]),
        (["generate", "hi", "--ids", "--json"], ["argument --json: not allowed with argument --ids"]),
    ],
)
def test_out_of_range_values_are_usage_errors_naming_the_flag(capsys, argv, names):
    err = usage_error(capsys, *argv)
    assert err.startswith("usage: pagedkv generate")
    assert all(name in err for name in names), err
    assert "Value out of range" not in err


@pytest.mark.parametrize("command", ["generate", "stats", "model-info", "serve", "worker"])
def test_an_unknown_flag_shows_the_commands_usage(capsys, command):
    err = usage_error(capsys, command, "--bogus")
    assert err.startswith(f"usage: pagedkv {command} ")
    assert f"pagedkv {command}: error: unrecognized arguments: --bogus" in err


@pytest.mark.parametrize(
    ("flag", "value", "config"),
    [("--block-size", "7", {"block_size": 7}), ("--num-blocks", "1", {"num_blocks": 1})],
)
@pytest.mark.parametrize("command", ["serve", "worker"])
def test_pool_flags_are_refused_before_any_process_starts_in_the_workers_words(
    capsys, monkeypatch, command, flag, value, config
):
    from worker import WorkerConfig, WorkerConfigError

    with pytest.raises(WorkerConfigError) as worker_says:
        WorkerConfig(**config).validate()
    spawned = []
    monkeypatch.setattr("pagedkv.serve.run_serve", lambda args: spawned.append(args) or 0)
    monkeypatch.setattr("pagedkv.processes.run_worker", lambda args: spawned.append(args) or 0)
    err = usage_error(capsys, command, flag, value)
    assert f"argument {flag}: {worker_says.value}" in err and spawned == []


def test_serve_help_states_the_port_and_the_default_model(capsys):
    from worker.default_model import PRESETS

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "127.0.0.1:50051" in text and "public port (default 50051; 0 = any free port)" in text
    assert "random:default" in text
    assert all(name in text for name in PRESETS)  # pagedkv.cli.RANDOM_PRESETS is current


def _message(token_ids, text="", finish=0):
    from base.v1 import engine_pb2

    return engine_pb2.GenerateResponse(token_ids=token_ids, text=text, finish_reason=finish)


def test_text_piece_marks_silent_tokens_and_never_a_trimmed_stop_token():
    from base.v1 import engine_pb2
    from pagedkv.commands import ids_piece, text_piece

    stop, length = engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH
    assert text_piece(_message([72], "H")) == "H"
    assert text_piece(_message([300])) == "\u2039300\u203a"  # a special token
    assert text_piece(_message([251])) + text_piece(_message([306], "\ufffd")) == "\u2039251\u203a\ufffd"
    assert text_piece(_message([300], finish=length)) == "\u2039300\u203a"
    assert text_piece(_message([257], finish=stop)) == ""  # EOS / a stop token id: trimmed, not shown
    assert text_piece(_message([5, 6], finish=stop)) == "\u20395\u203a"  # only the last one ended it
    assert text_piece(_message([44], "ab", finish=stop)) == "ab"  # a stop string cut after "ab"
    assert ids_piece(_message([251, 257], finish=stop)) == "251 257 "


def _prompt_with_special_tokens() -> tuple[list[int], list[int]]:
    """A prompt whose first six SimWorker tokens are printable bytes and special ids (>= 256),
    both kinds among the first five, the sixth a special id not seen before: (prompt, tokens)."""
    from control_plane.sim_worker import reference_tokens
    from tests.grpc.conftest import VOCAB

    for first in range(1, 5000):
        prompt = [first, 7, 9]
        toks = reference_tokens(prompt, 0, 6, VOCAB)
        head = toks[:5]
        if (
            all(32 <= t < 127 or t >= 256 for t in head)
            and any(t < 256 for t in head)
            and any(t >= 256 for t in head)
            and toks[5] >= 256
            and toks[5] not in head
        ):
            return prompt, toks
    raise AssertionError("no such prompt in range")


def test_generate_shows_tokens_without_text_distinguishably_and_not_the_stop_token(stack, capsys):
    prompt, toks = _prompt_with_special_tokens()
    ids = ",".join(map(str, prompt))
    common = ["generate", "--server", stack.address, "--token-ids", ids, "--max-tokens", "20"]
    code, out, err = run(capsys, *common, "--stop-token-ids", str(toks[5]))
    expected = "".join(chr(t) if t < 256 else f"\u2039{t}\u203a" for t in toks[:5])
    assert code == 0 and out == expected + "\n"
    assert "STOP, 6 tokens" in err
    code, out, _ = run(capsys, *common, "--stop-token-ids", str(toks[5]), "--ids")
    assert code == 0 and out == " ".join(map(str, toks)) + " \n"


def test_generate_flags_fill_every_request_field():
    from pagedkv.client import build_request
    from pagedkv.commands import request_kwargs

    argv = "generate hi --max-tokens 5 --temperature 0.5 --top-p 0.9 --top-k 7 --seed 3 --n 2 --stop x "
    argv += "--stop-token-ids 9,10 --stop-token-ids 11 --ignore-eos --logprobs --request-id r1 "
    argv += "--priority -4 --cache-salt tenant-a --adapter sql"
    args = build_parser().parse_args(argv.split())
    req = build_request(args.prompt, **request_kwargs(args))
    s = req.sampling
    assert (req.text, req.request_id, req.priority, req.cache_salt) == ("hi", "r1", -4, "tenant-a")
    assert req.adapter == "sql"
    assert (s.max_tokens, s.top_k, s.seed, s.n, list(s.stop)) == (5, 7, 3, 2, ["x"])
    assert (list(s.stop_token_ids), s.ignore_eos, s.logprobs) == ([9, 10, 11], True, True)
    assert (round(s.temperature, 6), round(s.top_p, 6)) == (0.5, 0.9)
    argv = "generate hi --beam-width 4 --n 2 --length-penalty 0.5 --early-stopping never"
    beams = build_parser().parse_args(argv.split())
    s = build_request(beams.prompt, **request_kwargs(beams)).sampling
    assert (s.beam_width, s.n, s.length_penalty, s.early_stopping) == (4, 2, 0.5, 2)


def test_generate_beam_width_prints_the_best_beams_with_their_scores(stack, capsys):
    from control_plane.beam_search import BeamSearch
    from control_plane.sim_worker import reference_beams
    from tests.grpc.conftest import VOCAB

    prompt = list(range(1, 21))
    ids = ",".join(map(str, prompt))
    args = ["--token-ids", ids, "--max-tokens", "6", "--beam-width", "3", "--n", "2", "--ids"]
    code, out, err = run(capsys, "generate", "--server", stack.address, *args)
    expected = reference_beams(prompt, BeamSearch(3, 1.0, 6, frozenset()), VOCAB)[:2]
    assert code == 0, err
    assert out == "".join(
        f"--- beam {i} ---\n" + " ".join(map(str, h.token_ids)) + " \n" for i, h in enumerate(expected)
    )
    assert err.count("LENGTH, 6 tokens") == 2 and err.count("beam score") == 2


def test_generate_cache_salt_keeps_prefix_caches_apart(stack, capsys):
    ids = ",".join(str(i) for i in range(1, 41))  # two full 16-token blocks to share

    def cached(*extra: str) -> str:
        code, _, err = run(capsys, "generate", "--server", stack.address, "--token-ids", ids, *extra)
        assert code == 0, err
        return err.split("prompt 40 (", 1)[1].split(" cached", 1)[0]

    assert cached("--cache-salt", "a") == "0"
    assert cached("--cache-salt", "b") == "0"  # another tenant: no shared blocks
    assert cached("--cache-salt", "a") == "32"  # the same tenant: both full blocks hit


def test_generate_logprobs_prints_a_table_of_the_servers_values(real_stack, capsys):
    code, out, _ = run(
        capsys,
        "generate",
        "--server",
        real_stack.address,
        "--token-ids",
        "1,2,3",
        "--max-tokens",
        "4",
        "--logprobs",
    )
    (done,) = real_stack.client.complete(token_ids=[1, 2, 3], max_tokens=4, logprobs=True)
    header, *rows = out.splitlines()
    assert code == 0 and header == "# token_id\tlogprob\ttext" and len(rows) == 4
    cells = [row.split("\t") for row in rows]
    assert [int(c[0]) for c in cells] == done.token_ids  # greedy: the same tokens
    assert [float(c[1]) for c in cells] == pytest.approx(done.logprobs, abs=1e-4)
    assert "".join(json.loads(c[2]) for c in cells) == done.text


def test_deploy_flag_names_parse():
    """The flags deploy/ (systemd, containers) passes must keep parsing."""
    p = build_parser()
    w = p.parse_args(
        "worker --model /m --device cuda --listen unix:///run/pagedkv/worker.sock --block-size 16 "
        "--kv-cache-memory 2Gi --kv-layout paged --dtype bfloat16 --max-model-len 4096 --no-cuda-graph "
        "--log-format json --log-level INFO".split()
    )
    assert (w.kv_cache_memory, w.cuda_graph, w.log_level) == (2 * 2**30, "off", "info")
    w = p.parse_args("worker --cuda-graph require --gpu-memory-utilization 0.8".split())
    assert (w.cuda_graph, w.gpu_memory_utilization, w.max_num_batched_tokens) == ("require", 0.8, 2048)
    for bad in ("--gpu-memory-utilization 0", "--gpu-memory-utilization 1.5", "--cuda-graph maybe"):
        with pytest.raises(SystemExit):
            p.parse_args(["worker", *bad.split()])
    c = p.parse_args(
        "control --worker unix:///run/pagedkv/worker.sock --listen 0.0.0.0:50051 --max-num-seqs 8 "
        "--max-num-batched-tokens 512 --no-prefix-caching --policy latency --max-queue 64 "
        "--metrics-port 9400 "
        "--log-format console --log-level debug".split()
    )
    assert (c.policy, c.no_prefix_caching, c.metrics_port) == ("latency", True, 9400)
    with pytest.raises(SystemExit):
        p.parse_args(["worker", "--num-blocks", "10", "--kv-cache-memory", "1G"])


@pytest.mark.parametrize(
    ("text", "value"), [("1024", 1024), ("256Mi", 256 << 20), ("2G", 2 * 10**9), ("1.5GiB", 3 << 29)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_serve_sizes_the_workers_cuda_graphs_from_max_num_seqs(tmp_path):
    from pagedkv.serve import child_commands

    argv = "serve --max-num-seqs 8 --no-cuda-graph --max-num-batched-tokens 512 --gpu-memory-utilization 0.5"
    worker, control, _ = child_commands(build_parser().parse_args(argv.split()), tmp_path)
    assert worker[worker.index("--cuda-graph-max-batch-size") + 1] == "8"
    assert "--cuda-graph" in worker and "--cuda-graph" not in control
    worker_args = build_parser().parse_args(worker[worker.index("worker") :])
    assert (worker_args.cuda_graph_max_batch_size, worker_args.cuda_graph) == (8, "off")
    # The memory profile runs the control plane's largest prefill and batch.
    assert (worker_args.max_num_batched_tokens, worker_args.gpu_memory_utilization) == (512, 0.5)


def test_serve_hands_the_lora_flags_to_its_worker(tmp_path):
    from pagedkv.processes import worker_config_from_args
    from pagedkv.serve import child_commands

    argv = "serve --lora sql=/a/sql --lora chat=/a/chat --max-loras 8 --max-lora-rank 32"
    worker, control, _ = child_commands(build_parser().parse_args(argv.split()), tmp_path)
    assert "--lora" not in control
    config = worker_config_from_args(build_parser().parse_args(worker[worker.index("worker") :]))
    assert config.loras == (("sql", "/a/sql"), ("chat", "/a/chat"))
    assert (config.max_loras, config.max_lora_rank) == (8, 32)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--lora", "no-equals-sign"])
