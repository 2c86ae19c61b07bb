"""Structured outputs: the engine masks each constrained row with its grammar (JSON
schema, regex, choice, EBNF), compiled off the step; the server maps `response_format`,
vLLM's `structured_outputs` and the older `guided_*` fields onto it. SmolLM2 on the CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch
from conftest import serving

from minivllm import SamplingParams, StructuredOutputsParams
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.structured_outputs import GrammarCompiler
from minivllm.layers.sampler import apply_token_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PERSON = "Describe a fictional person as JSON with a name, an age, a color and tags."


# -- parameters, scheduler and mask: no model ---------------------------------------------


@pytest.mark.parametrize("kwargs, error", [
    ({}, "exactly one"),
    ({"regex": "a+", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "yes"}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"json": 3}, "structured_outputs.json"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
])
def test_structured_outputs_params_are_checked(kwargs, error):
    with pytest.raises(ValueError, match=error):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_only_structured_outputs_params():
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a+"})


def test_the_cache_key_is_the_same_for_the_same_schema_in_any_key_order():
    a = StructuredOutputsParams(json={"type": "object", "required": ["a"]})
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert a.key == b.key and a.kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_the_scheduler_passes_over_a_request_whose_grammar_compiles():
    sched = Scheduler(BlockManager(16, 4, True), 4, 64)
    first = Sequence(0, [1, 2, 3], SamplingParams(), 64)
    first.awaiting_grammar = True
    second = Sequence(1, [4, 5, 6], SamplingParams(), 64)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert [item.seq for item in out.scheduled] == [second]
    assert list(sched.waiting) == [first]
    first.awaiting_grammar = False
    sched.update_from_output(out, [7])
    assert [item.seq for item in sched.schedule().scheduled] == [second, first]


def test_a_constrained_request_whose_token_is_in_flight_sits_out_while_others_run():
    """Overlapped scheduling: a sequence under a grammar whose newest token is still being
    sampled waits a step (its mask needs that token) unless nothing else would run."""
    sched = Scheduler(BlockManager(16, 4, True), 4, 64)
    under = Sequence(0, [1, 2, 3], SamplingParams(), 64)
    under.grammar = object()  # a matcher; the scheduler only asks whether there is one
    plain = Sequence(1, [4, 5, 6], SamplingParams(), 64)
    sched.add(under)
    sched.add(plain)
    prefill = sched.schedule()  # both sample their first token: both now in flight
    assert [item.seq for item in prefill.scheduled] == [under, plain]
    second = sched.schedule()
    assert [item.seq for item in second.scheduled] == [plain]
    sched.update_from_output(prefill, [7, 8])  # the first tokens are read
    third = sched.schedule()  # `under`'s token is known now; `plain`'s is in flight
    assert [item.seq for item in third.scheduled] == [under, plain]
    assert third.scheduled[0].fill_from is None and third.scheduled[1].fill_from == 0
    sched.update_from_output(second, [9])
    sched.finish(plain, "stop")
    alone = sched.schedule()  # nothing else runs: it goes with its token in flight
    assert [(item.seq, item.fill_from) for item in alone.scheduled] == [(under, 0)]


def test_constrained_requests_take_the_same_steps():
    """While a step that samples under a mask is in flight, every request under a grammar
    waits, its token known or not, and a new one is not admitted: they all run in the
    steps between, and the plain rows' other steps sample without a mask."""
    sched = Scheduler(BlockManager(32, 4, True), 8, 64)
    first, second = (Sequence(i, [1, 2, 3], SamplingParams(), 64) for i in (0, 1))
    plain = Sequence(2, [4, 5, 6], SamplingParams(), 64)
    for seq in (first, second, plain):
        seq.grammar = object() if seq is not plain else None
    sched.add(first)
    sched.add(plain)
    prefill = sched.schedule()
    sched.add(second)
    # `first` samples under its mask in the step in flight: `second`, ready to start,
    # waits for the next step, and so would `first` were its token known.
    behind = sched.schedule(masked_in_flight=True)
    assert [item.seq for item in behind.scheduled] == [plain]
    sched.update_from_output(prefill, [7, 8])
    together = sched.schedule()
    assert [item.seq for item in together.scheduled] == [first, plain, second]


