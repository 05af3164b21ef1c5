"""The client-side CLI commands: `generate`, `stats`, `block-table`, `model-info`.

Human output goes to stdout (generated text streams as it arrives; a token that brought no
text shows as ‹id›, see `text_piece`); `--ids` prints token ids, `--logprobs` a table
of id, logprob and text, `--json` one JSON object per protobuf message (field names as in the
.proto). Errors print the server's status and message to stderr and exit 1. A closed stdout
(`| head`) ends the command quietly (pagedkv.cli.main).

`stats --metrics URL` adds what GetStats does not carry (generated tokens, latency
histograms) from the control plane's Prometheus endpoint. `block-table ID --watch` polls the
table and prints each change -- blocks appended as decode crosses a block boundary, tables
replaced by copy-on-write or recompute -- until the request ends (NOT_FOUND: exit 0).
"""

from __future__ import annotations

import json
import sys
import time

import grpc
from google.protobuf import json_format

from base.security import ClientSecurity
from base.v1 import engine_pb2
from pagedkv.client import Client, ClientError


def _to_json(msg) -> str:
    d = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return json.dumps(d)


def _client(args) -> Client:
    """A client of --server with the TLS / token flags (--tls-ca ... --auth-token-file)."""
    return Client(args.server, security=ClientSecurity.from_args(args))


def _fail(e: ClientError) -> int:
    print(f"error: {e.code.name}: {e.details}", file=sys.stderr)
    return 1


def _finish_name(reason: int) -> str:
    return engine_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_")


def request_kwargs(args) -> dict:
    """`build_request` keywords from generate's flags: one entry per API field, so a new
    field is a flag in pagedkv.cli plus a line here."""
    return dict(
        token_ids=args.token_ids,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        n=args.n,
        stop=args.stop or (),
        stop_token_ids=args.stop_token_ids or (),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        request_id=args.request_id or "",
        priority=args.priority,
        cache_salt=args.cache_salt or "",
        adapter=args.adapter or "",
        beam_width=args.beam_width,
        length_penalty=args.length_penalty,
        early_stopping=args.early_stopping,
    )


def silent_ids(m) -> list[int]:
    """The tokens of a message that brought no text: all of them when `text` is empty (a
    special token, a byte held back until a later token completes its character, or every
    token when the server has no tokenizer) -- except, on a STOP finish, the last one: the
    stop token (or the token that completed a stop string), whose text the server trims."""
    if m.text:
        return []
    ids = list(m.token_ids)
    if m.finish_reason == engine_pb2.FINISH_REASON_STOP:
        ids = ids[:-1]
    return ids


def text_piece(m) -> str:
    """Default output of one message: its text, and each silent token as ‹id›, which
    generated text cannot be mistaken for (digits glued to text could)."""
    return "".join(f"\u2039{t}\u203a" for t in silent_ids(m)) + m.text


def ids_piece(m) -> str:
    """--ids: the message's token ids, space-separated (every id the server sent, a final
    stop token included)."""
    return "".join(f"{t} " for t in m.token_ids)


LOGPROB_HEADER = "# token_id\tlogprob\ttext"


def logprob_rows(m) -> str:
    """--logprobs: one line per token, id TAB logprob TAB the message's text as JSON (on its
    last token; a message usually carries one token)."""
    rows = []
    last = len(m.token_ids) - 1
    for i, t in enumerate(m.token_ids):
        lp = f"{m.logprobs[i]:.4f}" if i < len(m.logprobs) else "-"
        rows.append(f"{t}\t{lp}\t{json.dumps(m.text if i == last else '', ensure_ascii=False)}\n")
    return "".join(rows)


IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen-VL's, as its chat template writes it


def with_images(prompt: str | None, files: list[str] | None) -> tuple[str | None, list[bytes]]:
    """(prompt, image bytes) for --image: a text prompt with no image marker gets one per image
    in front of it, so `generate "What is this?" --image cat.png` does what it says."""
    if not files:
        return prompt, []
    images = []
    for name in files:
        try:
            with open(name, "rb") as f:
                images.append(f.read())
        except OSError as e:
            raise ValueError(f"cannot read --image {name}: {e.strerror}") from None
    if prompt is not None and "<|image_pad|>" not in prompt:
        prompt = IMAGE_MARKER * len(images) + prompt
    return prompt, images


