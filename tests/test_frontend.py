"""The shared front end: one thread owns the engine; requests in, outputs out.

Logic on the scripted engine (milliseconds); one check on the real SmolLM2 engine that the
streamed outputs equal `LLMEngine.generate`.
"""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from minivllm import SamplingParams
from minivllm.frontend import EngineClient, EngineFrontend, GenerateRequest, RequestOutput
from minivllm.server.standin import ScriptedEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def collect(frontend: EngineFrontend, request: GenerateRequest) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [out async for out in frontend.generate(request)]

    return asyncio.run(run())


@pytest.fixture()
def fake():
    engine = ScriptedEngine(reply="one two three four five six seven eight nine ten",
                            step_delay=0.001)
    frontend = EngineFrontend(engine, owns_engine=True)
    frontend.start()
    yield frontend
    frontend.close()
    with pytest.raises(RuntimeError, match="shut down"):  # the front end closed its engine
        engine.add_prompt("hi")


def test_is_an_engine_client_and_streams_with_caller_ids(fake):
    assert isinstance(fake, EngineClient)
    assert fake.info is not None and fake.info.block_size == 16
    outs = collect(fake, GenerateRequest("my-id", SamplingParams(max_tokens=50),
                                         messages=[{"role": "user", "content": "hi"}]))
    assert {o.request_id for o in outs} == {"my-id"}
    assert outs[0].accepted and not outs[0].text
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == "one two three four five six seven eight nine ten"
    assert outs[-1].num_generated_tokens == sum(len(o.token_ids) for o in outs) > 0
    assert fake.stats() is not None


def test_bad_input_is_rejected_alone_and_the_engine_keeps_serving(fake):
    # Longer than the engine's max_model_length (4096 tokens).
    outs = collect(fake, GenerateRequest("a", GREEDY, prompt="BAD prompt " * 2000))
    assert len(outs) == 1 and outs[0].rejected and outs[0].finish_reason == "error"
    assert outs[0].error
    assert collect(fake, GenerateRequest("b", GREEDY, prompt="fine"))[-1].finish_reason


def test_duplicate_live_id_is_refused(fake):
    got: list[RequestOutput] = []
    done = threading.Event()

    def sink(out: RequestOutput) -> None:
        got.append(out)
        if out.request_id == "x" and out.finished and out.rejected:
            done.set()

    fake.add_request(GenerateRequest("x", SamplingParams(max_tokens=500, ignore_eos=True),
                                     prompt="long"), sink)
    fake.add_request(GenerateRequest("x", GREEDY, prompt="again"), sink)
    assert done.wait(10)
    assert any("already in use" in (o.error or "") for o in got)
    fake.abort("x")


def test_leaving_the_stream_early_aborts_the_request(fake):
    request = GenerateRequest("early", SamplingParams(max_tokens=10_000, ignore_eos=True),
                              prompt="go on forever")

    async def take_three() -> None:
        n = 0
        async for out in fake.generate(request):
            n += len(out.token_ids)
            if n >= 3:
                break

    asyncio.run(take_three())

    async def wait_idle() -> None:
        for _ in range(500):
            stats = fake.stats()
            if stats is not None and stats.num_running == 0 and stats.num_used_blocks == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"not idle: {fake.stats()}")

    asyncio.run(wait_idle())


def test_abort_all_ends_live_requests_and_refuses_new_ones(fake):
    outs: list[RequestOutput] = []
    ended = threading.Event()

    def sink(out: RequestOutput) -> None:
        outs.append(out)
        if out.finished:
            ended.set()

    fake.add_request(GenerateRequest("r", SamplingParams(max_tokens=10_000, ignore_eos=True),
                                     prompt="long"), sink)
    while not any(o.token_ids for o in outs):
        threading.Event().wait(0.005)
    fake.abort_all(refuse_new=True)
    assert ended.wait(10) and outs[-1].finish_reason == "abort"
    late = collect(fake, GenerateRequest("late", GREEDY, prompt="hi"))
    assert late[0].rejected and "shutting down" in late[0].error


def test_outputs_equal_generate_on_the_real_engine(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name two colours."}], add_generation_prompt=True,
        tokenize=False)
    expected = smollm2.generate([prompt], GREEDY)
    frontend = EngineFrontend(smollm2, owns_engine=False)
    frontend.start()
    try:
        outs = collect(frontend, GenerateRequest(
            "c", GREEDY, messages=[{"role": "user", "content": "Name two colours."}]))
    finally:
        frontend.close()
    assert "".join(o.text for o in outs) == expected["text"][0]
    assert [t for o in outs for t in o.token_ids] == expected["token_ids"][0]
    assert outs[0].num_prompt_tokens == len(smollm2.tokenizer.encode(prompt))
    assert smollm2.stats().num_used_blocks == 0


def test_an_engine_built_on_the_engine_thread_is_stepped_there():
    """An engine factory (what the engine process and the app give) runs on the
    thread that then steps the engine, `start()` waits for it and reports its progress,
    and a factory that fails makes `start()` raise its error."""
    threads = {}

    class Recording(ScriptedEngine):
        def step(self):
            threads.setdefault("step", threading.current_thread())
            return super().step()

    def factory(on_progress):
        threads["build"] = threading.current_thread()
        on_progress("loading weights", 0.5)
        return Recording(reply="one two three", step_delay=0.001)

    stages = []
    frontend = EngineFrontend(engine_factory=factory)
    info = frontend.start(lambda stage, fraction: stages.append((stage, fraction)))
    try:
        assert info is frontend.info and stages == [("loading weights", 0.5)]
        assert threads["build"] is not threading.current_thread()
        outs = collect(frontend, GenerateRequest("a", GREEDY, prompt="hi"))
        assert outs[-1].finished and "".join(o.text for o in outs) == "one two three"
        assert threads["step"] is threads["build"]
    finally:
        frontend.close()
    with pytest.raises(RuntimeError, match="shut down"):
        frontend.engine.add_prompt("hi")

    def broken(on_progress):
        raise ValueError("max_model_length=0: must be >= 1")

    failing = EngineFrontend(engine_factory=broken)
    with pytest.raises(ValueError, match="max_model_length=0"):
        failing.start()
    assert not failing.alive


def test_a_built_engine_leaves_the_collectors_full_passes():
    # A full pass over a live engine's objects stalls every stream for tens of ms: what
    # the start made is frozen out of the passes, and the engine's objects with it.
    gc.unfreeze()
    engine = ScriptedEngine(reply="ok", step_delay=0.001)
    frontend = EngineFrontend(engine, owns_engine=True)
    try:
        frontend.start()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert not any(o is engine for o in gc.get_objects())  # the engine is frozen too
        assert collect(frontend, GenerateRequest("r", GREEDY, prompt="hi"))[-1].finished
    finally:
        frontend.close()
        gc.unfreeze()
