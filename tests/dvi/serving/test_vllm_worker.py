"""The parts of dvi's vLLM worker extension that need no engine: the rejection sampler's `expand_kernel` in torch
(against a plain loop), registered in place of the CPU build's stand-in, which leaves a float tensor it expands
uninitialized (a sampled request's temperature and top-p per drafted token: its drafts verified against NaN); and the
choice of vLLM's model runner, on vLLM's own config as a host with Triton would have it; and the ahead-of-time
compiled artifact the CPU build cannot load, turned off."""

from __future__ import annotations

import time

import pytest
import torch

from dvi.errors import DviError
from dvi.cli.vllm.worker import V2_RUNNER, DviWorkerExtension, expand_tokens, fix_cpu_expand, runner_problem, select_v1_runner


def reference(values: list, counts: list[int], replace_from, replace_to) -> list:
    out = []
    for v, n in zip(values, counts):
        out += [replace_to if v == replace_from else v] * n
    return out


@pytest.mark.parametrize("values, counts", [([0.7, 0.0, 1.3], [3, 0, 2]), ([5, 0, 2, 9], [1, 4, 0, 1])])
def test_expand_tokens_puts_each_requests_value_in_its_tokens_places(values, counts):
    x = torch.tensor(values)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = torch.full((sum(counts) + 2,), -7, dtype=x.dtype)  # room past the tokens stays as it was
    expand_tokens(out, x, cu, 0, 1)
    assert out[: sum(counts)].tolist() == pytest.approx(reference(values, counts, 0, 1))
    assert out[sum(counts):].tolist() == [-7, -7]


def test_vllms_expansion_of_a_float_tensor_is_right_once_fixed():
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    fixed = fix_cpu_expand()
    assert fixed == (current_platform.is_cpu() and not HAS_TRITON)
    temperature = torch.tensor([0.7, 0.0, 1.5])  # the middle request greedy: vLLM replaces 0 by 1 before dividing
    got = expand_batch_to_tokens(temperature, torch.tensor([2, 5, 6], dtype=torch.int32), 6, replace_from=0.0, replace_to=1.0)
    assert got.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.5])


def test_the_loop_runs_on_vllms_v1_runner_where_vllm_would_pick_v2_and_refuses_v2_at_start(monkeypatch):
    """vLLM 0.32 picks its Model Runner V2 where Triton is installed (every CUDA host); dvi's worker extension hooks the
    V1 runner. Where nothing names a runner the loop selects V1; a setting or a feature that asks for V2 is one clear
    error at start (in `dvi serve` before vLLM runs, in the plugin before vLLM builds its workers); a V2 runner that
    reached the extension anyway is refused before any request."""
    import vllm.config.vllm as vllm_config_module
    from vllm.config import VllmConfig
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2

    from dvi.cli.vllm import loop as vllm_loop, server as vllm_server
    from dvi.config import load_config

    monkeypatch.delenv(V2_RUNNER, raising=False)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)  # what a CUDA host has
    config = VllmConfig()
    assert config.use_v2_model_runner  # vLLM's own choice there: V2

    env: dict[str, str] = {}
    assert select_v1_runner(env) and env[V2_RUNNER] == "0"
    assert select_v1_runner(dict(env))  # a vLLM process started by that one: still dvi's choice, and said so
    monkeypatch.setenv(V2_RUNNER, env[V2_RUNNER])
    assert not config.use_v2_model_runner and runner_problem(env, config) is None
    assert not select_v1_runner({V2_RUNNER: "1"}) and not select_v1_runner({V2_RUNNER: "0"})  # the user's, and checked

    monkeypatch.setenv(V2_RUNNER, "1")
    assert "VLLM_USE_V2_MODEL_RUNNER=1 asks for vLLM's Model Runner V2" in runner_problem({V2_RUNNER: "1"})
    with pytest.raises(DviError, match="VLLM_USE_V2_MODEL_RUNNER=1 asks for vLLM's Model Runner V2"):
        vllm_loop.prepare(config)
    with pytest.raises(DviError, match="unset it or set VLLM_USE_V2_MODEL_RUNNER=0"):
        vllm_server.environment(load_config([]), {V2_RUNNER: "1"})
    assert vllm_server.environment(load_config([]), {V2_RUNNER: "1"}, plain=True)[V2_RUNNER] == "1"  # plain vLLM's own
    assert "is not 0 or 1" in runner_problem({V2_RUNNER: "yes"})

    monkeypatch.setenv(V2_RUNNER, "0")
    monkeypatch.setattr(config, "watermark_config", object(), raising=False)  # a feature vLLM runs on V2 only
    assert config.use_v2_model_runner and "whatever VLLM_USE_V2_MODEL_RUNNER says" in runner_problem({V2_RUNNER: "0"}, config)

    worker = DviWorkerExtension()
    worker.model_runner = object.__new__(CPUModelRunnerV2)
    with pytest.raises(RuntimeError, match=r"hooks vLLM's V1 model runner; this worker runs vllm\.v1\.worker\.cpu\.model_runner\."
                                           r"CPUModelRunner, which has no _sample"):
        worker.dvi_capture(8)