def as_chat(client: Client, prompt: str) -> str:
    """`prompt` as one user message through the served model's chat template, ready for the
    assistant's answer; unchanged when the model declares no template."""
    facts = client.model_info(timeout=10.0).facts
    if not facts.tokenizer_config_json:
        return prompt
    from pagedkv.openai_api.chat_template import ChatTemplate

    config = json.loads(facts.tokenizer_config_json)
    template = config.pop("chat_template")
    chat = ChatTemplate(f"{facts.model_name}'s chat template", template, config)
    return chat.render([{"role": "user", "content": prompt}], True, None)


def cmd_generate(args) -> int:
    kw = request_kwargs(args)
    prompt = args.prompt if args.token_ids is None else None
    try:
        prompt, kw["images"] = with_images(prompt, args.image)
    except ValueError as e:
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return 2
    if args.logprobs and not args.json:
        render, header = logprob_rows, LOGPROB_HEADER
    else:
        render, header = (ids_piece if args.ids else text_piece), None
    with _client(args) as client:
        try:
            if prompt is not None and not args.raw and not kw["images"]:
                prompt = as_chat(client, prompt)
            if args.json:
                for m in client.generate(prompt, **kw):
                    print(_to_json(m), flush=True)
            elif args.n == 1:
                _stream_one(client.generate(prompt, **kw), render, header)
            else:
                _stream_many(client.generate(prompt, **kw), render, header)
        except ClientError as e:
            return _fail(e)
    return 0


def _summary(m) -> str:
    u = m.usage
    beam = f", beam score {m.beam_score:.4f}" if m.HasField("beam_score") else ""
    return (
        f"[{m.request_id} #{m.index}: {_finish_name(m.finish_reason)}, {u.completion_tokens} tokens, "
        f"prompt {u.prompt_tokens} ({u.cached_prompt_tokens} cached){beam}]"
    )


def _stream_one(messages, render, header: str | None) -> None:
    if header:
        print(header)
    for m in messages:
        sys.stdout.write(render(m))
        sys.stdout.flush()
        if m.finish_reason:
            if render is not logprob_rows:
                sys.stdout.write("\n")
                sys.stdout.flush()
            print(_summary(m), file=sys.stderr)


def _stream_many(messages, render, header: str | None) -> None:
    """n > 1: samples interleave on the wire; each is printed whole when it finishes."""
    pieces: dict[int, list[str]] = {}
    for m in messages:
        pieces.setdefault(m.index, []).append(render(m))
        if m.finish_reason:
            print(f"--- {'beam' if m.HasField('beam_score') else 'sample'} {m.index} ---")
            if header:
                print(header)
            print("".join(pieces.pop(m.index)), end="" if render is logprob_rows else "\n", flush=True)
            print(_summary(m), file=sys.stderr)


