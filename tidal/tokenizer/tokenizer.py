"""The model's tokenizer: `tokenizer.json` run by the `tokenizers` library, plus what the checkpoint's
`tokenizer_config.json` says around it (special tokens, chat templates, eos ids).

Results match transformers' PreTrainedTokenizerFast / AutoTokenizer loading the same directory (the
tests check it), without importing transformers. The rules we copy from transformers 5:
- `tokenizer.json`'s post-processor decides what `encode(..., add_special_tokens=True)` adds (BOS/EOS).
  transformers ignores tokenizer_config's `add_bos_token` / `add_eos_token` when tokenizer.json exists,
  so we read them only to warn when they disagree with the post-processor.
- added tokens are registered again at load time from the config's `added_tokens_decoder` (or, in
  the legacy layout without it, tokenizer.json's list), named special tokens forced special, and
  named/extra special tokens missing from the vocabulary added; see _register_special_tokens.
- `special_tokens_map.json` overrides tokenizer_config's token names only when the config has no
  `added_tokens_decoder` (the legacy layout); newer configs carry everything themselves.
- `chat_template.jinja` (and `additional_chat_templates/*.jinja`) replace tokenizer_config's template.
- `clean_up_tokenization_spaces` is honoured in decode, except for BPE models (transformers skips it
  there because it corrupts byte-level text).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

import tokenizers
from tokenizers import AddedToken

from tidal.errors import CheckpointError, ConfigError
from tidal.tokenizer.chat_template import compile_chat_template, load_chat_template, render_chat_template

logger = logging.getLogger(__name__)

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                        "mask_token")
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized")
# transformers' stand-in for "no limit" (int(1e30)); we report None instead.
_UNLIMITED_LENGTH = 10 ** 29


def _read_json(path: Path) -> dict:
    """The JSON object in `path`, {} when the file is absent. CheckpointError names the file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise CheckpointError(
            f"{path}: not found; Tidal needs the fast tokenizer file tokenizer.json next to the weights "
            "(convert a SentencePiece-only checkpoint with transformers' save_pretrained first)")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception subclasses
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as je:
            raise CheckpointError(f"{path}: not valid JSON ({je})") from None
        raise CheckpointError(f"{path}: the tokenizers library cannot load it ({e})") from None


