"""A checkpoint's tokenizer without transformers: the `tokenizers` library on tokenizer.json,
and the chat template rendered with jinja2 as transformers renders it.

Importing transformers' tokenizer classes takes seconds of a start (their import chain pulls
much of the library); this module imports `tokenizers` and, at the first chat prompt, jinja2.
`FastTokenizer` gives what the engine, the server and the apps call on a tokenizer (encode,
decode, special tokens, vocabulary, `apply_chat_template` to text or ids), with transformers'
results for the folders it accepts (`unsupported_reason`). Anything else, an attribute not
defined here or an argument not covered (padding, tensors, callable tools...), is answered by
transformers' own tokenizer for the same folder, loaded at its first use.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

# tokenizer_config.json's names for transformers' generic tokenizer over tokenizer.json; the
# model-specific classes may rebuild or adjust the tokenizer, so they go to transformers.
GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# transformers' named special tokens, in its order (the chat template sees them by name).
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
# tokenizer_config.json keys that change what transformers does with tokenizer.json.
_UNSUPPORTED_KEYS = ("split_special_tokens", "fix_mistral_regex", "auto_map")
# Model types whose tokenizer transformers patches on load (a pre-tokenizer regex).
_PATCHED_MODEL_TYPES = ("mistral", "ministral", "voxtral", "pixtral")
# transformers' apply_chat_template arguments not handled here: a call with one goes to
# transformers (any other keyword argument is a template variable, passed through).
_DELEGATED_ARGS = frozenset({
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
# Names under which a message's reasoning may come; templates read `reasoning_content`,
# some (gpt-oss) `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Unsupported(Exception):
    """A folder whose tokenizer transformers sets up in a way `FastTokenizer` does not."""


def unsupported_reason(folder: str | os.PathLike[str]) -> str | None:
    """Why `FastTokenizer` cannot stand in for transformers' tokenizer of `folder`, or None
    where it can (tokenizer.json with the generic class and no option that changes it)."""
    try:
        FastTokenizer(folder)
    except Unsupported as e:
        return str(e)
    return None


def load_fast_tokenizer(folder: str | os.PathLike[str]) -> FastTokenizer | None:
    """`FastTokenizer` over `folder`, or None where it cannot stand in for transformers."""
    try:
        return FastTokenizer(folder)
    except Unsupported:
        return None


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's fast tokenizer (never remote code).

    Where tokenizer.json is there with transformers' generic class, `FastTokenizer` reads
    it with the `tokenizers` library and renders the chat template with jinja2, as
    transformers does, without importing transformers (seconds of a start). Elsewhere
    transformers' own class: the generic one directly where tokenizer_config.json names it
    (AutoTokenizer would resolve the same class after importing transformers' model
    configurations), else AutoTokenizer.
    """
    fast = load_fast_tokenizer(path)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    config_file = Path(path) / "tokenizer_config.json"
    try:
        tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        tokenizer_class = None
    if tokenizer_class in GENERIC_CLASSES and (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), trust_remote_code=False)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer in {path} is not a fast (Rust) tokenizer; minivllm needs tokenizer.json"
        )
    return tokenizer


def _tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json, checked for what `FastTokenizer` does as transformers does."""
    if not (folder / "tokenizer.json").is_file():
        raise Unsupported("no tokenizer.json")
    try:
        config = _read_json(folder / "tokenizer_config.json")
    except (OSError, ValueError) as e:
        raise Unsupported(f"no readable tokenizer_config.json ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise Unsupported("tokenizer_config.json is not an object")
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        raise Unsupported(f"tokenizer_class {config.get('tokenizer_class')!r} is model-specific")
    for key in _UNSUPPORTED_KEYS:
        if config.get(key):
            raise Unsupported(f"tokenizer_config.json sets {key}")
    if isinstance(config.get("extra_special_tokens"), dict):
        raise Unsupported("tokenizer_config.json names extra special tokens")
    try:
        model_type = str(_read_json(folder / "config.json").get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        model_type = ""
    if model_type.startswith(_PATCHED_MODEL_TYPES):
        raise Unsupported(f"transformers adjusts {model_type} tokenizers on load")
    return config


def _check_added_tokens(backend: Any, config: dict) -> None:
    """Added tokens that tokenizer_config.json lists and tokenizer.json lacks (or lists
    otherwise) are added by transformers on load: not here."""
    have = backend.get_added_tokens_decoder()
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        ours = have.get(int(index))
        if ours is None or any(
            getattr(ours, k, None) != v for k, v in token.items() if k != "__type"
        ):
            raise Unsupported(f"added token {index} differs from tokenizer.json's")


def _added_token(value: Any) -> Any:
    """A special token from tokenizer_config.json (a string or a serialised AddedToken) as
    transformers adds it: special, and not normalised unless the config says so."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        fields = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized")
                  if k in value}
        return AddedToken(str(value["content"]), special=True, **fields)
    return AddedToken(str(value), special=True, normalized=False)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value["content"])
    return None if value is None else str(value)