def test_a_constrained_request_held_for_its_turn_starts_when_nothing_else_runs():
    """A constrained request arriving while another decodes alone is not held back for a
    turn that never comes: with nothing else to run, both go."""
    sched = Scheduler(BlockManager(32, 4, True), 8, 64)
    first, second = (Sequence(i, [1, 2, 3], SamplingParams(), 64) for i in (0, 1))
    first.grammar = second.grammar = object()
    sched.add(first)
    sched.schedule()  # its prefill samples its first token under its mask
    sched.add(second)
    both = sched.schedule(masked_in_flight=True)
    assert [(item.seq, item.fill_from) for item in both.scheduled] == [(first, 0),
                                                                       (second, None)]


def test_the_bitmask_masks_only_the_rows_it_constrains():
    vocab = 70
    logits = torch.randn(3, vocab)
    before = logits.clone()
    bitmask = torch.full((3, 3), -1, dtype=torch.int32)  # all allowed
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 5  # row 1: token 5 only
    bitmask[1, 2] = 1 << 1  # ... and token 65
    apply_token_bitmask(logits, bitmask, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [5, 65]


# -- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm2_path):
    """SmolLM2 with overlapped scheduling on, as on a GPU: a constrained step must still
    read its token before the next mask."""
    from minivllm import LLMEngine

    llm = LLMEngine({"model_name_or_path": str(smollm2_path), "device": "cpu",
                     "dtype": "float32", "max_model_length": 1024, "block_size": 16,
                     "async_scheduling": True})
    yield llm
    llm.exit()


def constrained(max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          structured_outputs=StructuredOutputsParams(**kwargs))


def test_engine_json_schema_regex_and_choice_hold_beside_an_unconstrained_request(engine):
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = engine.generate(["The capital of France is"], plain)["text"][0]
    prompts = [PERSON] * 4 + ["Is water wet? Answer yes or no.", "A product code:",
                              "The capital of France is"]
    params = [constrained(90, 0.8, seed=i, json=SCHEMA) for i in range(4)]
    params += [constrained(8, choice=["yes", "no", "maybe"]),
               constrained(16, regex=r"[A-Z]{3}-\d{4}"), plain]
    out = engine.generate(prompts, params)
    for text in out["text"][:4]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert out["finish_reason"][:4] == ["stop"] * 4  # the end came where the grammar ended
    assert out["text"][4] in ("yes", "no", "maybe")
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", out["text"][5])
    assert out["text"][6] == alone


def test_engine_constrained_steps_overlap_the_read_of_the_step_before(engine, monkeypatch):
    """With overlapped scheduling, a step with constrained rows launches its forward
    before the previous step's tokens are read; only its sampling waits for the mask."""
    runner, events = engine.runner, []
    for name in ("forward", "sample", "collect"):
        real = getattr(runner, name)

        def spy(*args, _real=real, _name=name):
            events.append(_name)
            return _real(*args)

        monkeypatch.setattr(runner, name, spy)
    out = engine.generate(["Is water wet? Answer yes or no.", "The capital of France is"],
                          [constrained(12, regex=r"(yes|no), because [a-z ]{4,20}\."),
                           SamplingParams(temperature=0, max_tokens=12)])
    assert re.fullmatch(r"(yes|no), because [a-z ]{4,20}\.", out["text"][0])
    # forward (N), collect (N-1), sample (N): decode after decode, the read came between.
    steps = "".join(e[0] for e in events)
    assert "fcs" in steps, steps


def test_engine_plain_rows_decode_every_step_beside_constrained_ones(engine, monkeypatch):
    """While an unconstrained request runs, a constrained one decodes every other step,
    its mask filled from its step's launch, so no step's sampling waits for a matcher to
    take the step before's token; both replies are those of each request alone."""
    prompts = ["A product code:", "The capital of France is"]
    params = [constrained(24, regex=r"[A-Z]{3}-\d{4}, lot [0-9]{6}"),
              SamplingParams(temperature=0, max_tokens=16)]
    alone = [engine.generate([p], [sp])["text"][0] for p, sp in zip(prompts, params,
                                                                       strict=True)]
    steps, late = [], []
    launch, fill = engine._launch, engine._grammars.fill_bitmask

    def launch_spy(out):
        steps.append(len(out.scheduled))
        return launch(out)

    def fill_spy(out, rows):
        if len(engine.scheduler.running) == 2 and engine._in_flight is not None and any(
                out.scheduled[i].fill_from is not None for i in rows):
            late.append(len(steps))  # a mask that waited for the step before's token
        return fill(out, rows)

    monkeypatch.setattr(engine, "_launch", launch_spy)
    monkeypatch.setattr(engine._grammars, "fill_bitmask", fill_spy)
    out = engine.generate(prompts, params)["text"]
    assert out == alone
    assert re.fullmatch(r"[A-Z]{3}-\d{4}, lot [0-9]{6}", out[0])
    decode = steps[1:]  # after the prefill of both
    assert decode[:8] == [1, 2] * 4, steps
    assert not late, (late, steps)


def test_engine_constrained_requests_that_came_apart_decode_in_the_same_steps(engine,
                                                                             monkeypatch):
    """A constrained request that arrives while another decodes beside a plain one joins
    the other's steps: every step then holds both or neither."""
    regex = r"[A-Z]{3}-\d{4}, lot [0-9]{6}, bin [0-9]{4}"
    steps = []
    launch = engine._launch

    def launch_spy(out):
        steps.append({item.seq.seq_id for item in out.scheduled if item.seq.grammar})
        return launch(out)

    monkeypatch.setattr(engine, "_launch", launch_spy)
    first = engine.add_prompt("A product code:", constrained(40, regex=regex))
    engine.add_prompt("The capital of France is", SamplingParams(temperature=0, max_tokens=40,
                                                                  ignore_eos=True))
    while sum(first in ids for ids in steps) < 3:  # its grammar compiled; it decodes
        engine.step()
    second = engine.add_prompt("Another product code:", constrained(40, regex=regex))
    while not engine.scheduler.is_finished():
        engine.step()
    # From its first decode step to the other's last step.
    start = [i for i, ids in enumerate(steps) if second in ids][1]
    end = max(i for i, ids in enumerate(steps) if first in ids)
    assert end - start >= 8, steps
    for i in range(start, end + 1):
        assert steps[i] in (set(), {first, second}), (i, steps)


def test_engine_a_grammar_that_ended_ends_its_request_even_with_ignore_eos(engine):
    """The grammar's end token ends the request ("stop"): with `ignore_eos` it would
    otherwise go on, and its matcher, already ended, cannot fill another mask."""
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = engine.generate(["The capital of France is"], plain)["text"][0]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
              for _ in range(2)] + [plain]
    out = engine.generate(["Is water wet? Answer yes or no.", "Is fire cold?",
                           "The capital of France is"], params)
    assert all(text in ("yes", "no") for text in out["text"][:2]), out["text"]
    assert out["finish_reason"] == ["stop", "stop", "length"]
    assert out["text"][2] == alone


