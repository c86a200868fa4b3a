"""Streaming detokenization and stop strings.

The reference is Tokenizer.decode of the whole sequence (test_tokenizer.py checks that decode equals
transformers'). Tokenizers are trained here, offline, to cover three decoder families:
- byte-level BPE (GPT-2/Qwen): tokens split UTF-8 characters anywhere;
- byte-fallback BPE with a Metaspace pre-tokenizer (Llama/Mistral converted with legacy=False):
  rare characters become <0xXX> byte tokens, and the decoder strips the first token's leading space;
- Unigram with a Metaspace decoder and clean_up_tokenization_spaces (T5/SentencePiece-like).
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from tidal.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from tidal.tokenizer.detokenizer import CONTEXT_TOKENS, MAX_PENDING, _CleanupStream
from tidal.tokenizer.tokenizer import clean_up_tokenization

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Don't panic , it's fine .",
    "Café, naïve, résumé, jalapeño, über, Ångström — façade!",
    "東京は日本の首都です。中文分词测试：我们在北京吃饭。한국어 문장.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ 🚀 👨‍👩‍👧 and more 🤖.",
    "Привет, мир! Как дела? Γειά σου Κόσμε. مرحبا بالعالم",
    "def f(x):\n    return x ** 2  # squares\n\n",
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}',
] * 30
SPECIALS = ["<s>", "</s>", "<|im_end|>"]


def _save(tok: HFTokenizer, d: Path, config: dict) -> Tokenizer:
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(d)


def build_bytelevel(d: Path) -> Tokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return _save(tok, d, {"eos_token": "<|im_end|>"})


def build_byte_fallback(d: Path) -> Tokenizer:
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    # Train on words (like SentencePiece), then run unsplit as converted Llama tokenizers do.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    # A small alphabet pushes CJK and emoji onto the byte-fallback path.
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, limit_alphabet=100,
                                  initial_alphabet=list(string.ascii_letters + string.digits + "▁"),
                                  special_tokens=["<unk>"] + SPECIALS)
    tok.train_from_iterator(CORPUS, trainer)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    data = json.loads(tok.to_str())
    for b in range(256):
        data["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(data["model"]["vocab"]))
    data["model"]["byte_fallback"] = True
    tok = HFTokenizer.from_str(json.dumps(data))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return _save(tok, d, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def build_unigram(d: Path) -> Tokenizer:
    tok = HFTokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=300, show_progress=False, unk_token="<unk>",
                                      special_tokens=["<unk>"] + SPECIALS)
    tok.train_from_iterator(CORPUS, trainer)
    return _save(tok, d, {"eos_token": "</s>", "unk_token": "<unk>", "clean_up_tokenization_spaces": True})


BUILDERS = {"bytelevel": build_bytelevel, "byte_fallback": build_byte_fallback, "unigram": build_unigram}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tok(request, tmp_path_factory) -> Tokenizer:
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [d.push(i) for i in ids] + [d.flush()]
    assert d.text == "".join(deltas)
    return deltas


def well_formed_sequences(tok: Tokenizer, rng: random.Random, n: int) -> list[list[int]]:
    """Random id sequences whose decode is valid text: random ids, plus splices of real encodings
    (which put split characters and special tokens in odd places)."""
    specials = [tok.token_to_id(s) for s in SPECIALS]
    texts = sorted(set(CORPUS))
    out = []
    while len(out) < n:
        if rng.random() < 0.4:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        else:
            ids = []
            for _ in range(rng.randrange(1, 4)):
                text = rng.choice(texts)
                a = rng.randrange(len(text))
                ids += tok.encode(text[a:a + rng.randrange(1, 30)], add_special_tokens=False)
                if rng.random() < 0.4:
                    ids.append(rng.choice(specials))
        if all(REPLACEMENT not in tok.decode(ids, skip_special_tokens=s) for s in (True, False)):
            out.append(ids)
    return out


REPLACEMENT = "\ufffd"


def test_deltas_concatenate_to_decode(tok):
    rng = random.Random(0)
    for ids in well_formed_sequences(tok, rng, 300):
        for skip in (True, False):
            deltas = stream(tok, ids, skip=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids
            assert not any(REPLACEMENT in d for d in deltas)


def test_unicode_strings_stream_back_exactly(tok):
    for text in sorted(set(CORPUS)):
        ids = tok.encode(text, add_special_tokens=False)
        deltas = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
        assert not any(REPLACEMENT in d for d in deltas)


def test_prompt_context_gives_the_continuation_text(tok):
    """With prompt_ids the text is what the generated ids add to the prompt's text."""
    for text in sorted(set(CORPUS)) + ["The quick brown fox 東京 😀 🦊 ñandú 𝔘𝔫𝔦 ok", "a🦊🦊b"]:
        ids = tok.encode(text, add_special_tokens=False)
        for cut in range(1, len(ids)):
            prompt, gen = ids[:cut], ids[cut:]
            before = tok.decode(prompt, skip_special_tokens=True)
            full = tok.decode(prompt + gen, skip_special_tokens=True)
            if before.endswith(REPLACEMENT) or not full.startswith(before):
                continue                               # the prompt ends inside a character
            deltas = stream(tok, gen, prompt)
            assert "".join(deltas) == full[len(before):], (text, cut)
            assert not any(REPLACEMENT in d for d in deltas)


def test_bytelevel_prompt_context_equals_plain_decode(tmp_path):
    tok = build_bytelevel(tmp_path)
    ids = tok.encode("Hello 東京 😀 world", add_special_tokens=False)
    for cut in range(len(ids)):
        if REPLACEMENT not in tok.decode(ids[:cut]):
            assert "".join(stream(tok, ids[cut:], ids[:cut])) == tok.decode(ids[cut:])


