"""The one-shot client commands of `pagedkv` (generate, stats, block-table, model-info): their
flags, which mirror the Engine API's messages (pagedkv.commands runs them). Argparse only, so
`pagedkv --help` and the clients start without torch or the servers."""

from __future__ import annotations

import argparse
import os

from pagedkv.cli_flags import (
    INT32_MAX,
    INT32_MIN,
    UINT32_MAX,
    UINT64_MAX,
    add_client_security_flags,
    int_in,
    poll_interval,
    token_id_list,
)

DEFAULT_SERVER = os.environ.get("PAGEDKV_SERVER", "127.0.0.1:50051")


def _add_generate_command(sub) -> argparse.ArgumentParser:
    """generate: one flag per GenerateRequest field, grouped as engine.proto groups them
    (pagedkv.commands.request_kwargs turns them into build_request's keywords)."""
    g = sub.add_parser(
        "generate",
        help="stream a generation",
        description="Stream a generation. Output: the text as it arrives; a token that added no text "
        "of its own (a special token, or a byte of a character that a later token completes) shows "
        "as its id in angle quotes, e.g. \u2039300\u203a. --ids prints token ids instead, --json "
        "one object per message. The summary line goes to stderr.",
    )
    prompt = g.add_argument_group("prompt (exactly one)")
    prompt.add_argument(
        "prompt",
        nargs="?",
        help="prompt text, tokenized by the server; sent as one user message through the model's "
        "chat template when it has one (ModelFacts.tokenizer_config_json), unless --raw",
    )
    prompt.add_argument("--token-ids", type=token_id_list, metavar="1,2,3", help="prompt as token ids")
    g.add_argument("--raw", action="store_true", help="send the prompt text as is, without the chat template")
    g.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image for a vision-language model (repeatable; PNG, JPEG, WebP, ...). Each goes where "
        "the prompt has <|vision_start|><|image_pad|><|vision_end|>; a text prompt without any gets "
        "one such marker per image put before it",
    )
    sampling = g.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int_in(1, UINT32_MAX), default=16, help="(default 16)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0 = off)")
    sampling.add_argument("--top-k", type=int_in(0, UINT32_MAX), default=0, help="(default 0 = off)")
    sampling.add_argument("--seed", type=int_in(0, UINT64_MAX), help="(default: random)")
    sampling.add_argument(
        "--n", type=int_in(1, UINT32_MAX), default=1, help="parallel samples, or beams returned (default 1)"
    )
    sampling.add_argument(
        "--beam-width",
        type=int_in(0, UINT32_MAX),
        default=0,
        help="beam search with this many beams (0/1 = off); greedy, with --n best beams printed at the end",
    )
    sampling.add_argument(
        "--length-penalty", type=float, help="beam search: score = logprob sum / length ** this (default 1.0)"
    )
    sampling.add_argument(
        "--early-stopping",
        choices=("heuristic", "on", "never"),
        default="heuristic",
        help="beam search: when to end before --max-tokens, as Hugging Face's early_stopping "
        "False / True / 'never' (default heuristic)",
    )
    stopping = g.add_argument_group("stopping")
    stopping.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    stopping.add_argument(
        "--stop-token-ids",
        type=token_id_list,
        action="extend",
        metavar="ID,ID",
        help="token ids that end a sample, besides the model's EOS (repeatable; needs no tokenizer)",
    )
    stopping.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    request = g.add_argument_group("request")
    request.add_argument("--request-id", help="choose the request id (default: assigned by the server)")
    request.add_argument(
        "--priority", type=int_in(INT32_MIN, INT32_MAX), default=0, help="lower runs first (default 0)"
    )
    request.add_argument(
        "--cache-salt", metavar="TEXT", help="isolate prefix-cache sharing to requests with this salt"
    )
    request.add_argument(
        "--adapter", metavar="NAME", help="run on this loaded LoRA adapter (default: the base model)"
    )
    output = g.add_argument_group("output")
    form = output.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON object per response message")
    form.add_argument("--ids", action="store_true", help="print the generated token ids instead of text")
    output.add_argument(
        "--logprobs",
        action="store_true",
        help="ask for each token's log-probability: a table (id, logprob, text) per sample, or in --json",
    )
    return g


def add_client_commands(sub) -> None:
    """generate, stats, block-table, model-info: one-shot clients of a running control plane."""
    g = _add_generate_command(sub)
    st = sub.add_parser("stats", help="KV pool and scheduler statistics")
    st.add_argument("--json", action="store_true")
    st.add_argument(
        "--metrics",
        metavar="URL",
        help="also read latency and throughput from this /metrics endpoint (http://HOST:PORT/metrics)",
    )
    bt = sub.add_parser("block-table", help="a live request's block tables")
    bt.add_argument("request_id")
    bt.add_argument("--json", action="store_true")
    bt.add_argument("--watch", action="store_true", help="poll and print blocks as they are appended")
    bt.add_argument("--interval", type=poll_interval, default=0.2, help="seconds between polls (default 0.2)")
    mi = sub.add_parser("model-info", help="the served model and KV geometry")
    mi.add_argument("--json", action="store_true")
    for p in (g, st, bt, mi):
        p.add_argument("--server", default=DEFAULT_SERVER, help="HOST:PORT, unix:///path or dns:///name:port")
        add_client_security_flags(p)
