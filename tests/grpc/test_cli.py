"""The client-side CLI commands against in-process servers (`main(argv)`, output captured)."""

from __future__ import annotations

import json
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
    assert json.loads(out)["block_size"] == 16

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


def test_prompt_and_token_ids_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--token-ids", "1"])
    with pytest.raises(SystemExit):
        main(["generate"])


def test_deploy_flag_names_parse():
    """The flags deploy/ (systemd, containers) passes must keep parsing."""
    p = build_parser()
    w = p.parse_args(
        "worker --model /m --device cuda --listen unix:///run/pagedkv/worker.sock --block-size 16 "
        "--kv-cache-memory 2Gi --kv-layout paged --dtype bfloat16 --max-model-len 4096 --no-cuda-graph "
        "--log-format json --log-level INFO".split()
    )
    assert (w.kv_cache_memory, w.no_cuda_graph, w.log_level) == (2 * 2**30, True, "info")
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

    args = build_parser().parse_args(["serve", "--max-num-seqs", "8", "--no-cuda-graph"])
    worker, control, _ = child_commands(args, tmp_path)
    assert worker[worker.index("--cuda-graph-max-batch-size") + 1] == "8"
    assert "--no-cuda-graph" in worker and "--no-cuda-graph" not in control
    worker_args = build_parser().parse_args(worker[worker.index("worker") :])
    assert (worker_args.cuda_graph_max_batch_size, worker_args.no_cuda_graph) == (8, True)