class Tokenizer:
    """Text <-> token ids for one model. Build with `Tokenizer.from_dir`."""

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str],
                 extra_special_tokens: Iterable[str] = (), eos_token_ids: Iterable[int] = (),
                 chat_templates: Mapping[str, str] | None = None, model_max_length: int | None = None,
                 clean_up_tokenization_spaces: bool = False, name: str = "tokenizer") -> None:
        self._backend = backend
        # transformers encodes and decodes without the truncation/padding tokenizer.json may carry.
        backend.no_truncation()
        backend.no_padding()
        self.name = name
        self.special_tokens: dict[str, str] = {k: v for k, v in special_tokens.items() if v is not None}
        self._extra_special_tokens = list(dict.fromkeys(extra_special_tokens))
        self._eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.model_max_length = model_max_length
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        # Ids that decode(skip_special_tokens=True) drops: the backend's special added tokens.
        self.skipped_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        for template in self.chat_templates.values():
            compile_chat_template(template)

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, generation_config: dict | None = None,
                 chat_template: str | Path | None = None) -> "Tokenizer":
        """Load `tokenizer.json` and its companions from a checkpoint directory.

        generation_config: the model's generation_config.json as a dict; its `eos_token_id` (int or
        list) joins the eos set. When None, `generation_config.json` in `path` is read if present.
        chat_template: a `--chat-template` override (file path or Jinja text); wins over the files.
        """
        path = Path(path)
        backend = _load_backend(path / "tokenizer.json")
        config_path = path / "tokenizer_config.json"
        config = _read_json(config_path)
        if generation_config is None:
            generation_config = _read_json(path / "generation_config.json")

        named_specs, extra_specs = _special_tokens(path, config)
        _register_special_tokens(backend, config, named_specs, extra_specs)
        named = {k: v["content"] for k, v in named_specs.items() if v is not None}
        extras = [spec["content"] for spec in extra_specs]
        # transformers' split_special_tokens: special tokens in text are tokenized as plain text.
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        _check_bos_eos_flags(backend, config, named, config_path)

        eos_ids = set()
        if named.get("eos_token") is not None:
            eos_id = backend.token_to_id(named["eos_token"])
            if eos_id is not None:
                eos_ids.add(eos_id)
        gen_eos = generation_config.get("eos_token_id") if generation_config else None
        if gen_eos is not None:
            for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
                if not isinstance(i, int):
                    raise CheckpointError(f"generation_config eos_token_id must be an int or a list of "
                                          f"ints, got {gen_eos!r}")
                eos_ids.add(i)

        templates = _chat_templates(path, config, config_path)
        if chat_template is not None:
            text = load_chat_template(chat_template)
            try:
                compile_chat_template(text)
            except ConfigError as e:
                raise ConfigError(f"--chat-template: {e}") from None
            templates = {"default": text}

        max_len = config.get("model_max_length")
        if not isinstance(max_len, (int, float)) or max_len >= _UNLIMITED_LENGTH:
            max_len = None
        cleanup = bool(config.get("clean_up_tokenization_spaces", False))
        if cleanup and type(backend.model).__name__ == "BPE" and not config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False):
            cleanup = False
        return cls(backend, special_tokens=named, extra_special_tokens=extras, eos_token_ids=eos_ids,
                   chat_templates=templates, model_max_length=int(max_len) if max_len else None,
                   clean_up_tokenization_spaces=cleanup, name=str(path))

    # ---- vocabulary ----------------------------------------------------------------------------
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (read-only use)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added tokens (the model's embedding may be padded larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False):
        """Token strings for ids (one id -> one string), like transformers."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def _named_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: tokenizer_config's eos plus generation_config's list."""
        return self._eos_token_ids

    @property
    def all_special_tokens(self) -> list[str]:
        """Named special tokens then extra special tokens, each once (transformers' order)."""
        return list(dict.fromkeys([*self.special_tokens.values(), *self._extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self._backend.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    # ---- text <-> ids --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens applies tokenizer.json's post-processor (BOS/EOS);
        special tokens written inside the text (e.g. from a chat template) are matched either way."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def decode_raw(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """decode() without clean_up_tokenization_spaces (the incremental detokenizer applies it
        itself as a stream)."""
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------
    def chat_template_for(self, tools: list[dict] | None = None) -> str:
        """The template transformers would pick: "tool_use" when tools are given and it exists."""
        if not self.chat_templates:
            raise CheckpointError(
                f"{Path(self.name) / 'tokenizer_config.json'}: no chat_template, and there is no "
                "chat_template.jinja next to it; pass --chat-template FILE or add chat_template.jinja "
                "to the model directory")
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise CheckpointError(f"{Path(self.name) / 'tokenizer_config.json'}: several chat templates "
                              f"({sorted(self.chat_templates)}) and none named 'default'; pass "
                              "--chat-template FILE")

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **template_kwargs: Any) -> str | list[int]:
        """Render the conversation; with tokenize=True return its ids, encoded without adding special
        tokens (the template writes BOS itself when the model wants it), as transformers does."""
        text = render_chat_template(self.chat_template_for(tools), messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self._eos_token_ids)})")


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (WordPiece-era spacing fixes), same replacement order."""
    for old, new in CLEANUP_REPLACEMENTS:
        text = text.replace(old, new)
    return text


CLEANUP_REPLACEMENTS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


# ---- loading helpers ---------------------------------------------------------------------------
# Special tokens are kept as AddedToken-style dicts {"content", "special", flags...} until they are
# registered with the backend.
def _token_spec(value: Any, source: Path, key: str) -> dict | None:
    """A special token given as a string or as an AddedToken-style dict {"content": ...}."""
    if value is None:
        return None
    if isinstance(value, str):
        return {"content": value, "special": True}   # transformers: a plain string is a special token
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return {k: v for k, v in value.items() if k in (*_ADDED_TOKEN_FLAGS, "special", "content")}
    raise CheckpointError(f"{source}: {key} must be a string or an object with a \"content\" string, "
                          f"got {value!r}")


def _spec_list(value: Any, source: Path, key: str) -> list[dict]:
    if not isinstance(value, list):
        raise CheckpointError(f"{source}: {key} must be a list of tokens, got {value!r}")
    return [_token_spec(v, source, key) for v in value if v is not None]


def _special_tokens(path: Path, config: dict) -> tuple[dict[str, dict | None], list[dict]]:
    """Named special tokens and extra special tokens, resolved as transformers 5 does.

    Named: the seven standard names, then model-specific ones (any other config key ending in
    "_token" whose value is a token, and a dict-valued extra_special_tokens). Extras: the
    extra_special_tokens (or legacy additional_special_tokens) list.
    """
    config_path = path / "tokenizer_config.json"
    config = dict(config)
    map_path = path / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and map_path.is_file():
        # Legacy layout: special_tokens_map.json overrides the config's token entries.
        stm = _read_json(map_path)
        for key, value in stm.items():
            if key == "extra_special_tokens" and isinstance(value, list):
                value = list(config.get(key) or []) + [v for v in value if v not in (config.get(key) or [])]
            config[key] = value
    extras_value = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    named = {k: _token_spec(config.get(k), config_path, k) for k in NAMED_SPECIAL_TOKENS}
    for key, value in config.items():
        is_token = isinstance(value, str) or (isinstance(value, dict) and value.get("__type") == "AddedToken")
        if key.endswith("_token") and key not in named and is_token:
            named[key] = _token_spec(value, config_path, key)
    if isinstance(extras_value, dict):
        named.update({k: _token_spec(v, config_path, k) for k, v in extras_value.items()})
        extras_value = []
    return named, _spec_list(extras_value, config_path, "extra_special_tokens")


def _added_token(spec: dict, special: bool | None = None) -> AddedToken:
    flags = {f: spec[f] for f in _ADDED_TOKEN_FLAGS if f in spec}
    is_special = bool(spec.get("special", False)) if special is None else special
    return AddedToken(spec["content"], special=is_special, **flags)


def _register_special_tokens(backend: tokenizers.Tokenizer, config: dict,
                             named: dict[str, dict | None], extras: list[dict]) -> None:
    """Re-register added tokens the way transformers' fast tokenizer __init__ does.

    The authoritative added-token list is the config's added_tokens_decoder when the config has that
    key, otherwise tokenizer.json's own list. Every token on it is added again with its flags, forced
    special when it is a named special token (so e.g. an eos that tokenizer.json left non-special is
    dropped by skip_special_tokens). Named and extra tokens absent from the backend's added tokens are
    added as special tokens (new ids when they are not in the vocabulary either). Extras that already
    exist keep their flags, as in transformers.
    """
    listed = config.get("added_tokens_decoder")
    if isinstance(listed, dict):
        decoder = []
        for idx, entry in sorted(listed.items(), key=lambda kv: int(kv[0])):
            if not (isinstance(entry, dict) and isinstance(entry.get("content"), str)):
                raise CheckpointError(f"added_tokens_decoder[{idx}] in tokenizer_config.json must be an "
                                      f"object with a \"content\" string, got {entry!r}")
            decoder.append(entry)
    else:
        decoder = [{"content": t.content, "special": t.special,
                    **{f: getattr(t, f) for f in _ADDED_TOKEN_FLAGS}}
                   for _, t in sorted(backend.get_added_tokens_decoder().items())]
    named_contents = {spec["content"] for spec in named.values() if spec is not None}
    tokens = [_added_token(e, special=True if e["content"] in named_contents else None) for e in decoder]
    existing = {t.content for t in backend.get_added_tokens_decoder().values()} | {e["content"] for e in decoder}
    for spec in named.values():
        if spec is not None and spec["content"] not in existing:
            tokens.append(_added_token(spec, special=True))
            existing.add(spec["content"])
    for spec in extras:
        if spec["content"] not in existing:
            tokens.append(_added_token(spec))   # extras keep their own special flag
            existing.add(spec["content"])
    if tokens:
        backend.add_tokens(tokens)


def _check_bos_eos_flags(backend: tokenizers.Tokenizer, config: dict, named: dict[str, str | None],
                         config_path: Path) -> None:
    """Warn when add_bos_token/add_eos_token disagree with what tokenizer.json's post-processor does
    (transformers follows the post-processor, and so do we)."""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    with_special = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    for key, tok, at_start in (("add_bos_token", named.get("bos_token"), True),
                               ("add_eos_token", named.get("eos_token"), False)):
        if key not in config or tok is None:
            continue
        tid = backend.token_to_id(tok)
        ends = with_special[: len(with_special) - len(plain)] if at_start else with_special[len(plain):]
        does = tid is not None and tid in ends
        if bool(config[key]) != does:
            logger.warning("%s: %s is %s but tokenizer.json's post-processor %s %s; following "
                           "tokenizer.json (as transformers does)", config_path, key, config[key],
                           "adds" if does else "does not add", tok)


def _chat_templates(path: Path, config: dict, config_path: Path) -> dict[str, str]:
    """Named templates: chat_template.jinja (+ additional_chat_templates/*.jinja) win over the config."""
    from_files: dict[str, str] = {}
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        from_files["default"] = _read_text(jinja)
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            from_files[f.stem] = _read_text(f)
    if from_files:
        templates = from_files
        where = jinja if jinja.is_file() else extra_dir
    else:
        where = config_path
        value = config.get("chat_template")
        if value is None:
            templates = {}
        elif isinstance(value, str):
            templates = {"default": value}
        elif isinstance(value, list) and all(
                isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                for t in value):
            templates = {t["name"]: t["template"] for t in value}
        else:
            raise CheckpointError(f"{config_path}: chat_template must be a string or a list of "
                                  "{\"name\", \"template\"} objects")
    for name, template in templates.items():
        try:
            compile_chat_template(template)
        except ConfigError as e:
            raise CheckpointError(f"{where}: chat template {name!r}: {e}") from None
    return templates


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