def test_the_cpu_builds_ahead_of_time_artifact_is_off_unless_the_user_sets_it():
    """vLLM 0.32's CPU build saves an ahead-of-time compiled artifact it cannot load, then compiles again at every
    start: dvi's servers and the plugin in a user's own server turn it off, unless the variable is set; vLLM's CUDA
    build keeps its own default."""
    from dvi.cli.vllm.engine import AOT_COMPILE, aot_compile_off

    env: dict[str, str] = {}
    assert aot_compile_off(env, cpu=True) and env == {AOT_COMPILE: "0"}
    assert not aot_compile_off(env, cpu=True)  # a vLLM process the first one started: inherited, nothing to do
    for users in ("1", "0"):
        assert not aot_compile_off(mine := {AOT_COMPILE: users}, cpu=True) and mine == {AOT_COMPILE: users}
    assert not aot_compile_off(cuda := {}, cpu=False) and cuda == {}

    from dvi.cli.vllm.server import environment
    from dvi.config import load_config

    if not torch.cuda.is_available():  # the server `dvi serve` starts: off on this CPU build, the user's value kept
        assert environment(load_config([]), {})[AOT_COMPILE] == "0"
        assert environment(load_config([]), {AOT_COMPILE: "1"})[AOT_COMPILE] == "1"


