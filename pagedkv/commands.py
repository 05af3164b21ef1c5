"""The client-side CLI commands: `generate`, `stats`, `block-table`, `model-info`.

Human output goes to stdout (generated text streams as it arrives); `--json` prints one JSON
object per protobuf message (field names as in the .proto). Errors print the server's status
and message to stderr and exit 1.
"""

from __future__ import annotations

import json
import sys

from google.protobuf import json_format

from pagedkv.client import Client, ClientError
from pagedkv.v1 import engine_pb2


def _to_json(msg) -> str:
    d = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return json.dumps(d)


def _fail(e: ClientError) -> int:
    print(f"error: {e.code.name}: {e.details}", file=sys.stderr)
    return 1


def parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--token-ids must be comma-separated integers, got {text!r}") from None


def _finish_name(reason: int) -> str:
    return engine_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_")


def _piece(m) -> str:
    """What to print for one message: its text, or its token ids when there is no tokenizer."""
    if m.text or not m.token_ids:
        return m.text
    return "".join(f"{t} " for t in m.token_ids)


def cmd_generate(args) -> int:
    kw = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        n=args.n,
        stop=args.stop or (),
        ignore_eos=args.ignore_eos,
        request_id=args.request_id or "",
    )
    if args.token_ids is not None:
        kw["token_ids"] = parse_token_ids(args.token_ids)
        prompt = None
    else:
        prompt = args.prompt
    with Client(args.server) as client:
        try:
            if args.json:
                for m in client.generate(prompt, **kw):
                    print(_to_json(m), flush=True)
            elif args.n == 1:
                _stream_one(client.generate(prompt, **kw))
            else:
                _stream_many(client.generate(prompt, **kw))
        except ClientError as e:
            return _fail(e)
    return 0


def _summary(m) -> str:
    u = m.usage
    return (
        f"[{m.request_id} #{m.index}: {_finish_name(m.finish_reason)}, {u.completion_tokens} tokens, "
        f"prompt {u.prompt_tokens} ({u.cached_prompt_tokens} cached)]"
    )


def _stream_one(messages) -> None:
    for m in messages:
        sys.stdout.write(_piece(m))
        sys.stdout.flush()
        if m.finish_reason:
            sys.stdout.write("\n")
            print(_summary(m), file=sys.stderr)


def _stream_many(messages) -> None:
    """n > 1: samples interleave on the wire; each is printed whole when it finishes."""
    texts: dict[int, list[str]] = {}
    for m in messages:
        texts.setdefault(m.index, []).append(_piece(m))
        if m.finish_reason:
            print(f"--- sample {m.index} ---")
            print("".join(texts.pop(m.index)))
            print(_summary(m), file=sys.stderr)


def cmd_stats(args) -> int:
    with Client(args.server) as client:
        try:
            s = client.stats(timeout=10.0)
        except ClientError as e:
            return _fail(e)
    if args.json:
        print(_to_json(s))
        return 0
    hist = ", ".join(f"{k}:{v}" for k, v in sorted(s.ref_count_histogram.items())) or "-"
    hits = f"{s.prefix_cache_hit_rate:.1%}  ({s.prefix_cache_hits}/{s.prefix_cache_queries} tokens)"
    rows = [
        ("worker available", s.worker_available),
        ("KV blocks free / total", f"{s.num_blocks_free} / {s.num_blocks_total}"),
        ("block size", f"{s.block_size} tokens"),
        ("KV usage", f"{s.kv_usage:.1%}"),
        ("cached blocks", s.num_blocks_cached),
        ("prefix cache hit rate", hits),
        ("internal fragmentation", f"{s.internal_fragmentation_slots} slots"),
        ("ref-count histogram", hist),
        ("running / waiting seqs", f"{s.num_running} / {s.num_waiting}"),
        ("live requests", s.num_live_requests),
        ("finished requests", s.num_finished_requests),
        ("preemptions / evictions", f"{s.num_preemptions} / {s.num_evictions}"),
        ("blocks allocated", f"{s.blocks_allocated_total}  ({s.blocks_allocated_per_s:.1f}/s)"),
        ("steps", s.num_steps),
    ]
    for name, value in rows:
        print(f"{name:<26}{value}")
    return 0


def cmd_block_table(args) -> int:
    with Client(args.server) as client:
        try:
            t = client.block_table(args.request_id, timeout=10.0)
        except ClientError as e:
            return _fail(e)
    if args.json:
        print(_to_json(t))
        return 0
    print(f"request {t.request_id} (block size {t.block_size})")
    for s in t.sequences:
        print(
            f"  sample {s.index}: {len(s.block_ids)} blocks, {s.num_tokens} tokens "
            f"({s.num_computed_tokens} computed): {list(s.block_ids)}"
        )
    return 0


def cmd_model_info(args) -> int:
    with Client(args.server) as client:
        try:
            info = client.model_info(timeout=10.0)
        except ClientError as e:
            return _fail(e)
    if args.json:
        print(_to_json(info))
    else:
        for field, value in json_format.MessageToDict(info, preserving_proto_field_name=True).items():
            print(f"{field:<22}{value}")
    return 0