def test_engine_fills_masks_on_a_thread_without_overlapped_scheduling(engine, monkeypatch):
    """Synchronous steps (the CPU's default): the mask is filled on the mask thread beside
    the forward, and the constrained and plain replies are those of the overlapped engine."""
    plain = SamplingParams(temperature=0, max_tokens=16)
    prompts = [PERSON, "A product code:", "The capital of France is"]
    params = [constrained(60, json=SCHEMA), constrained(16, regex=r"[A-Z]{3}-\d{4}"), plain]
    overlapped = engine.generate(prompts, params)["text"]
    monkeypatch.setattr(engine, "async_scheduling", False)
    threads = []
    fill = engine._grammars.compiler.fill_bitmask

    def spy(*args):
        threads.append(threading.current_thread().name)
        return fill(*args)

    monkeypatch.setattr(engine._grammars.compiler, "fill_bitmask", spy)
    out = engine.generate(prompts, params)["text"]
    assert out == overlapped
    jsonschema.validate(json.loads(out[0]), SCHEMA)
    # The mask thread takes the fill while the forward (GIL-free torch ops) runs.
    assert any(t.startswith("minivllm-bitmask") for t in threads), threads


def test_engine_masked_greedy_steps_replay_the_picking_graph(engine, smollm2_path,
                                                             monkeypatch):
    """A greedy decode step with rows under a grammar takes the picking decode graph (its
    staged inputs and its logits; the pick under the mask follows it), with the replies
    of the engine without graphs (graphs replayed eagerly on the CPU)."""
    from minivllm import LLMEngine

    prompts = [PERSON, "A product code:", "The capital of France is"]
    params = [constrained(40, json=SCHEMA), constrained(16, regex=r"[A-Z]{3}-\d{4}"),
              SamplingParams(temperature=0, max_tokens=16)]
    want = engine.generate(prompts, params)["text"]
    llm = LLMEngine({"model_name_or_path": str(smollm2_path), "device": "cpu",
                     "dtype": "float32", "max_model_length": 1024, "block_size": 16,
                     "async_scheduling": True})
    try:
        llm.runner.capture_cuda_graphs(replay_eagerly=True)
        masked: list[bool] = []
        replay = llm.runner._replay_picking

        def spy(b, **kw):
            masked.append(bool(b.bitmask_rows))
            return replay(b, **kw)

        monkeypatch.setattr(llm.runner, "_replay_picking", spy)
        got = llm.generate(prompts, params)["text"]
    finally:
        llm.exit()
    assert got == want
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", got[1])
    assert masked.count(True) >= 10, masked  # the constrained decode steps