def test_vllms_queue_readers_spin_briefly_where_a_trainer_takes_turns_but_not_while_serving_steps(monkeypatch, tmp_path):
    """Under dvi up's pause policy a reader of vLLM's shared-memory queues spins as vLLM has it (a second after its last
    read) while serving is stepping (a request in flight, no trainer's turn), and READER_SPIN_S otherwise, so that the
    trainer has the cores between requests and through its turns; writers unchanged."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from dvi import busy
    from dvi.cli.vllm.loop import READER_SPIN_S, park_idle_readers

    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)  # restored after the test
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    context = zmq.Context()
    try:
        address = f"ipc://{tmp_path / 'notify'}"
        writer = SpinCondition(is_reader=False, context=context, notify_address=address)
        assert SpinCondition(is_reader=True, context=context, notify_address=address).busy_loop_s == 1  # vLLM's own
        park_idle_readers(str(tmp_path / "busy"))
        reader = SpinCondition(is_reader=True, context=context, notify_address=address)

        def spins_after_a_wait() -> float:
            time.sleep(0.01)  # past the look's 5 ms
            reader.wait(timeout_ms=0)
            return reader.busy_loop_s

        assert spins_after_a_wait() == READER_SPIN_S < 0.1  # no request in flight: the trainer may run
        serving = busy.BusyFile(tmp_path / "busy")
        serving.set(True)
        assert spins_after_a_wait() == 1  # stepping: as vLLM has it
        turn = busy.Turn(tmp_path / "busy")
        turn.give(True)
        assert spins_after_a_wait() == READER_SPIN_S  # the trainer's turn
        turn.give(False)
        assert spins_after_a_wait() == 1
        assert SpinCondition(is_reader=False, context=context, notify_address=f"{address}2").busy_loop_s == writer.busy_loop_s == 0
        # a parked reader still wakes on a write
        serving.set(False)
        time.sleep(0.2)  # the subscription reaches the publisher
        reader.last_read = 0.0
        writer.notify()
        t0 = time.monotonic()
        reader.wait(timeout_ms=5000)
        assert time.monotonic() - t0 < 1.0
    finally:
        context.destroy(linger=0)


def test_a_steps_verifications_and_drafts_travel_with_its_output_through_vllms_queue():
    """The steps the worker kept, and the drafts the step proposed, ride on the step's ModelRunnerOutput through vLLM's
    own shared-memory queue (its pickler, tensors as out-of-band buffers) and come off it in the engine core, once;
    vLLM's shared empty output and an output vLLM delivers later carry nothing, and the steps stay with the worker for
    `dvi_take`."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

    from dvi.cli.vllm.worker import CARRIED, DRAFTS, carried, carried_drafts, carry

    class Kept:  # the worker extension's hand-over, as dvi_take and dvi_drafts do it
        def __init__(self, steps):
            self.steps = steps

        def dvi_take(self):
            steps, self.steps = self.steps, []
            return steps

        def dvi_drafts(self):
            return [DraftTokenIds(["r0"], [[11, 12, 13]])]

    step = {"req_ids": ["r0"], "num_draft": [2], "sampled": [[5, 9, -1]], "top_ids": torch.arange(6).view(3, 2),
            "top_logprobs": torch.full((3, 2), -0.5), "meta": {"tokens": 3}, "features": [(7, torch.ones(2, 4))]}
    worker = Kept([step])
    carry(EMPTY_MODEL_RUNNER_OUTPUT, worker)
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, CARRIED) and worker.steps == [step]
    carry(object(), worker)  # not a ModelRunnerOutput (an async one, delivered later)
    assert worker.steps == [step]
    out = ModelRunnerOutput(req_ids=["r0"], req_id_to_index={"r0": 0}, sampled_token_ids=[[5, 9]])
    carry(out, worker)
    assert worker.steps == []

    queue = MessageQueue(n_reader=1, n_local_reader=1)  # as vLLM's workers answer the engine core
    reader = MessageQueue.create_from_handle(queue.export_handle(), 0)
    queue.wait_until_ready(), reader.wait_until_ready()
    queue.enqueue(("ok", out))
    _, got = reader.dequeue(timeout=10)
    steps = carried(got)
    assert [s["req_ids"] for s in steps] == [["r0"]] and torch.equal(steps[0]["top_ids"], step["top_ids"])
    assert torch.equal(steps[0]["features"][0][1], torch.ones(2, 4)) and steps[0]["sampled"] == [[5, 9, -1]]
    assert carried(got) is None and not hasattr(got, CARRIED)  # taken off, once: vLLM reads the output without it
    drafts = carried_drafts(got)
    assert drafts is not None and drafts[0].req_ids == ["r0"] and drafts[0].draft_token_ids == [[11, 12, 13]]
    assert carried_drafts(got) is None and not hasattr(got, DRAFTS)
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, DRAFTS)
    assert got.sampled_token_ids == [[5, 9]]


def test_vllms_call_for_a_steps_drafts_is_answered_from_the_output_that_carried_them(monkeypatch):
    """vLLM's engine core asks its executor for the step's drafts after every step (`take_draft_token_ids`); dvi's
    engine answers from the drafts the step's output carried, once, and asks the worker only where an output carried
    none."""
    from types import SimpleNamespace

    from dvi.busy import ENV as BUSY_ENV
    from dvi.cli.vllm.engine import VllmEngine
    from dvi.cli.vllm.worker import DRAFTS
    from dvi.config import SpecConfig

    monkeypatch.delenv(BUSY_ENV, raising=False)
    asked = []

    class Executor:  # vLLM's executor, as the engine core calls it
        def __init__(self):
            self.outputs = []

        def sample_tokens(self, grammar_output):
            return self.outputs.pop(0)

        def take_draft_token_ids(self):
            asked.append("worker")
            return "the worker's drafts"

    executor = Executor()
    core = SimpleNamespace(model_executor=executor, collective_rpc=lambda *a, **k: [True], step_fn=lambda: ({}, False))
    target = SimpleNamespace(config=SimpleNamespace(vocab_size=100, max_position_embeddings=64))
    VllmEngine(core, target, None, SpecConfig())

    carrying, bare = SimpleNamespace(), SimpleNamespace()
    setattr(carrying, DRAFTS, ["the step's drafts"])
    executor.outputs = [carrying, bare]
    assert executor.sample_tokens(None) is carrying and not hasattr(carrying, DRAFTS)  # taken off before vLLM reads it
    assert executor.take_draft_token_ids() == "the step's drafts" and asked == []
    assert executor.take_draft_token_ids() == "the worker's drafts" and asked == ["worker"]  # once only
    executor.sample_tokens(None)  # an output that carried none
    assert executor.take_draft_token_ids() == "the worker's drafts" and asked == ["worker", "worker"]
