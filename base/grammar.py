"""Structured outputs on llguidance: a `StructuredOutput` turned into a compiled grammar for a
tokenizer, shared by both planes (the control plane compiles to validate before admission, the
worker to constrain sampling). Torch-free: llguidance is a Rust library with no Python
dependencies, which is why it was chosen over xgrammar (whose package requires torch and
transformers, so it could not run in the control plane).

    StructuredOutput ──grammar_text──▶ llguidance grammar (JSON) ──GrammarCompiler.compile──▶
        LLMatcher template (grammar + lexer built for the tokenizer, cached by the spec)
        ──.deep_copy()──▶ one matcher per constrained sequence

JSON is generated compact (no whitespace between tokens): the output is what `json.dumps(...,
separators=(",", ":"))` would print, and a random or weak model cannot spend its token budget
on spaces.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from base.sampling import StructuredOutput
from base.tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False}
_DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples"))  # values, not subschemas
CACHE_ENTRIES = 256  # compiled grammars kept per process (LRU, keyed by the spec)


class GrammarError(ValueError):
    """The engine rejects a structured-output spec; the message names the field."""


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise GrammarError("structured outputs need the llguidance package (pip install llguidance)") from exc
    return llguidance


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of `spec` (not yet checked: compile does that)."""
    llg = _llguidance()
    field = spec.describe()
    if spec.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"{field} is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{field} must be a JSON object (a JSON Schema), got {type(schema).__name__}")
        return llg.LLMatcher.grammar_from_json_schema(
            json.dumps(close_objects(schema)), defaults=JSON_OPTIONS
        )
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in spec.choices)
        return llg.LLMatcher.grammar_from_lark(lark)
    if spec.kind == "grammar":
        try:
            return llg.grammar_from("grammar", spec.text)  # GBNF (llama.cpp) or Lark
        except (ValueError, Exception) as exc:  # noqa: BLE001 - the converter raises bare Exception
            raise GrammarError(f"{field}: {exc}") from None
    raise GrammarError(f"sampling.structured_output: unknown kind {spec.kind!r}")


def close_objects(schema):
    """`schema` with every object that lists `properties` but says nothing about others made
    closed (additionalProperties: false), as OpenAI's strict mode and xgrammar's default do.
    JSON Schema's own default allows any other key, which a weak model then fills with noise
    until max_tokens (seen with LangChain's function_calling schemas). Every output still
    validates against the original schema. Returns a new schema; the input is not changed."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else close_objects(v)) for k, v in schema.items()}
    if (
        isinstance(out.get("properties"), dict)
        and not {"additionalProperties", "patternProperties"} & out.keys()
    ):
        out["additionalProperties"] = False
    return out


class _TokenizerAdapter:
    """What llguidance.TokenizerWrapper reads: each id's bytes, EOS/BOS, special ids, encode."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token_id = None
        special = [i for i in range(vocab_size) if tokenizer.is_special(i)]
        self.special_token_ids = special
        tokens = []
        for i in range(vocab_size):
            piece = tokenizer.token_bytes(i)
            if i in eos_token_ids and not piece:
                piece = b"<|eos|>"
            tokens.append(piece)
        self.tokens = tokens

    def __call__(self, s: bytes | str) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, False)


def make_ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """An llguidance tokenizer over the model's whole vocabulary (ids past the tokenizer's are
    never allowed). Building it walks every id once: ~0.1 s per 100k ids."""
    llg = _llguidance()
    if not eos_token_ids:
        raise GrammarError("structured outputs need the model's EOS token id (config.json has none)")
    adapter = _TokenizerAdapter(tokenizer, vocab_size, tuple(eos_token_ids))
    return llg.LLTokenizer(llg.TokenizerWrapper(adapter), n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GrammarCompiler:
    """Compiles specs for one tokenizer; a thread-safe LRU of pristine matchers keyed by the spec.
    `compile` drops the GIL inside llguidance, so callers may run it on a thread."""

    def __init__(self, ll_tokenizer, entries: int = CACHE_ENTRIES) -> None:
        self.ll_tokenizer = ll_tokenizer
        self._entries = entries
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, spec: StructuredOutput):
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
            return template

    def compile(self, spec: StructuredOutput):
        """A pristine LLMatcher for `spec` (callers deep_copy it). GrammarError if rejected."""
        template = self.cached(spec)
        if template is not None:
            return template
        llg = _llguidance()
        text = grammar_text(spec)
        matcher = llg.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"{spec.describe()} is rejected by the grammar engine: {_short(matcher.get_error())}"
            )
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, spec: StructuredOutput):
        return self.compile(spec).deep_copy()


def _short(message: str, limit: int = 500) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + " ..."
