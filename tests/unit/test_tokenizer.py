"""Tokenizer vs transformers (the independent reference) on tokenizers trained here, offline.

Two tokenizer families, built with the `tokenizers` library on a small unicode-heavy corpus:
- "bytelevel": GPT-2/Qwen-style byte-level BPE, ChatML special tokens, non-special <think>/<tool_call>
  added tokens, no BOS;
- "metaspace": Llama/Mistral-style BPE with byte fallback (CJK and emoji fall back to <0xXX> tokens),
  the legacy Prepend/Replace normalizer, a Strip decoder, and a TemplateProcessing post-processor that
  adds <s>.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from tidal.errors import CheckpointError, ConfigError
from tidal.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I'm fine, thanks.",
    "Mixture-of-Experts models route each token to a few experts.",
    "def add(a, b):\n    return a + b\n",
    "Café, naïve, résumé, jalapeño, über, Ångström, façade.",
    "東京は日本の首都です。今日は良い天気ですね。",
    "中文分词测试：我们在北京吃饭。",
    "한국어 문장도 조금 있습니다.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ 🚀 and more 🤖.",
    "Привет, мир! Как дела?",
    "Numbers 12345 67890 3.14159 and symbols #@$%^&*()[]{}<>",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "  leading spaces and\ttabs\nnew lines\n\n",
] * 20

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INST = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)


def build_bytelevel(d: Path, config: dict | None = None) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t in ["<think>", "</think>", "<tool_call>", "</tool_call>"]])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 32768,
           "add_bos_token": False, "clean_up_tokenization_spaces": False, "chat_template": CHATML}
    cfg.update(config or {})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def build_metaspace(d: Path, config: dict | None = None) -> Path:
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    # A small alphabet pushes CJK, emoji and rare accents onto the byte-fallback path.
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False, limit_alphabet=70,
                                  special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    tok = HFTokenizer.from_str(json.dumps(data))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.add_special_tokens(["[INST]", "[/INST]"])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
           "clean_up_tokenization_spaces": False, "chat_template": INST}
    cfg.update(config or {})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


BUILDERS = {"bytelevel": build_bytelevel, "metaspace": build_metaspace}


def reference(d: Path):
    return transformers.AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def pair(request, tmp_path_factory):
    d = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    return request.param, Tokenizer.from_dir(d), reference(d)


def sample_texts(seed: int = 0, n: int = 150) -> list[str]:
    """Corpus lines, edge cases, special tokens inside text, and random unicode soup."""
    texts = sorted(set(CORPUS)) + [
        "", " ", "  ", "\n", "\n\n\n", "a", " a", "a ", "Hello", " Hello", "hello  world ",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<s>[INST] hi [/INST] ok</s>",
        "x<s>y</s>z", "<think>\nmaybe\n</think>\n\nyes", "<tool_call>\n{}\n</tool_call>",
        "<|endoftext|><|endoftext|>", "don't stop . ok , right ?", "ﬁ ｆｕｌｌ ① Å",  # NFC/NFKC bait
        "🇫🇷🇯🇵👨‍👩‍👧", "\u200b\u00a0\t\r\n", "\U0010ffff", "e\u0301",
    ]
    rng = random.Random(seed)
    alphabet = "".join(sorted(set("".join(CORPUS)))) + "<>|/[]_-ßæœ€£¥₩🙂🧪∑∫√日月火水木金土"
    for _ in range(n):
        pieces = [rng.choice(CORPUS)[rng.randrange(5):rng.randrange(5, 40)] if rng.random() < 0.3
                  else "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12)))
                  for _ in range(rng.randrange(1, 5))]
        texts.append(rng.choice(["", " ", "\n"]).join(pieces))
    return texts


def test_encode_matches_transformers(pair):
    name, ours, ref = pair
    for text in sample_texts():
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add), \
                (name, text, add)


def test_decode_matches_transformers(pair):
    name, ours, ref = pair
    rng = random.Random(1)
    sequences = [ref.encode(t) for t in sample_texts(seed=2, n=60)]
    sequences += [[rng.randrange(len(ref)) for _ in range(rng.randrange(1, 30))] for _ in range(200)]
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), \
                (name, ids, skip)


def test_vocabulary_and_special_tokens_match(pair):
    name, ours, ref = pair
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.eos_token_ids == {ref.eos_token_id}
    assert ours.all_special_ids == ref.all_special_ids
    ids = list(range(ours.vocab_size))
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
        ref.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(3) == ref.convert_ids_to_tokens(3)
    for i in ids[:50]:
        assert ours.token_to_id(ours.id_to_token(i)) == i


def test_bos_added_once(tmp_path):
    ours = Tokenizer.from_dir(build_metaspace(tmp_path))
    ids = ours.encode("Hello world")
    assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == 1
    assert ours.encode("Hello world", add_special_tokens=False) == ids[1:]
    # A template that writes <s> itself, encoded as chat prompts are (no special tokens added).
    prompt = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<s>[INST]")
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True).count(1) == 1


def test_chat_template_tokenize_matches_transformers(pair):
    name, ours, ref = pair
    msgs = [{"role": "user", "content": "Café 😀 東京"}, {"role": "assistant", "content": "OK!"},
            {"role": "user", "content": "again"}]
    for agp in (True, False):
        assert ours.apply_chat_template(msgs, add_generation_prompt=agp) == \
            ref.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=False)
        assert ours.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=True) == \
            ref.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=True, return_dict=False)


def test_eos_ids_union_with_generation_config(tmp_path):
    d = build_bytelevel(tmp_path)
    end = Tokenizer.from_dir(d).token_to_id("<|endoftext|>")
    im_end = Tokenizer.from_dir(d).token_to_id("<|im_end|>")
    assert Tokenizer.from_dir(d).eos_token_ids == {im_end}
    assert Tokenizer.from_dir(d, {"eos_token_id": end}).eos_token_ids == {im_end, end}
    assert Tokenizer.from_dir(d, {"eos_token_id": [end, im_end, 7]}).eos_token_ids == {im_end, end, 7}
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [end]}))
    assert Tokenizer.from_dir(d).eos_token_ids == {im_end, end}      # read from the directory
    assert Tokenizer.from_dir(d, {}).eos_token_ids == {im_end}       # an explicit dict wins


@pytest.mark.parametrize("config", [
    # eos given AddedToken-style, pad not in the vocabulary at all (transformers adds it)
    {"eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False,
                   "single_word": False, "special": True}, "pad_token": "<pad>"},
    # a non-special added token named as eos becomes special (dropped by skip_special_tokens)
    {"eos_token": "</think>"},
    # extra special tokens, old and new spelling
    {"additional_special_tokens": ["<tool_call>", "<|im_start|>"]},
    {"extra_special_tokens": ["<think>"]},
    # split_special_tokens: special tokens in text are plain text
    {"split_special_tokens": True},
    # with an (empty) added_tokens_decoder the config is authoritative: </think> stays non-special
    {"eos_token": "</think>", "added_tokens_decoder": {}},
    # a v4-style full added_tokens_decoder that marks <think> special although tokenizer.json does not
    {"added_tokens_decoder": {
        str(i): {"__type": "AddedToken", "content": c, "lstrip": False, "rstrip": False,
                 "normalized": False, "single_word": False, "special": c != "</think>"}
        for i, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [None] * 657
                              + ["<think>", "</think>"]) if c}},
    # model-specific named token (a config key ending in _token)
    {"think_token": "<think>", "image_token": "<image>"},
])
def test_special_token_config_variants_match_transformers(tmp_path, config):
    d = build_bytelevel(tmp_path, config)
    ours, ref = Tokenizer.from_dir(d), reference(d)
    assert ours.vocab_size == len(ref)
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.special_tokens == ref.special_tokens_map      # what chat templates see
    assert ours.pad_token_id == ref.pad_token_id
    for text in sample_texts(seed=3, n=20):
        ids = ref.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_legacy_special_tokens_map(tmp_path):
    d = build_metaspace(tmp_path, {"eos_token": None, "bos_token": None})
    (d / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}, "eos_token": "</s>", "unk_token": "<unk>"}))
    ours, ref = Tokenizer.from_dir(d), reference(d)
    assert (ours.bos_token_id, ours.eos_token_ids) == (ref.bos_token_id, {ref.eos_token_id})
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == \
        ref.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)


def test_bos_flag_disagreeing_with_post_processor_follows_tokenizer_json(tmp_path, caplog):
    d = build_metaspace(tmp_path, {"add_bos_token": False})
    ours, ref = Tokenizer.from_dir(d), reference(d)
    assert ours.encode("hi") == ref.encode("hi")
    assert ours.encode("hi")[0] == ours.bos_token_id
    assert "add_bos_token" in caplog.text


def test_clean_up_tokenization_spaces_skipped_for_bpe(tmp_path):
    d = build_bytelevel(tmp_path, {"clean_up_tokenization_spaces": True})
    ours, ref = Tokenizer.from_dir(d), reference(d)
    ids = ref.encode("don't stop . ok , yes ?")
    assert ours.decode(ids) == ref.decode(ids) == "don't stop . ok , yes ?"


def test_chat_template_sources(tmp_path):
    d = build_bytelevel(tmp_path, {"chat_template": [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools[0].function.name }}"}]})
    tok = Tokenizer.from_dir(d)
    msgs = [{"role": "user", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert tok.apply_chat_template(msgs) == "Dx"
    assert tok.apply_chat_template(msgs, tools=tools) == "Tf"
    ref = reference(d)
    assert ref.apply_chat_template(msgs, tools=tools, tokenize=False) == "Tf"
    (d / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert Tokenizer.from_dir(d).apply_chat_template(msgs, tools=tools) == "Jx"
    assert Tokenizer.from_dir(d, chat_template="O{{ messages[0].content }}").apply_chat_template(msgs) == "Ox"
    f = tmp_path / "override.jinja"
    f.write_text("F{{ messages[0].content }}")
    assert Tokenizer.from_dir(d, chat_template=f).apply_chat_template(msgs) == "Fx"
    with pytest.raises(ConfigError, match="--chat-template"):
        Tokenizer.from_dir(d, chat_template=tmp_path / "missing.jinja")


def test_model_max_length(tmp_path):
    assert Tokenizer.from_dir(build_bytelevel(tmp_path / "a")).model_max_length == 32768
    assert Tokenizer.from_dir(build_bytelevel(tmp_path / "b", {"model_max_length": int(1e30)})
                              ).model_max_length is None


# ---- errors --------------------------------------------------------------------------------------
def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json(tmp_path):
    d = build_bytelevel(tmp_path)
    text = (d / "tokenizer.json").read_text()
    (d / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"tokenizer\.json.*not valid JSON"):
        Tokenizer.from_dir(d)
    (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json.*cannot load"):
        Tokenizer.from_dir(d)


def test_invalid_tokenizer_config(tmp_path):
    d = build_bytelevel(tmp_path)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    with pytest.raises(CheckpointError, match="eos_token"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(CheckpointError, match="tokenizer_config.json.*compile"):
        Tokenizer.from_dir(d)


def test_no_chat_template_says_how_to_fix(tmp_path):
    d = build_bytelevel(tmp_path, {"chat_template": None})
    tok = Tokenizer.from_dir(d)
    assert tok.encode("still works") != []
    with pytest.raises(CheckpointError, match="--chat-template.*chat_template.jinja"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