def test_metaspace_keeps_the_word_boundary_space_after_a_prompt(tmp_path):
    tok = build_byte_fallback(tmp_path)
    prompt = tok.encode("The quick brown", add_special_tokens=False)
    gen = tok.encode("The quick brown fox jumps", add_special_tokens=False)[len(prompt):]
    assert tok.convert_ids_to_tokens(gen)[0].startswith("▁")
    assert "".join(stream(tok, gen, prompt)) == " fox jumps"
    assert "".join(stream(tok, gen)) == tok.decode(gen) == "fox jumps"


def test_split_characters_are_held_back(tmp_path):
    tok = build_byte_fallback(tmp_path)
    ids = tok.encode("ok 🦊!", add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert sum(t.startswith("<0x") for t in tokens) == 4      # the emoji is 4 byte-fallback tokens
    d = IncrementalDetokenizer(tok)
    deltas = [d.push(i) for i in ids]
    assert "🦊" in deltas and "".join(deltas) + d.flush() == "ok 🦊!"
    first_byte = tokens.index("<0xF0>")
    assert deltas[first_byte:first_byte + 3] == ["", "", ""]


def test_flush_emits_an_incomplete_character_like_decode(tok):
    ids = tok.encode("ab 😀", add_special_tokens=False)
    for cut in range(1, len(ids) + 1):
        assert "".join(stream(tok, ids[:cut])) == tok.decode(ids[:cut], skip_special_tokens=True)


def test_invalid_bytes_do_not_stall_the_stream(tmp_path):
    tok = build_byte_fallback(tmp_path)
    bad = tok.token_to_id("<0xF0>")
    word = tok.encode("fox", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    out = [d.push(bad) for _ in range(MAX_PENDING)]
    assert out[-1] != ""                  # gave up waiting: these bytes never form a character
    assert "".join(out) + "".join(d.push(i) for i in word) + d.flush() == tok.decode([bad] * MAX_PENDING + word)


def test_window_stays_bounded(tmp_path):
    """O(1) per token: every decode call sees a short window, not the whole sequence."""
    tok = build_byte_fallback(tmp_path)
    eos = tok.token_to_id("</s>")
    ids = []
    for i, text in enumerate(CORPUS[:70]):
        ids += tok.encode(text, add_special_tokens=False) + [eos] * (50 if i == 3 else 1)
    assert len(ids) > 2000
    for skip in (True, False):
        sizes = []
        raw = tok.decode_raw
        tok.decode_raw = lambda window, **kw: sizes.append(len(window)) or raw(window, **kw)
        try:
            text = "".join(stream(tok, ids[10:], prompt=ids[:10], skip=skip))
        finally:
            del tok.decode_raw
        before = tok.decode(ids[:10], skip_special_tokens=skip)
        assert text == tok.decode(ids, skip_special_tokens=skip)[len(before):]
        assert max(sizes) <= CONTEXT_TOKENS + 2 * MAX_PENDING
        assert len(sizes) <= 2 * len(ids) + 2 * CONTEXT_TOKENS


def test_special_tokens_between_words(tok):
    eos = tok.token_to_id("</s>")
    a = tok.encode("The quick", add_special_tokens=False)
    b = tok.encode(" brown fox", add_special_tokens=False)
    for ids in (a + [eos] + b, a + [eos, eos, eos] + b, [eos] + a):
        for skip in (True, False):
            assert "".join(stream(tok, ids, skip=skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_cleanup_stream_equals_batch_cleanup():
    rng = random.Random(3)
    pieces = [" ", ".", "?", "!", ",", "'", "n't", "m", "s", "ve", "re", "a", " '", "n", "t", "x y"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 25)))
        stream_ = _CleanupStream()
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 6))))
        parts = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        assert "".join(stream_.feed(p) for p in parts) + stream_.flush() == clean_up_tokenization(text), text


# ---- stop strings --------------------------------------------------------------------------------
def run_matcher(stops, deltas):
    m = StopStringMatcher(stops)
    out, hit = [], False
    for delta in deltas:
        text, hit = m.feed(delta)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit, m


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 8))))
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


def expected_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[:min(hits)], True) if hits else (text, False)


def test_stop_strings_property():
    rng = random.Random(7)
    alphabet = "ab</>\n 東😀"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5)))
                 for _ in range(rng.randrange(0, 4))]
        got, hit, _ = run_matcher(stops, random_split(rng, text))
        assert (got, hit) == expected_cut(text, stops), (text, stops)


def test_stop_split_across_deltas():
    got, hit, m = run_matcher(["</answer>", "STOP"], ["The answer is 4.</ans", "wer> and more", "x"])
    assert (got, hit, m.matched) == ("The answer is 4.", True, "</answer>")
    m = StopStringMatcher(["</answer>"])
    assert m.feed("abc</an") == ("abc", False) and m.held == "</an"
    assert m.feed("t") == ("</ant", False)            # not a stop after all: released at once
    assert m.feed("x") == ("x", False)
    assert m.feed("</answer>tail") == ("", True)
    assert m.feed("more") == ("", True) and m.flush() == ""


def test_no_stops_passes_through_without_holdback():
    m = StopStringMatcher([])
    for delta in ["a", "<", "/", "b"]:
        assert m.feed(delta) == (delta, False)
    assert m.flush() == ""
    m = StopStringMatcher(["", "zz"])                 # the empty string is not a stop
    assert m.feed("abz") == ("ab", False) and m.flush() == "z"
