"""Per-token bytes (`Tokenizer.token_bytes`) and their display, against the `tokenizers`
library's own decode (and transformers' GPT-2 byte table) as the oracle.

Two tokenizers are built here the way real checkpoints ship them: a byte-level BPE (GPT-2,
Qwen) and a SentencePiece-style BPE with byte fallback (Llama's tokenizer.json), each with
merges that split a multi-byte character across tokens, and added special tokens.
"""

from __future__ import annotations

import pytest

from base.tokenizer import ByteTokenizer, HFTokenizer, token_display

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors  # noqa: E402

TEXT = "naïve café 日本語 🙂"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAIN_ADDED = "<think>"  # Qwen3 marks it special=False


def _merges(tokens: list[str]) -> list[tuple[str, str]]:
    """Left-to-right merges that build each token from its characters."""
    merges: list[tuple[str, str]] = []
    for tok in tokens:
        for i in range(2, len(tok) + 1):
            pair = (tok[: i - 1], tok[i - 1])
            if pair not in merges:
                merges.append(pair)
    return merges


def _vocab(base: list[str], merges: list[tuple[str, str]]) -> dict[str, int]:
    vocab = {t: i for i, t in enumerate(base)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return vocab


def _add_tokens(tok) -> None:
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(PLAIN_ADDED, special=False, normalized=False)])


