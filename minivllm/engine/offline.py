"""The offline batch API behind `LLMEngine.generate` and `LLMEngine.chat`: prompts in,
every reply run to completion on the caller's thread, results back in order."""

from __future__ import annotations

from collections.abc import Sequence as SeqLike
from typing import TYPE_CHECKING, Any

from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from .llm_engine import LLMEngine
    from .sequence import Sequence


def generate(
    engine: LLMEngine,
    prompts: SeqLike[str] | SeqLike[list[int]],
    sampling_params: SamplingParams | SeqLike[SamplingParams] | None,
    use_tqdm: bool,
) -> dict[str, list]:
    """`LLMEngine.generate`: queue the prompts, step until each has ended, report them."""
    if isinstance(prompts, str) or (len(prompts) and _is_index(prompts[0])):
        raise TypeError("prompts: expected a list of prompts (strings or token-id lists)")
    if isinstance(sampling_params, SamplingParams) or sampling_params is None:
        params = [sampling_params] * len(prompts)
    else:
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
    seqs = _add_collected(engine, prompts, params)
    _run_to_end(engine, seqs, use_tqdm)
    return _results(engine, seqs)


def _add_collected(engine: LLMEngine, prompts: SeqLike[Any],
                   params: list[SamplingParams | None]) -> list[Sequence]:
    """Queue every prompt, marked as read here rather than by `pop_deltas`; all or none
    (a bad prompt withdraws those queued before it)."""
    ids: list[int] = []
    with engine._lock:  # nobody aborts (and forgets) a sequence before we hold it
        try:
            for prompt, p in zip(prompts, params, strict=False):
                ids.append(engine.add_prompt(prompt, p))
                engine._collecting.add(ids[-1])
        except Exception:
            for seq_id in ids:
                engine.abort(seq_id)
                engine._collecting.discard(seq_id)
                engine._forget(seq_id)
            raise
        # The Sequence objects themselves: a request aborted by another thread ends
        # without ever being reported by step(), and must end the stepping all the same.
        return [engine._seqs[i] for i in ids]


def _run_to_end(engine: LLMEngine, seqs: list[Sequence], use_tqdm: bool) -> None:
    """Step until every sequence has ended; an exception (Ctrl-C too) aborts them all."""
    ids = [seq.seq_id for seq in seqs]
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="generating", unit="req")
    try:
        while not all(seq.is_finished for seq in seqs):
            engine.step()
            if bar is not None:
                bar.update(sum(seq.is_finished for seq in seqs) - bar.n)
    except BaseException:
        for seq_id in ids:
            engine.abort(seq_id)
        for seq_id in ids:
            engine._forget(seq_id)
        raise
    finally:
        if bar is not None:
            bar.close()
        engine._collecting -= set(ids)


def _results(engine: LLMEngine, seqs: list[Sequence]) -> dict[str, list]:
    """The ended sequences as `generate` returns them (then forgotten); the first failed
    sequence's error is raised instead."""
    texts = [engine.output_processor.final_text(seq) for seq in seqs]
    errors = []
    for seq in seqs:
        engine._forget(seq.seq_id)
        if seq.error:
            errors.append(f"sequence {seq.seq_id} failed: {seq.error}")
    if errors:
        raise RuntimeError(errors[0])
    result: dict[str, list] = {
        "text": texts,
        "token_ids": [seq.completion_token_ids for seq in seqs],
        "finish_reason": [seq.finish_reason for seq in seqs],
    }
    if any(seq.logprobs is not None for seq in seqs):
        result["logprobs"] = [seq.logprobs for seq in seqs]
    if any(seq.prompt_logprobs is not None for seq in seqs):
        result["prompt_logprobs"] = [seq.prompt_logprobs for seq in seqs]
    return result


def chat_prompts(
    tokenizer: Any,
    messages: SeqLike[dict[str, Any]] | SeqLike[SeqLike[dict[str, Any]]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    enable_thinking: bool | None,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> list[str]:
    """`LLMEngine.chat`'s prompts: each conversation through the chat template."""
    if tokenizer is None:
        raise ValueError("chat(): this model has no tokenizer, so no chat template")
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        conversations = [messages]
    elif isinstance(messages, (list, tuple)) and messages:
        conversations = list(messages)
    else:
        raise TypeError(
            "messages: expected a conversation (a non-empty list of {'role', 'content'} "
            f"dicts) or a list of them, got {messages!r:.80}"
        )
    kwargs = dict(chat_template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    prompts = []
    for n, conversation in enumerate(conversations):
        _check_conversation(n, conversation)
        prompts.append(
            tokenizer.apply_chat_template(
                list(conversation),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **kwargs,
            )
        )
    return prompts


def _is_index(x: Any) -> bool:
    """An int or an integral numpy/torch scalar (a token id, not a prompt)."""
    return hasattr(x, "__index__") and getattr(x, "ndim", 0) == 0


def _check_conversation(n: int, conversation: Any) -> None:
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise TypeError(f"messages[{n}]: expected a non-empty list of messages")
    for k, m in enumerate(conversation):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(
                f"messages[{n}][{k}]={m!r:.80}: a message is a dict with a 'role' string "
                "and a 'content'"
            )