def test_compiled_grammars_are_cached_per_schema_and_the_vocabulary_read_ahead(engine):
    compiler = GrammarCompiler(engine.tokenizer, engine.config.model.vocab_size, [2])
    try:
        assert compiler.prepare().result(timeout=120) is not None  # xgrammar's compiler
        first = compiler.compile(StructuredOutputsParams(json={"type": "object",
                                                               "required": ["a"]}))
        again = compiler.compile(StructuredOutputsParams(json={"required": ["a"],
                                                               "type": "object"}))
        assert again is first and first.result(timeout=120) is not None
        assert compiler.compile(StructuredOutputsParams(regex="a+")) is not first
    finally:
        compiler.close()


def test_json_masks_refuse_control_characters_inside_length_limited_strings(engine):
    """JSON holds no raw byte below 0x20, yet xgrammar's `maxLength` strings accept them:
    a row sampled at a temperature from a weak model once held a NUL inside a string."""
    tokenizer = engine.tokenizer
    control = [i for i in range(engine.config.model.vocab_size)
               if any(ord(ch) < 32 for ch in tokenizer.decode([i]))]
    assert len(control) > 100  # SmolLM2's byte-level vocabulary: one per control byte and more
    compiler = GrammarCompiler(tokenizer, engine.config.model.vocab_size, [2])
    try:
        for schema, prefix in [(SCHEMA, '{"name": "Al'),
                               (SCHEMA, '{"name": "Al", "age": 30, "color": "red", "tags": ["'),
                               ({"type": "object"}, '{"a": "')]:
            m = compiler.matcher(compiler.compile(StructuredOutputsParams(json=schema)).result())
            assert all(m.accept_token(t) for t in tokenizer.encode(prefix,
                                                                   add_special_tokens=False))
            mask = compiler.fill_bitmask(1, [0], [m])
            allowed = [i for i in control if (int(mask[0, i // 32]) >> (i % 32)) & 1]
            assert allowed == [], (prefix, allowed[:8])
            letter = tokenizer.encode("b", add_special_tokens=False)[0]
            assert (int(mask[0, letter // 32]) >> (letter % 32)) & 1  # text still goes on
        # Other constraints keep what their grammar allows: a regex may ask for a newline.
        m = compiler.matcher(compiler.compile(StructuredOutputsParams(regex="a\\nb")).result())
        assert m.accept_token(tokenizer.encode("a", add_special_tokens=False)[0])
        newline = tokenizer.encode("\n", add_special_tokens=False)[0]
        mask = compiler.fill_bitmask(1, [0], [m])
        assert (int(mask[0, newline // 32]) >> (newline % 32)) & 1
    finally:
        compiler.close()


def test_bitmask_buffers_reused_in_turn_hold_only_this_steps_masks(engine):
    """The two bitmask buffers are reused in turn, only the rows their last mask filled
    set back to all ones: each mask equals one built from scratch, whatever rows and row
    counts the steps before had."""
    tokenizer, vocab = engine.tokenizer, engine.config.model.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab, [2])
    try:
        def matcher(spec, prefix):
            m = compiler.matcher(compiler.compile(spec).result())
            assert all(m.accept_token(t)
                       for t in tokenizer.encode(prefix, add_special_tokens=False))
            return m

        matchers = [matcher(StructuredOutputsParams(json=SCHEMA), '{"name": "Al'),
                    matcher(StructuredOutputsParams(regex=r"[A-Z]{3}-\d{4}"), "AB"),
                    matcher(StructuredOutputsParams(choice=["yes", "no"]), ""),
                    matcher(StructuredOutputsParams(json=SCHEMA), "")]
        steps = [(4, [0, 2]), (3, [1]), (4, [0, 1, 2, 3]), (5, [3]), (2, []), (4, [2]),
                 (6, [5]), (6, [0, 4])]
        for num_rows, rows in steps:
            picked = [matchers[i % len(matchers)] for i in rows]
            got = compiler.fill_bitmask(num_rows, rows, picked).clone()
            want = torch.full_like(got, -1)
            for row, m in zip(rows, picked, strict=True):
                fresh = GrammarCompiler.fill_bitmask(compiler, 1, [0], [m])
                want[row] = fresh[0]
            assert torch.equal(got, want), (num_rows, rows)
    finally:
        compiler.close()


def test_engine_a_failed_mask_ends_the_constrained_requests_not_the_plain_ones(engine,
                                                                              monkeypatch):
    """The grammar backend failing on a step's masks ends the requests under a grammar in
    that step, with the error; a plain request beside them gets the text it gets alone."""
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = engine.generate(["The capital of France is"], plain)["token_ids"][0]
    fill, calls = engine._grammars.fill_bitmask, []

    class Failed:  # a fill that raised on the mask thread
        def result(self):
            raise RuntimeError("matcher out of step")

    def failing(out, rows):
        calls.append(len(calls))
        return Failed() if len(calls) == 4 else fill(out, rows)

    monkeypatch.setattr(engine._grammars, "fill_bitmask", failing)
    ids = [engine.add_prompt("A product code:", constrained(24, regex=r"[A-Z]{3}-\d{4}, lot \d+")),
           engine.add_prompt("The capital of France is", plain)]
    seqs = [engine._seqs[i] for i in ids]
    reported = []
    while not engine.scheduler.is_finished():
        reported += [seq_id for seq_id, _ in engine.step()[0]]
    under, free = seqs
    assert under.finish_reason == "error" and "matcher out of step" in under.error
    assert under.error.startswith("structured_outputs:")
    assert free.finish_reason == "length" and free.completion_token_ids == alone
    assert sorted(reported) == sorted(ids)
    monkeypatch.undo()
    again = engine.generate(["Name a color:"], constrained(4, choice=["red", "blue"]))
    assert again["text"][0] in ("red", "blue")  # the engine serves on


def test_engine_grammar_error_fails_the_request_and_the_engine_serves_on(engine):
    with pytest.raises(RuntimeError, match=r"structured_outputs\.regex: cannot be compiled"):
        engine.generate(["x"], constrained(4, regex="a(b"))
    out = engine.generate(["Name a color:"], constrained(4, choice=["red", "blue"]))
    assert out["text"][0] in ("red", "blue")


def test_engine_json_object_and_ebnf_grammar(engine):
    grammar = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
    out = engine.generate(["Reply with a JSON object giving a cat's name and age.", "A number:"],
                          [constrained(60, json_object=True), constrained(8, grammar=grammar)])
    assert isinstance(json.loads(out["text"][0]), dict)
    assert re.fullmatch(r"\(\d+\)", out["text"][1]) or out["finish_reason"][1] == "length"


# -- the server -----------------------------------------------------------------------------

SERVER_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "1024",
                "--block-size", "16", "--num-gpu-blocks-override", "256", "--max-num-seqs", "24"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    with serving(tmp_path_factory.mktemp("structured"),
                 [str(smollm2_path), *SERVER_FLAGS, "--served-model-name", "smol"],
                 clean_exit=True) as url:
        yield url


@pytest.mark.slow
def test_server_json_schema_20_requests_at_temperature_0_8_all_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def ask(i: int) -> str:
        r = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": PERSON}], temperature=0.8,
            seed=i, max_tokens=90, response_format=fmt)
        return r.choices[0].message.content

    with ThreadPoolExecutor(20) as pool:
        texts = list(pool.map(ask, range(20)))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one fixed reply


@pytest.mark.slow
def test_server_regex_choice_and_json_object(client):
    r = client.completions.create(model="smol", prompt="A flight number:", max_tokens=12,
                                  temperature=0.7,
                                  extra_body={"structured_outputs": {"regex": r"[A-Z]{2}\d{3}"}})
    assert re.fullmatch(r"[A-Z]{2}\d{3}", r.choices[0].text)
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Is fire cold?"}], max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model="smol", prompt="Pick a fruit:", max_tokens=5,
                                  extra_body={"guided_choice": ["apple", "pear"]})
    assert r.choices[0].text in ("apple", "pear")
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Reply with a JSON object giving "
                                 "a dog's name and age."}],
        max_tokens=40, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.slow
def test_server_uncompilable_grammar_is_a_400_naming_the_field(server):
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bad = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ]
    for extra, field in bad:
        r = httpx.post(f"{server}/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == field and error["message"].startswith(field), error
    assert "Unsupported type" in httpx.post(
        f"{server}/v1/chat/completions", json={**body, **bad[0][0]}, timeout=60
    ).json()["error"]["message"]
    # ... and the server serves on.
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200


@pytest.mark.slow
def test_server_unconstrained_greedy_text_is_the_same_batched_with_constrained(client):
    def plain() -> str:
        return client.completions.create(model="smol", prompt="The three primary colors are",
                                         max_tokens=24, temperature=0).choices[0].text

    alone = plain()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def constrained_request(i: int) -> str:
        return client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": PERSON}], temperature=0.8,
            seed=100 + i, max_tokens=60, response_format=fmt).choices[0].message.content

    with ThreadPoolExecutor(5) as pool:
        others = [pool.submit(constrained_request, i) for i in range(4)]
        time.sleep(0.2)  # the constrained ones are running when the plain one comes
        batched = pool.submit(plain).result()
        for f in others:
            f.result()
    assert batched == alone


# -- on a GPU: CUDA graphs and overlapped scheduling ------------------------------------------


@pytest.mark.gpu
def test_gpu_constrained_rows_are_masked_outside_the_graphs_and_plain_rows_untouched(
        smollm2_path):
    """SmolLM2 on CUDA with its defaults (decode graphs, the greedy graph, overlapped
    scheduling): constrained replies validate, and a greedy plain request batched with
    them decodes as it does alone."""
    from minivllm import LLMEngine

    llm = LLMEngine({"model_name_or_path": str(smollm2_path), "device": "cuda",
                     "max_model_length": 1024, "max_num_sequences": 16})
    try:
        assert llm.async_scheduling and llm.runner.graphs is not None
        plain = SamplingParams(temperature=0, max_tokens=32)
        alone = llm.generate(["The capital of France is"], plain)["text"][0]
        params = [constrained(90, 0.8, seed=i, json=SCHEMA) for i in range(8)]
        params += [constrained(16, regex=r"[A-Z]{3}-\d{4}"), plain]
        out = llm.generate([PERSON] * 8 + ["A product code:", "The capital of France is"],
                           params)
        for text in out["text"][:8]:
            jsonschema.validate(json.loads(text), SCHEMA)
        assert re.fullmatch(r"[A-Z]{3}-\d{4}", out["text"][8])
        assert out["text"][9] == alone
    finally:
        llm.exit()


SMOL_CONFIG_ENV = "MINIVLLM_TEST_SMOL_CONFIG"


def test_random_weights_take_the_architecture_of_a_folder_without_weights(smollm2_path,
                                                                          tmp_path):
    """The GPU test's and the benchmark's model: SmolLM2's config.json and tokenizer files
    with `load_format="dummy"` (no safetensors) is SmolLM2's architecture and eos."""
    from minivllm import EngineConfig

    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, tmp_path / name)
    dummy = EngineConfig.from_dict({"model_name_or_path": str(tmp_path), "load_format": "dummy"})
    real = EngineConfig.from_dict({"model_name_or_path": str(smollm2_path)})
    assert dummy.model == real.model and dummy.eos_token_ids == real.eos_token_ids


@pytest.mark.gpu
def test_gpu_random_weights_constrained_batch_with_graphs_and_overlap():
    """SmolLM2's architecture with random weights on CUDA (graphs, overlapped
    scheduling): JSON schema, regex and choice rows masked in the same steps as greedy
    plain rows; each constrained reply holds, each plain reply is the one it gets alone."""
    folder = os.environ.get(SMOL_CONFIG_ENV)
    if not folder:
        pytest.skip(f"{SMOL_CONFIG_ENV} is unset: set it to a folder holding SmolLM2's "
                    "config.json and tokenizer files (the weights are random)")
    from minivllm import LLMEngine

    llm = LLMEngine({"model_name_or_path": folder, "load_format": "dummy", "device": "cuda",
                     "dtype": "float32", "max_model_length": 1024, "max_num_sequences": 16})
    try:
        assert llm.async_scheduling and llm.runner.graphs is not None
        plain_prompts = ["The capital of France is", "Tell me a story.", "1, 2, 3,",
                         "Write a haiku about rain."]
        plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        alone = [llm.generate([p], plain)["text"][0] for p in plain_prompts]
        regex = r"[A-Z]{3}-\d{4}"
        params = [constrained(200, json=SCHEMA), constrained(200, 0.8, seed=1, json=SCHEMA),
                  constrained(16, regex=regex), constrained(8, choice=["yes", "no", "maybe"])]
        prompts = [PERSON, PERSON, "A product code:", "Is water wet?"]
        out = llm.generate(prompts * 2 + plain_prompts, params * 2 + [plain] * 4)
        texts = out["text"]
        for i in (0, 1, 4, 5):
            jsonschema.validate(json.loads(texts[i]), SCHEMA)
        assert re.fullmatch(regex, texts[2]) and re.fullmatch(regex, texts[6])
        assert texts[3] in ("yes", "no", "maybe") and texts[7] in ("yes", "no", "maybe")
        assert texts[8:] == alone
        # The masks are filled in pinned memory (no staging copy on the way up); a mask
        # without constrained rows allows every token.
        compiler = llm._grammars.compiler
        buffers = [b for b in compiler._buffers if b is not None]
        assert buffers and all(b.is_pinned() for b in buffers)
        assert bool((compiler.fill_bitmask(3, [], []) == -1).all())
    finally:
        llm.exit()