def byte_level_bpe():
    """GPT-2 / Qwen style: ByteLevel pre-tokenizer and decoder over the 256-char alphabet."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    to_chars = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def bl(text: str) -> str:  # the tokenizer's own byte -> char mapping
        return to_chars.pre_tokenize_str(text)[0][0]

    # Whole characters (é, 本), a character cut in two (日 = [E6 97][A5]) and an emoji cut in
    # halves; ï stays two single-byte tokens.
    merged = [bl(" caf"), bl("é"), bl(" na"), bl("日")[:2], bl("本"), bl("🙂")[:2], bl("🙂")[2:]]
    merges = _merges(merged)
    tok = tokenizers.Tokenizer(models.BPE(vocab=_vocab(alphabet, merges), merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok)
    return tok


def sentencepiece_bpe(decoder=None):
    """Llama style: Metaspace pre-tokenizer, BPE with byte fallback (<0xNN> pieces) and
    decoder Sequence[Replace(▁, " "), ByteFallback, Fuse, Strip(" ", 1, 0)]."""
    base = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    base += ["▁", *"naïvecfé日本"]  # not 語 or 🙂: those fall back to bytes
    merges = _merges(["▁na", "▁caf"])
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=_vocab(base, merges), merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoder or decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    _add_tokens(tok)
    return tok


def joined(ours: HFTokenizer, ids: list[int]) -> bytes:
    return b"".join(ours.token_bytes(i) for i in ids)


def split_characters(ours, ids: list[int]) -> list[list[bytes]]:
    """Runs of consecutive tokens whose bytes are not whole UTF-8 on their own."""
    runs, run = [], []
    for i in ids:
        piece = ours.token_bytes(i)
        try:
            piece.decode("utf-8")
            if run:
                runs.append(run)
            run = []
        except UnicodeDecodeError:
            run.append(piece)
    return runs + ([run] if run else [])


# -- byte-level BPE ----------------------------------------------------------------------------
def test_byte_level_bytes_join_to_the_decoded_text():
    hf = byte_level_bpe()
    ours = HFTokenizer(hf.to_str())
    ids = hf.encode(TEXT).ids
    assert ours.encode(TEXT) == ids
    assert joined(ours, ids) == hf.decode(ids).encode() == TEXT.encode()
    for i in ids:  # a token that is whole UTF-8 is what tokenizers decodes it to
        piece = ours.token_bytes(i)
        if "\ufffd" not in hf.decode([i]):
            assert piece == hf.decode([i]).encode()


def test_byte_level_split_characters_are_bytes_not_text():
    hf = byte_level_bpe()
    ours = HFTokenizer(hf.to_str())
    ids = hf.encode(TEXT).ids
    runs = split_characters(ours, ids)
    # ï (2 byte tokens), 日 ([E6 97] + [A5]), 語 (3 byte tokens), 🙂 (2 halves)
    assert [b"".join(r).decode() for r in runs] == ["ï", "日", "語", "🙂"]
    assert runs[1] == [b"\xe6\x97", b"\xa5"]
    shown = [token_display(p) for r in runs for p in r]
    assert shown[:2] == ["bytes:\\xc3", "bytes:\\xaf"]
    assert "bytes:\\xe6\\x97" in shown and "bytes:\\xa5" in shown
    assert all(s.startswith("bytes:") for s in shown)
    assert len(set(shown)) == len(shown)  # two alternatives never show the same string
    # tokenizers decodes a half alone to U+FFFD, and the two halves together to the character
    halves = [i for i in ids if ours.token_bytes(i) in runs[1]]
    assert [hf.decode([i]) for i in halves] == ["\ufffd", "\ufffd"]
    assert hf.decode(halves) == "日"


def test_byte_level_table_matches_transformers_gpt2_table():
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    hf = byte_level_bpe()
    ours = HFTokenizer(hf.to_str())
    for byte, char in convert.bytes_to_unicode().items():
        assert ours.token_bytes(hf.token_to_id(char)) == bytes((byte,))


def test_byte_level_every_two_byte_character_round_trips_through_tokenizers():
    """Lead byte x continuation byte as two single-byte tokens: tokenizers decodes the pair
    to the character, and our two pieces join to its UTF-8."""
    hf = byte_level_bpe()
    ours = HFTokenizer(hf.to_str())
    for cp in range(0x80, 0x800):
        ids = hf.encode(chr(cp)).ids
        assert joined(ours, ids) == hf.decode(ids).encode() == chr(cp).encode()


def test_byte_level_special_and_added_tokens():
    hf = byte_level_bpe()
    ours = HFTokenizer(hf.to_str())
    text = f"<|im_start|>user\n{TEXT}{PLAIN_ADDED}<|im_end|>"
    ids = hf.encode(text).ids
    assert joined(ours, ids) == hf.decode(ids, skip_special_tokens=False).encode() == text.encode()
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)  # the default: skip
    for content in SPECIAL:
        i = hf.token_to_id(content)
        assert ours.token_bytes(i) == content.encode() and ours.is_special(i)
    added = hf.token_to_id(PLAIN_ADDED)
    assert ours.token_bytes(added) == PLAIN_ADDED.encode() and not ours.is_special(added)
    assert not any(ours.is_special(i) for i in hf.encode(TEXT).ids)


def test_id_past_the_tokenizer_vocab_has_no_bytes():
    """A model's vocab may be padded past its tokenizer's (Qwen: 151936 vs 151665)."""
    hf = byte_level_bpe()
    ours = HFTokenizer(hf.to_str())
    past = hf.get_vocab_size(with_added_tokens=True) + 5
    assert ours.token_bytes(past) == b"" and not ours.is_special(past)
    assert hf.decode([past]) == ""


# -- SentencePiece-style BPE with byte fallback --------------------------------------------
def test_sentencepiece_bytes_join_to_the_decoded_text():
    hf = sentencepiece_bpe()
    ours = HFTokenizer(hf.to_str())
    ids = hf.encode(TEXT, add_special_tokens=False).ids
    assert ours.encode(TEXT) == ids
    assert hf.decode(ids) == TEXT
    # The decoder's Strip(" ", 1, 0) drops the leading space of the whole text (the "▁" the
    # pre-tokenizer prepended); a token's own bytes keep it.
    assert joined(ours, ids) == b" " + hf.decode(ids).encode()
    assert ours.token_bytes(ids[0]) == b" na"


def test_sentencepiece_byte_fallback_pieces_are_single_bytes():
    hf = sentencepiece_bpe()
    ours = HFTokenizer(hf.to_str())
    ids = hf.encode(TEXT, add_special_tokens=False).ids
    runs = split_characters(ours, ids)
    assert [b"".join(r).decode() for r in runs] == ["語", "🙂"]
    assert runs[0] == [b"\xe8", b"\xaa", b"\x9e"]
    assert [hf.id_to_token(i) for i in ids if ours.token_bytes(i) == b"\xe8"] == ["<0xE8>"]
    shown = [token_display(p) for r in runs for p in r]
    assert shown[:3] == ["bytes:\\xe8", "bytes:\\xaa", "bytes:\\x9e"]
    assert len(set(shown)) == len(shown)
    assert ours.token_bytes(hf.token_to_id("日")) == "日".encode()


def test_sentencepiece_special_tokens_and_bos():
    hf = sentencepiece_bpe()
    ours = HFTokenizer(hf.to_str())
    with_bos = ours.encode(TEXT, add_special_tokens=True)
    assert with_bos == hf.encode(TEXT).ids and with_bos[0] == hf.token_to_id("<s>")
    assert with_bos[1:] == ours.encode(TEXT)
    for content in ("<s>", "</s>", "<unk>", *SPECIAL):
        i = hf.token_to_id(content)
        assert ours.token_bytes(i) == content.encode() and ours.is_special(i)
    assert not ours.is_special(hf.token_to_id("<0xE8>"))
    assert ours.decode(with_bos) == TEXT
    assert ours.decode(with_bos, skip_special_tokens=False) == hf.decode(with_bos, skip_special_tokens=False)


def test_metaspace_decoder_turns_the_marker_into_a_space():
    hf = sentencepiece_bpe(decoder=decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False))
    ours = HFTokenizer(hf.to_str())
    ids = hf.encode("naïve café", add_special_tokens=False).ids
    assert joined(ours, ids) == b" " + hf.decode(ids).encode() == " naïve café".encode()


def test_unknown_decoder_falls_back_to_decoding_each_id():
    hf = byte_level_bpe()
    hf.decoder = decoders.WordPiece()
    ours = HFTokenizer(hf.to_str())
    for i in hf.encode("abc café").ids:
        assert ours.token_bytes(i) == hf.decode([i]).encode()


# -- the byte tokenizer (embedded default model) ----------------------------------------------
def test_byte_tokenizer_defaults_are_unchanged():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode())
    assert tok.encode(TEXT, add_special_tokens=True) == [ByteTokenizer.BOS, *ids]
    framed = [ByteTokenizer.BOS, *ids, ByteTokenizer.EOS, 300]
    assert tok.decode(framed) == TEXT  # specials skipped by default, as Generate's text
    assert tok.decode(framed, skip_special_tokens=False) == f"<|bos|>{TEXT}<|eos|><|special_300|>"


def test_byte_tokenizer_token_bytes():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode()
    assert tok.token_bytes(ByteTokenizer.BOS) == b"<|bos|>" and tok.is_special(ByteTokenizer.BOS)
    assert tok.token_bytes(ByteTokenizer.EOS) == b"<|eos|>" and tok.is_special(ByteTokenizer.EOS)
    assert tok.token_bytes(511) == b"<|special_511|>" and tok.is_special(511)
    assert not any(tok.is_special(i) for i in range(256))
    emoji = [token_display(tok.token_bytes(i)) for i in tok.encode("🙂")]
    assert emoji == ["bytes:\\xf0", "bytes:\\x9f", "bytes:\\x99", "bytes:\\x82"]


def test_token_display():
    assert token_display("café".encode()) == "café"
    assert token_display(b"") == ""
    assert token_display(b"<|im_end|>") == "<|im_end|>"
    assert token_display(b"\xe6\x97") == "bytes:\\xe6\\x97"
    assert token_display(b"\xa5") != token_display(b"\xe6\x97")