def _extra_special_tokens(config: dict) -> list[Any]:
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    return list(extra.values()) if isinstance(extra, dict) else list(extra)


class FastTokenizer:
    """A checkpoint folder's tokenizer.json and chat template (see the module's docstring)."""

    is_fast = True

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        """Raises `Unsupported` where transformers would set the tokenizer up otherwise."""
        from tokenizers import Tokenizer

        self.name_or_path = str(folder)
        config = _tokenizer_config(Path(folder))
        backend = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        _check_added_tokens(backend, config)
        # transformers encodes without the file's truncation or padding unless asked for.
        backend.no_truncation()
        backend.no_padding()
        self._named = {n: config.get(n) for n in SPECIAL_TOKEN_NAMES if config.get(n) is not None}
        extra = _extra_special_tokens(config)
        # Every special token is an added, special token of the backend, as transformers
        # makes it (a no-op for those tokenizer.json lists already).
        backend.add_special_tokens([_added_token(v) for v in [*self._named.values(), *extra]])
        self._backend = backend
        self._extra = [t for t in (_token_text(v) for v in extra) if t is not None]
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_bpe = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        )
        self.chat_template = _chat_template(Path(folder), config)
        self._fallback: Any = None

    # -- special tokens --------------------------------------------------------------------

    def _special(self, name: str) -> str | None:
        return _token_text(self._named.get(name))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    bos_token = property(lambda self: self._special("bos_token"))
    eos_token = property(lambda self: self._special("eos_token"))
    unk_token = property(lambda self: self._special("unk_token"))
    pad_token = property(lambda self: self._special("pad_token"))
    bos_token_id = property(lambda self: self._id(self.bos_token))
    eos_token_id = property(lambda self: self._id(self.eos_token))
    unk_token_id = property(lambda self: self._id(self.unk_token))
    pad_token_id = property(lambda self: self._id(self.pad_token))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens as strings (what the chat template sees by name)."""
        return {n: _token_text(self._named[n]) for n in SPECIAL_TOKEN_NAMES if n in self._named}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._id(t) for t in self.all_special_tokens) if i is not None]

    # -- text <-> ids ------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Any:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """`text`'s token ids (with the post-processor's BOS / EOS unless told not to)."""
        if kwargs:
            return self._transformers().encode(text, add_special_tokens=add_special_tokens,
                                               **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        """The text of `token_ids`. The clean-up of spaces before punctuation, where asked
        for (or set in tokenizer_config.json), is skipped for a BPE model as transformers 5
        skips it (it removes real spaces there)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        ids = [int(i) for i in token_ids]  # numpy or tensor elements too
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        if clean_up_tokenization_spaces and (
            type(self._backend.model).__name__ != "BPE" or self._clean_up_bpe
        ):
            text = clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences: list[list[int]], **kwargs: Any) -> list[str]:
        return [self.decode(ids, **kwargs) for ids in sequences]

    def convert_ids_to_tokens(
        self, ids: int | list[int], skip_special_tokens: bool = False
    ) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        unk = self.unk_token_id
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return unk if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    # -- the chat template ---------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template text: `chat_template` (a template, or the name of one of the model's
        templates), else the model's (its "tool_use" one when tools are given)."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" not in templates:
                    raise ValueError(
                        "This model has multiple chat templates with no default specified: pass "
                        f"chat_template, a template or one of {sorted(templates)}"
                    )
                return templates["default"]
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError(
                "Cannot use chat template functions because tokenizer.chat_template is not set "
                "and no template argument was passed"
            )
        return templates

    def apply_chat_template(
        self,
        conversation: Any,
        tools: list[Any] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """transformers' `apply_chat_template` for text, or for ids with `return_dict=False`;
        other uses (a dict of tensors, continuing the last message, tools given as Python
        functions, control-token sanitising) are transformers' own."""
        delegate = (
            (tokenize and return_dict)
            or continue_final_message
            or any(k in _DELEGATED_ARGS for k in kwargs)
            or any(not isinstance(t, dict) for t in tools or ())
        )
        if delegate:
            return self._transformers().apply_chat_template(
                conversation, tools=tools, documents=documents,
                chat_template=self.get_chat_template(chat_template, tools),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=tokenize,
                return_dict=return_dict, **kwargs,
            )  # fmt: skip
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation")
        batched = isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
        )
        conversations = conversation if batched else [conversation]
        for document in documents or ():
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        variables = _plain({**self.special_tokens_map, **kwargs})
        compiled = compile_chat_template(template)
        rendered = [
            compiled.render(
                messages=_messages(chat), tools=_plain(tools), documents=_plain(documents),
                add_generation_prompt=add_generation_prompt, **variables,
            )
            for chat in conversations
        ]  # fmt: skip
        if tokenize:
            rendered = [self.encode(text, add_special_tokens=False) for text in rendered]
        return rendered if batched else rendered[0]

    # -- everything else: transformers ---------------------------------------------------------

    def as_transformers(self) -> Any:
        """transformers' tokenizer for the same folder (for libraries that read one, such
        as the grammar compiler), loaded once at first need."""
        return self._transformers()

    def _transformers(self) -> Any:
        """transformers' tokenizer for the same folder, loaded once at first need."""
        if self._fallback is None:
            from transformers import PreTrainedTokenizerFast

            self._fallback = PreTrainedTokenizerFast.from_pretrained(
                self.name_or_path, trust_remote_code=False
            )
        return self._fallback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' batch encoding (dicts of ids and masks, tensors, padding)."""
        return self._transformers()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only attributes not found on the class or instance land here; private names
        # (pickle's probes among them) are not forwarded.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._transformers(), name)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fallback": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab={len(self)})"


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up: no space before punctuation and English contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                           (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                           (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def _chat_template(folder: Path, config: dict) -> str | dict[str, str] | None:
    """The folder's chat template(s): chat_template.jinja (with any named templates under
    additional_chat_templates/), else tokenizer_config.json's `chat_template` (a string, or
    a list of {"name", "template"})."""
    named: dict[str, str] = {}
    extra = folder / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            named[file.stem] = file.read_text(encoding="utf-8")
    main = folder / CHAT_TEMPLATE_FILE
    template: Any = main.read_text(encoding="utf-8") if main.is_file() else None
    if template is None:
        template = config.get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict):
        return {**template, **named}
    if named:
        return {"default": template, **named} if template is not None else named
    return template


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, as transformers gives the template its inputs
    (the sandbox cannot vet the methods of other objects); other objects become a
    placeholder naming their type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, bool, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    item = getattr(value, "item", None)  # a numpy scalar
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    return f"<{type(value).__name__}>"


def _messages(conversation: Any) -> list[dict[str, Any]]:
    """A conversation as the template sees it: dicts, keys whose value is None dropped,
    a message's reasoning under each name templates read."""
    messages = []
    for message in _plain(getattr(conversation, "messages", conversation)):
        if not isinstance(message, dict):
            raise TypeError(
                f"Chat messages should be dicts, dataclasses or pydantic models, but got "
                f"{message!r}."
            )
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> Any:
    """`template` compiled in transformers' environment for chat templates: sandboxed and
    immutable, blocks trimmed, loop controls, `raise_exception`, `strftime_now`, a `tojson`
    that keeps non-ASCII and HTML characters, `{% generation %}` blocks rendered as their
    body, and `dict` / `namespace` that refuse private names."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks an assistant's text (for a token
        mask, which is transformers' to build): here it renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` only: no attribute of the real type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(template)
