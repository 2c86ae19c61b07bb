"""A request's checks before it queues: its prompt as token ids, its sampling parameters,
and room for it in the context and in one step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..sampling_params import SamplingParams, as_token_id

if TYPE_CHECKING:
    from ..config import EngineConfig


def encode_text(tokenizer: Any, prompt: str) -> list[int]:
    """A text prompt's token ids, as the engine tokenizes it (also used by the server,
    which tokenizes before handing a request to the engine)."""
    ids = tokenizer.encode(prompt)
    bos = tokenizer.bos_token_id
    if len(ids) >= 2 and bos is not None and ids[0] == ids[1] == bos:
        ids = ids[1:]  # the text (a chat template) already starts with BOS
    if not ids:
        raise ValueError(f"prompt: {prompt[:80]!r} tokenizes to nothing")
    return ids


def prompt_token_ids(prompt: str | list[int], tokenizer: Any, vocab_size: int) -> list[int]:
    """A prompt (text, or token ids as a list, a numpy array or a tensor) as token ids
    inside the vocabulary; bad input raises ValueError / TypeError."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: empty string")
        if tokenizer is None:
            raise ValueError("prompt: a text prompt needs a tokenizer; this model has none")
        return encode_text(tokenizer, prompt)
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):
        prompt = prompt.tolist()  # a numpy array or a torch tensor of token ids
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(
            f"prompt: expected str or list of token ids, got {type(prompt).__name__}"
        )
    if not prompt:
        raise ValueError("prompt: empty token list")
    if set(map(type, prompt)) == {int}:  # plain ints (no bools): checked at C speed
        ids = list(prompt)
    else:
        ids = [as_token_id(t, "prompt") for t in prompt]
    if min(ids) < 0 or max(ids) >= vocab_size:
        t = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt: token id {t!r} is outside the vocabulary [0, {vocab_size})")
    return ids


def checked_params(sampling_params: SamplingParams | None) -> SamplingParams:
    """The request's sampling parameters (the defaults when None), validated."""
    params = sampling_params if sampling_params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"sampling_params: expected SamplingParams, got {type(params).__name__}"
        )
    params.validate()
    return params


def max_len_for(num_prompt_tokens: int, params: SamplingParams, config: EngineConfig) -> int:
    """The request's context limit, once checked that the prompt leaves room for a token
    and, without chunked prefill, that the whole request fits one step."""
    max_len = config.max_len
    if params.max_model_length is not None:
        max_len = min(max_len, params.max_model_length)
    if num_prompt_tokens >= max_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens but max_model_length is {max_len}: "
            f"the prompt must leave room for at least one new token"
        )
    if not config.enable_chunked_prefill:
        longest = min(max_len, num_prompt_tokens + params.max_tokens)
        if longest > config.max_num_batched_tokens:
            raise ValueError(
                f"with enable_chunked_prefill=False a request must fit one step: "
                f"{longest} tokens > max_num_batched_tokens="
                f"{config.max_num_batched_tokens}"
            )
    return max_len
