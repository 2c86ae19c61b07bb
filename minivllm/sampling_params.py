"""Per-request sampling and stopping settings."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def _fail(name: str, value: object, why: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r}: {why}")


def as_token_id(value: Any, what: str) -> int:
    """`value` as a Python int: ints and integral numpy/torch scalars pass, bools and
    floats do not (a float token id is a bug upstream, not something to round)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise ValueError(f"{what}: token id {value!r} is a bool, not an int")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(
            f"{what}: token id {value!r} ({type(value).__name__}) is not an int"
        ) from None


def _is_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, int)


@dataclass
class StructuredOutputsParams:
    """A constraint on the completion's text (vLLM's spelling): exactly one of `json` (a
    JSON schema, as a dict or its JSON text), `regex`, `choice` (the text is one of these
    strings), `grammar` (an EBNF grammar, GBNF style, whose start rule is `root`) or
    `json_object=True` (any JSON object). Each token sampled keeps the text a prefix of
    something the constraint accepts, and the end of sequence comes only where it ends."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if not isinstance(self.json_object, bool):
            _so_fail("json_object", self.json_object, "must be True or False")
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams: give exactly one of json, regex, choice, grammar "
                f"and json_object=True (got {', '.join(given) or 'none'})"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            _so_fail("json", self.json, "must be a JSON schema: a dict or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _so_fail(name, value, "must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Iterable):
                _so_fail("choice", self.choice, "must be a list of strings")
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                _so_fail("choice", self.choice, "must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar")
                    if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached by: the kind and its canonical text."""
        import json

        value = getattr(self, self.kind)
        if self.kind == "json_object":
            return ("json_object", "")
        if isinstance(value, str):
            return (self.kind, value)
        return (self.kind, json.dumps(value, sort_keys=True, ensure_ascii=False))


def _so_fail(name: str, value: object, why: str) -> None:
    raise ValueError(f"structured_outputs.{name}={value!r:.200}: {why}")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature=0` is greedy. `top_k=-1` (or 0) and `top_p=1` disable those filters.
    `stop` strings are matched on the decoded text, across token boundaries; the text
    returned ends before the stop string. `max_model_length` caps prompt + completion
    for this request (the engine's own limit applies too).

    Penalties change the logits before temperature: `repetition_penalty` as in
    transformers (every token already in the prompt or the completion: a positive
    logit is divided by it, a negative one multiplied), `presence_penalty` and
    `frequency_penalty` as in OpenAI's API (subtracted once per distinct completion
    token, and once per occurrence). `min_tokens` masks the eos and stop ids (and
    ignores stop strings) until that many tokens were generated.

    `logprobs=N` returns, for each generated token, its log-probability and the N most
    likely tokens' (from the distribution after penalties and temperature, before
    top-k/top-p/min-p; greedy reads temperature 1). `prompt_logprobs=N` does the same
    for each prompt token after the first, from the model's own distribution.

    `structured_outputs` constrains the text (a JSON schema, a regex, a choice, a
    grammar): the request waits until its grammar is compiled (off the engine's step,
    cached), then each step masks the tokens the grammar does not allow.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    max_model_length: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # The constructor reads None as "none"; after construction None is an error.
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.validate()

    def validate(self) -> None:
        """Check every field (also after fields were changed) and normalise `stop` and
        `stop_token_ids` to lists, as the constructor does."""
        t = self.temperature
        if not _is_number(t) or t < 0:
            _fail("temperature", t, "must be a finite number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", self.top_k, "must be an int >= 1, or -1/0 to disable")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be a number in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "must be a number in [0, 1]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be an int >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            why = f"must be an int in [0, max_tokens={self.max_tokens}]"
            _fail("min_tokens", self.min_tokens, why)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "must be True or False")
        self.stop = self._stop_strings(self.stop)
        self.stop_token_ids = self._stop_ids(self.stop_token_ids)
        seed = self.seed
        if seed is not None and (not _is_int(seed) or seed < 0):
            _fail("seed", seed, "must be an int >= 0 or None")
        ml = self.max_model_length
        if ml is not None and (not _is_int(ml) or ml < 1):
            _fail("max_model_length", ml, "must be an int >= 1 or None")
        rp = self.repetition_penalty
        if not _is_number(rp) or rp <= 0:
            _fail("repetition_penalty", rp, "must be a finite number > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                _fail(name, value, "must be a number in [-2, 2] (0 disables it)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                _fail(name, value, "must be an int >= 0 (how many top tokens) or None")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            _fail("structured_outputs", so, "must be a StructuredOutputsParams or None")

    @staticmethod
    def _stop_strings(stop: Any) -> list[str]:
        if isinstance(stop, str):
            stop = [stop]
        elif stop is None or not isinstance(stop, Iterable):
            _fail("stop", stop, "must be a string or a list of strings")
        stop = list(stop)
        for s in stop:
            if not isinstance(s, str) or s == "":
                _fail("stop", stop, "stop strings must be non-empty strings")
        return stop

    @staticmethod
    def _stop_ids(ids: Any) -> list[int]:
        if ids is None or isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            _fail("stop_token_ids", ids, "must be a list of token ids (ints)")
        out = []
        for tid in ids:
            try:
                value = as_token_id(tid, "SamplingParams.stop_token_ids")
            except ValueError as e:
                raise ValueError(f"{e} (stop_token_ids={ids!r})") from None
            if value < 0:
                _fail("stop_token_ids", ids, "token ids must be >= 0")
            out.append(value)
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_extras(self) -> bool:
        """Whether the sampler needs more than temperature and the top-k/p/min-p cuts."""
        return (
            self.has_penalties
            or self.min_tokens > 0
            or self.logprobs is not None
            or self.prompt_logprobs is not None
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )
