"""Request size limits: every string and list a client sends is bounded, and checked before
any work that grows with it (tokenizing, hashing, copying into a plan).

Why: one oversized field must not cost other clients anything. Unbounded, an 8 MiB
`cache_salt` (hashed into every block), a 1 MiB `request_id` (copied into every message of
the stream) or a 60 MiB `text` (tokenized on the event loop) stalled every other stream for
seconds, and a 60 MB `stop_token_ids` list once made a step's plan exceed the worker's
message limit, failing every live request. The limits are documented in engine.proto.

    field              limit                                   checked in
    request_id         256 characters                          api_codec (before anything)
    cache_salt         1024 characters                         api_codec
    stop               16 strings of 1..256 characters         api_codec
    stop_token_ids     256 ids, each in [0, vocab_size)        api_codec (count), scheduler (vocab)
    token_ids          max_model_len - max_tokens ids          Scheduler._validate, before the vocab scan
    text               max_model_len x 64 characters           AsyncEngine.submit/tokenize, before tokenizing
    Detokenize ids     262144 ids, each in [0, vocab_size)     AsyncEngine.detokenize, before decoding
    images             8, each 1 B..10 MiB, <= 64 M pixels    api_codec (count, bytes), images.py (rest)
    whole message      16 MiB (gRPC, RESOURCE_EXHAUSTED)       the Engine server's receive limit
"""

from __future__ import annotations

from control_plane.errors import InvalidRequestError

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 256
# No tokenizer we know averages more than a few characters per token on real text; 64 leaves
# room for long whitespace runs while bounding the tokenizer's work to a fixed multiple of
# the model's context.
MAX_CHARS_PER_TOKEN = 64
MAX_ENGINE_MESSAGE_BYTES = 16 * 1024 * 1024
# Detokenize: 256k ids (at most 1.25 MiB of varints) decode in well under a second.
MAX_DETOKENIZE_IDS = 262_144
_ECHO_CHARS = 64


def short(text: str) -> str:
    """`text` for an error message or a log line: at most ~64 characters, control characters
    escaped (a NUL or an ANSI escape in a client's id must not reach a terminal raw)."""
    cut = text if len(text) <= _ECHO_CHARS else f"{text[:_ECHO_CHARS]}...({len(text)} chars)"
    return cut.encode("unicode_escape").decode("ascii") if not cut.isprintable() else cut


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id has {len(request_id)} characters; the limit is {MAX_REQUEST_ID_CHARS}"
        )


def check_fields(request_id: str, cache_salt: str, stop: tuple[str, ...], stop_token_ids) -> None:
    """The model-independent limits of a GenerateRequest (InvalidRequestError)."""
    check_request_id(request_id)
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"cache_salt has {len(cache_salt)} characters; the limit is {MAX_CACHE_SALT_CHARS}"
        )
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not 1 <= len(s) <= MAX_STOP_LEN for s in stop):
        raise InvalidRequestError(f"each stop string must have 1..{MAX_STOP_LEN} characters")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stop_token_ids)}")


def check_text_size(num_chars: int, max_model_len: int) -> None:
    """Before tokenizing: a text that cannot fit the model is refused without the work."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > limit:
        raise InvalidRequestError(
            f"the prompt text has {num_chars} characters; at most {limit} are accepted "
            f"({MAX_CHARS_PER_TOKEN} per token of the model's max length {max_model_len})"
        )


def check_detokenize_ids(token_ids, vocab_size: int) -> None:
    """Detokenize's ids: the count first, then the scan (InvalidRequestError naming the id)."""
    if len(token_ids) > MAX_DETOKENIZE_IDS:
        raise InvalidRequestError(f"at most {MAX_DETOKENIZE_IDS} token_ids, got {len(token_ids)}")
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
