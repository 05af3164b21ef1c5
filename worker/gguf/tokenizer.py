"""A GGUF file's tokenizer (`tokenizer.ggml.*`) as a tokenizer.json string, built with the
`tokenizers` library: the form `WorkerInfo.tokenizer_json` already ships to the control plane,
so a GGUF model's text prompts, stop strings and detokenization need nothing else.

    tokenizer.ggml.model "gpt2"   byte-level BPE: tokens (already in GPT-2's byte alphabet),
                                  merges ("a b" per line), `tokenizer.ggml.pre` naming the split:
        gpt2 / gpt-2 / default    GPT-2's regex inside ByteLevel
        smollm / starcoder        single digits, then GPT-2's regex (llama.cpp's "\\p{N}" rule)
        qwen2 / deepseek-r1-qwen  Qwen2's regex (single digits)
        llama-bpe / llama3        Llama 3's regex (digits in runs of up to 3), merges ignored
                                  for a word already in the vocabulary (llama.cpp does so)
    tokenizer.ggml.model "llama"  SentencePiece BPE: tokens with scores; merges implied by the
                                  scores (a pair merges when both halves and the whole are
                                  tokens, best whole first); byte fallback (<0xNN> tokens);
                                  "▁" for spaces, one prepended when add_space_prefix is set

Token types (llama.cpp): 3 = control -> special added tokens, 4 = user-defined -> plain added
tokens (matched whole in text); BOS/EOS/PAD from `tokenizer.ggml.*_token_id`, BOS prepended by
the post-processor when `tokenizer.ggml.add_bos_token` (default: on for "llama", off for "gpt2").
Any other model or pre-tokenizer is refused by name: a wrong split would tokenize silently wrong.
"""

from __future__ import annotations

from worker.gguf.reader import GgufFile

CONTROL, USER_DEFINED = 3, 4
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre-tokenizer name -> (split regex, split digits one by one first, ignore_merges)
_BPE_PRE = {
    "default": (_GPT2_SPLIT, False, False),
    "gpt2": (_GPT2_SPLIT, False, False),
    "gpt-2": (_GPT2_SPLIT, False, False),
    "smollm": (_GPT2_SPLIT, True, False),
    "starcoder": (_GPT2_SPLIT, True, False),
    "qwen2": (_QWEN2_SPLIT, False, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, True),
}
_SPECIAL_KEYS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


def special_token_ids(gguf: GgufFile) -> tuple[int | None, tuple[int, ...]]:
    """(BOS id or None, EOS ids): the EOS, then end-of-turn / end-of-message ids when set
    (generation stops on any of them; ChatML files name <|im_end|> as EOS or EOT)."""
    bos = gguf.value("tokenizer.ggml.bos_token_id", int, None)
    eos = [gguf.value(f"tokenizer.ggml.{k}_token_id", int, None) for k in ("eos", "eot", "eom")]
    return bos, tuple(dict.fromkeys(e for e in eos if e is not None))


def chat_template(gguf: GgufFile) -> str | None:
    return gguf.value("tokenizer.chat_template", str, None)


def special_token_strings(gguf: GgufFile) -> dict[str, str]:
    """bos_token / eos_token / unk_token / pad_token as text (what chat templates read)."""
    if not gguf.has("tokenizer.ggml.tokens"):
        return {}
    tokens = gguf.reader.fields["tokenizer.ggml.tokens"]
    out = {}
    for name, key in _SPECIAL_KEYS.items():
        token_id = gguf.value(f"tokenizer.ggml.{key}_token_id", int, None)
        if token_id is not None and 0 <= token_id < len(tokens.data):
            out[name] = tokens.contents(token_id)
    return out


def tokenizer_json(gguf: GgufFile) -> str:
    """The tokenizer.json text; a ModelLoadError names the field it cannot build from."""
    model = gguf.value("tokenizer.ggml.model", str)
    tokens = gguf.value("tokenizer.ggml.tokens", list)
    types = gguf.value("tokenizer.ggml.token_type", list, [1] * len(tokens))
    if len(types) != len(tokens):
        raise gguf.error(
            f"metadata field 'tokenizer.ggml.token_type' has {len(types)} entries for {len(tokens)} tokens"
        )
    if model == "gpt2":
        tokenizer = _byte_level_bpe(gguf, tokens)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(gguf, tokens)
    else:
        raise gguf.error(
            f"metadata field 'tokenizer.ggml.model' is {model!r}: pagedkv builds 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece) tokenizers"
        )
    _add_special(tokenizer, tokens, types)
    _add_bos(gguf, tokenizer, tokens, default=model == "llama")
    return tokenizer.to_str()


def _byte_level_bpe(gguf: GgufFile, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = gguf.value("tokenizer.ggml.pre", str, "default")
    if pre not in _BPE_PRE:
        raise gguf.error(
            f"metadata field 'tokenizer.ggml.pre' is {pre!r}, a pre-tokenizer pagedkv does not know "
            f"(known: {', '.join(_BPE_PRE)})"
        )
    split, digits, ignore_merges = _BPE_PRE[pre]
    merges = [tuple(m.split(" ", 1)) for m in gguf.value("tokenizer.ggml.merges", list)]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split == _GPT2_SPLIT:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(gguf: GgufFile, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    scores = gguf.value("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens):
        raise gguf.error(
            f"metadata field 'tokenizer.ggml.scores' has {len(scores)} entries for {len(tokens)} tokens"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = gguf.value("tokenizer.ggml.unknown_token_id", int, None)
    model = models.BPE(
        vocab,
        _merges_from_scores(tokens, scores),
        unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    prefix = gguf.value("tokenizer.ggml.add_space_prefix", bool, True)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges: every split of a token into two tokens, ranked by the whole
    token's score (higher merges first), then by the halves' ids (a stable, vocabulary order)."""
    ids = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[token], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special(tokenizer, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    control = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == USER_DEFINED
    ]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)


def _add_bos(gguf: GgufFile, tokenizer, tokens: list[str], default: bool) -> None:
    """The post-processor: BOS before the text when add_bos_token (add_special_tokens=True)."""
    from tokenizers import processors

    bos = gguf.value("tokenizer.ggml.bos_token_id", int, None)
    steps = []
    if gguf.value("tokenizer.ggml.model", str) == "gpt2":
        steps.append(processors.ByteLevel(trim_offsets=False))
    if (
        gguf.value("tokenizer.ggml.add_bos_token", bool, default)
        and bos is not None
        and 0 <= bos < len(tokens)
    ):
        name = tokens[bos]
        steps.append(
            processors.TemplateProcessing(
                single=f"{name}:0 $A:0", pair=f"{name}:0 $A:0 {name}:1 $B:1", special_tokens=[(name, bos)]
            )
        )
    if steps:
        tokenizer.post_processor = processors.Sequence(steps)


def tokenizer_config(gguf: GgufFile) -> dict:
    """A tokenizer_config.json equivalent (chat template, special-token strings, add_bos_token)."""
    config = {**special_token_strings(gguf), "chat_template": chat_template(gguf)}
    return {k: v for k, v in config.items() if v is not None}