def cmd_stats(args) -> int:
    with _client(args) as client:
        try:
            s = client.stats(timeout=10.0)
        except ClientError as e:
            return _fail(e)
    metrics = _read_metrics(args.metrics) if args.metrics else None
    if args.json:
        d = json_format.MessageToDict(
            s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        if metrics is not None:
            d["metrics"] = metrics
        print(json.dumps(d))
        return 0
    for name, value in [*stats_rows(s), *metrics_rows(metrics or {})]:
        print(f"{name:<26}{value}")
    return 0


def stats_rows(s: engine_pb2.EngineStats) -> list[tuple[str, object]]:
    hist = ", ".join(f"{k}:{v}" for k, v in sorted(s.ref_count_histogram.items())) or "-"
    hits = f"{s.prefix_cache_hit_rate:.1%}  ({s.prefix_cache_hits}/{s.prefix_cache_queries} tokens)"
    used = s.num_blocks_total - s.num_blocks_free
    return [
        ("worker available", s.worker_available),
        ("KV blocks free / total", f"{s.num_blocks_free} / {s.num_blocks_total}"),
        ("KV blocks used", used),
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
        *_speculation_rows(s),
    ]


def _speculation_rows(s) -> list[tuple[str, object]]:
    """Speculative decoding's counters, when the server verified anything."""
    if not s.spec_num_verifies:
        return []
    rate = s.spec_num_accepted / s.spec_num_proposed if s.spec_num_proposed else 0.0
    per_position = " ".join(f"{r:.0%}" for r in s.spec_acceptance_per_position) or "-"
    return [
        ("spec proposed / accepted", f"{s.spec_num_proposed} / {s.spec_num_accepted}  ({rate:.1%})"),
        ("spec accepted per position", per_position),
        ("spec mean accepted", f"{s.spec_num_accepted / s.spec_num_verifies:.2f} per verify step"),
    ]


_LATENCIES = (
    ("time to first token", "pagedkv_time_to_first_token_seconds"),
    ("inter-token latency", "pagedkv_inter_token_latency_seconds"),
    ("step time", "pagedkv_step_duration_seconds"),
)


def _read_metrics(url: str) -> dict:
    """What the table adds from /metrics: counters and latency summaries (ValueError if unreadable)."""
    from base.metrics import scrape, summarize_histogram

    families = scrape(url)
    if "pagedkv_step_duration_seconds" not in families:
        raise ValueError(
            f"{url} is not a pagedkv control plane's /metrics (no pagedkv_step_duration_seconds)"
        )
    flat = {k: v for samples in families.values() for k, v in samples.items()}
    out = {
        "generation_tokens_total": int(flat.get("pagedkv_generation_tokens_total", 0)),
        "worker_losses_total": int(flat.get("pagedkv_worker_losses_total", 0)),
    }
    for _, name in _LATENCIES:
        h = summarize_histogram(families[name], name)
        out[name.removeprefix("pagedkv_")] = {"count": h.count, "mean": h.mean, "p50": h.p50, "p90": h.p90}
    return out


def metrics_rows(metrics: dict) -> list[tuple[str, object]]:
    if not metrics:
        return []
    rows: list[tuple[str, object]] = [
        ("generated tokens", metrics["generation_tokens_total"]),
        ("worker losses", metrics["worker_losses_total"]),
    ]
    for label, name in _LATENCIES:
        h = metrics[name.removeprefix("pagedkv_")]
        value = "-"
        if h["count"]:
            value = (
                f"mean {h['mean'] * 1e3:.1f} ms, p50 ~{h['p50'] * 1e3:.1f} ms, "
                f"p90 ~{h['p90'] * 1e3:.1f} ms  ({h['count']})"
            )
        rows.append((label, value))
    return rows


def cmd_block_table(args) -> int:
    with _client(args) as client:
        try:
            t = client.block_table(args.request_id, timeout=10.0)
        except ClientError as e:
            return _fail(e)
        _print_table(t, args.json)
        if args.watch:
            return _watch_table(client, t, args)
    return 0


def _print_table(t: engine_pb2.BlockTable, as_json: bool) -> None:
    if as_json:
        print(_to_json(t), flush=True)
        return
    print(f"request {t.request_id} (block size {t.block_size})")
    for s in t.sequences:
        print(
            f"  sample {s.index}: {len(s.block_ids)} blocks, {s.num_tokens} tokens "
            f"({s.num_computed_tokens} computed): {list(s.block_ids)}",
            flush=True,
        )


def _watch_table(client: Client, table: engine_pb2.BlockTable, args) -> int:
    """Poll until the request ends; print each change (JSON: the whole table again)."""
    seen = {s.index: list(s.block_ids) for s in table.sequences}
    while True:
        time.sleep(args.interval)
        try:
            table = client.block_table(args.request_id, timeout=10.0)
        except ClientError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                return _fail(e)
            print(f"request {args.request_id} ended (no longer live); watch over", file=_note_stream(args))
            return 0
        now = {s.index: list(s.block_ids) for s in table.sequences}
        if now == seen:
            continue
        if args.json:
            _print_table(table, as_json=True)
        else:
            for s in table.sequences:
                _print_change(s, seen.get(s.index))
            for index in sorted(seen.keys() - now.keys()):
                print(f"  sample {index}: finished (blocks released)", flush=True)
        seen = now


def _print_change(s, before: list[int] | None) -> None:
    ids = list(s.block_ids)
    if before == ids:
        return
    if before is not None and len(ids) > len(before) and ids[: len(before)] == before:
        what = f"+{ids[len(before) :]} appended"
    else:  # new sample (fork), copy-on-write replacement, or preempted and recomputed
        what = "table replaced"
    print(f"  sample {s.index}: {what} -> {len(ids)} blocks, {s.num_tokens} tokens: {ids}", flush=True)


def _note_stream(args):
    return sys.stderr if args.json else sys.stdout


def cmd_model_info(args) -> int:
    with _client(args) as client:
        try:
            info = client.model_info(timeout=10.0)
        except ClientError as e:
            return _fail(e)
    if args.json:
        print(_to_json(info))
    else:
        fields = json_format.MessageToDict(info, preserving_proto_field_name=True)
        facts = fields.pop("facts", {})
        if "tokenizer_config_json" in facts:  # a whole Jinja template: its keys, not its text
            facts["tokenizer_config_json"] = f"{{{', '.join(json.loads(facts['tokenizer_config_json']))}}}"
        for field, value in {**facts, **fields}.items():  # the facts, then the limits
            print(f"{field:<22}{value}")
    return 0
