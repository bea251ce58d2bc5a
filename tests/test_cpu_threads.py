"""The forward pass's CPU threads: the governor's rule, a fixed --cpu-threads, and a real busy machine."""

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from tests.required_tools import missing
from tests.server_checks import wait_until
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.config import EngineArgs
from tinyserve.engine.worker import cpu_threads
from tinyserve.engine.worker.cpu_threads import (
    FIRST_PROBE_INTERVAL_S, IDLE_S, MAX_PROBE_INTERVAL_S, MIN_STEPS, SHORT_WINDOWS_TO_DROP, SHORTFALL, WINDOW_S,
    ThreadGovernor, process_is_running,
)
from tinyserve.lifecycle import schema
from tinyserve.trace_reading.otlp_json import read_spans

STEP_S = WINDOW_S / MIN_STEPS  # steps this long end a window every MIN_STEPS steps


def run_windows(governor: ThreadGovernor, usage: float, windows: int = 1) -> None:
    """Feed `windows` windows in which the process used `usage` CPU seconds per wall second."""
    for _ in range(windows * MIN_STEPS):
        governor.observe(STEP_S, usage * STEP_S)


def drop_a_thread(governor: ThreadGovernor, usage: float) -> None:
    """Windows short of cores, in a row, as many as a thread is given up after."""
    run_windows(governor, usage, windows=SHORT_WINDOWS_TO_DROP)


def windows_for(seconds: float) -> int:
    return int(seconds / WINDOW_S + 0.999)


# ---- the rule --------------------------------------------------------------------------


def test_a_team_that_owns_its_cores_keeps_them():
    governor = ThreadGovernor(4)
    run_windows(governor, 3.9, windows=200)
    assert governor.threads == 4 and governor.changes == []


def test_a_decision_waits_for_a_whole_window():
    too_few_steps = ThreadGovernor(2)
    for _ in range(MIN_STEPS - 1):  # long steps, but too few of them
        too_few_steps.observe(WINDOW_S, 0.1 * WINDOW_S)
    assert too_few_steps.threads == 2
    too_short = ThreadGovernor(2)
    short = WINDOW_S / (MIN_STEPS * 4)
    for _ in range(MIN_STEPS * 4 - 1):  # enough steps, but not a window's time together
        too_short.observe(short, 0.0)
    assert too_short.threads == 2
    too_short.observe(short * 1.01, 0.0)  # now both: one window, short of cores
    assert too_short.threads == 2
    run_windows(too_short, 0.0, windows=SHORT_WINDOWS_TO_DROP - 1)  # and the next ones in a row
    assert too_short.threads == 1


def test_a_moment_short_of_cores_costs_no_thread():
    """A quiet VM's hiccup (one window short, as the hypervisor holds a core back) is not a busy machine."""
    governor = ThreadGovernor(2)
    for _ in range(50):
        run_windows(governor, 1.0, windows=SHORT_WINDOWS_TO_DROP - 1)
        run_windows(governor, 1.95)
    run_windows(governor, 2 - SHORTFALL + 0.01, windows=100)  # short, but by less than SHORTFALL
    run_windows(governor, 1.49, windows=100)  # measured on a quiet 2-core VM in bf16: not a core taken
    assert governor.threads == 2 and governor.changes == []


def test_cores_taken_away_cost_one_thread_every_few_windows_down_to_one():
    governor = ThreadGovernor(4)
    drop_a_thread(governor, 1.2)
    assert governor.threads == 3
    drop_a_thread(governor, 1.2)
    assert governor.threads == 2
    run_windows(governor, 1.6, windows=SHORT_WINDOWS_TO_DROP)  # 1.6 >= 2 - 0.75: two threads got their cores now
    assert governor.threads == 2
    drop_a_thread(governor, 0.7)
    drop_a_thread(governor, 0.2)  # below one thread's quarter core: never below one thread
    assert governor.threads == 1
    assert [threads for _, threads, _ in governor.changes] == [3, 2, 1]
    assert [usage for _, _, usage in governor.changes] == pytest.approx([1.2, 1.2, 0.7])


def test_a_probe_that_gets_its_cores_is_kept():
    governor = ThreadGovernor(2)
    drop_a_thread(governor, 1.0)
    assert governor.threads == 1
    waited = 0
    while governor.threads == 1 and waited < 1000:
        run_windows(governor, 1.0)
        waited += 1
    assert governor.threads == 2  # the probe, after FIRST_PROBE_INTERVAL_S of execute (give or take a window)
    assert abs(waited - windows_for(FIRST_PROBE_INTERVAL_S)) <= 1
    run_windows(governor, 1.9)  # ...got two cores
    run_windows(governor, 1.9, windows=100)
    assert governor.threads == 2
    assert [threads for _, threads, _ in governor.changes] == [1, 2]


def test_a_probe_lasts_two_steps_however_short():
    governor = ThreadGovernor(2)
    drop_a_thread(governor, 1.0)
    while governor.threads == 1:  # until the probe begins
        governor.observe(STEP_S, STEP_S)
    governor.observe(0.001, 0.001)  # one short step, one CPU second a second: not decided yet
    assert governor.threads == 2
    governor.observe(0.001, 0.001)  # the second: two threads got one core between them
    assert governor.threads == 1
    assert [threads for _, threads, _ in governor.changes] == [1, 2, 1]


def test_failed_probes_come_twice_as_rarely_up_to_a_limit():
    governor = ThreadGovernor(2)
    drop_a_thread(governor, 1.0)
    probes = []  # execute seconds at which a probe began
    clock = 0.0
    while clock < 60.0:
        before = governor.threads
        governor.observe(STEP_S, STEP_S)  # busy throughout: every probe fails
        clock += STEP_S
        if governor.threads > before:
            probes.append(clock)
    assert governor.threads == 1
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    expected = [min(FIRST_PROBE_INTERVAL_S * 2 ** (i + 1), MAX_PROBE_INTERVAL_S) for i in range(len(gaps))]
    # Each gap: the probe's two steps, then the interval of execute time since it failed.
    assert gaps == pytest.approx([e + 2 * STEP_S for e in expected], abs=WINDOW_S + STEP_S)  # give or take a window
    assert len(probes) >= 5  # and the last gaps are at the limit, not growing


def test_the_first_step_after_idle_leaves_a_running_feeder_a_core(monkeypatch):
    clock, feeder_runs = [100.0], [True]
    monkeypatch.setattr(cpu_threads, "time", SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    monkeypatch.setattr(cpu_threads, "process_is_running", lambda pid: pid == 4321 and feeder_runs[0])
    governor = ThreadGovernor(3)
    assert governor.threads_for_next_step() == 3  # no feeder watched: the offline LLM, a Ray actor
    governor.watch_feeder(4321)
    assert governor.threads_for_next_step() == 2  # idle since it began, the feeder taking in a burst
    governor.observe(0.1, 0.2, threads=2)
    assert governor.threads_for_next_step() == 3  # busy: the governor's count, whatever the feeder does
    clock[0] += IDLE_S * 0.9
    assert governor.threads_for_next_step() == 3
    clock[0] += IDLE_S * 0.2
    assert governor.threads_for_next_step() == 2
    feeder_runs[0] = False  # a lone request: the feeder sent it and waits
    assert governor.threads_for_next_step() == 3
    feeder_runs[0] = True
    drop_a_thread(governor, 1.0)
    clock[0] += IDLE_S * 2
    assert governor.threads == 2 and governor.threads_for_next_step() == 1
    drop_a_thread(governor, 0.5)
    clock[0] += IDLE_S * 2
    assert governor.threads == 1 and governor.threads_for_next_step() == 1  # never below one


def test_a_step_run_at_another_count_is_not_judged():
    governor = ThreadGovernor(2)
    for _ in range(20 * MIN_STEPS):  # one thread's CPU, on one thread: no sign of cores taken from two
        governor.observe(STEP_S, STEP_S, threads=1)
    assert governor.threads == 2 and governor.changes == []
    for _ in range(SHORT_WINDOWS_TO_DROP * MIN_STEPS):
        governor.observe(STEP_S, STEP_S, threads=2)  # the same CPU on two threads: a core was taken
    assert governor.threads == 1


def test_a_running_process_is_told_from_a_sleeping_one():
    ready = "print('ready', flush=True)\n"  # once started up: reading its modules, a process sleeps now and then
    busy = subprocess.Popen([sys.executable, "-c", ready + BUSY], stdout=subprocess.PIPE, text=True)
    asleep = subprocess.Popen([sys.executable, "-c", ready + "import time; time.sleep(600)"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert busy.stdout.readline() == asleep.stdout.readline() == "ready\n"
        # A busy loop is on a CPU or waiting for one (R) whenever it is looked at; the sleeper once it is in
        # its sleep, a moment after it printed.
        wait_until(lambda: not process_is_running(asleep.pid), 60, "the sleeper sleeps")
        assert all(process_is_running(busy.pid) for _ in range(20))
        assert not any(process_is_running(asleep.pid) for _ in range(20))
    finally:
        for process in (busy, asleep):
            process.kill()
            process.wait()
    assert not process_is_running(busy.pid)  # reaped: no such process


def test_engine_cores_is_what_the_first_engine_found(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_cores_found", None)
    before = torch.get_num_threads()
    try:
        assert cpu_threads.engine_cores() == before
        torch.set_num_threads(1)  # what a governor may leave behind
        assert cpu_threads.engine_cores() == before
    finally:
        torch.set_num_threads(before)


# ---- in an engine ----------------------------------------------------------------------


def greedy(max_tokens=12):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompts(n=6):
    return [{"prompt_token_ids": [5 + i, 17, 33 + i, 9]} for i in range(n)]


def test_cpu_threads_must_be_positive():
    with pytest.raises(ValueError, match="cpu_threads must be at least 1, got 0"):
        EngineArgs(cpu_threads=0).validate()


def test_a_fixed_count_is_set_for_every_step_and_recorded_on_the_execute_spans(tmp_path):
    from tinyserve.lifecycle.tracing import shutdown_tracing

    try:
        llm = LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=64, cpu_threads=1, trace_dir=str(tmp_path))
        assert llm.engine_core.thread_governor is None
        torch.set_num_threads(cpu_threads.engine_cores())  # someone else's setting in between...
        llm.generate(["one", "two"], greedy(), use_tqdm=False)
        assert torch.get_num_threads() == 1  # ...did not last into the steps
        [run] = [p for p in tmp_path.iterdir() if p.is_dir()]
        spans = read_spans(run / schema.OFFLINE_TRACE_FILE)
    finally:
        shutdown_tracing()
        torch.set_num_threads(cpu_threads.engine_cores())
    executes = [s for s in spans if s.name == schema.EXECUTE]
    assert executes and all(s.attributes[schema.EXECUTE_CPU_THREADS] == 1 for s in executes)
    assert all(s.attributes[schema.EXECUTE_CPU_TIME] >= 0 for s in executes)


def test_a_second_llm_starts_from_the_engines_cores_not_the_last_count():
    model = str(tiny_model_with_tokenizer("llama"))
    first = LLM(model, num_kv_blocks=64, cpu_threads=1)
    first.generate(prompts(), greedy(), use_tqdm=False)
    assert torch.get_num_threads() == 1
    second = LLM(model, num_kv_blocks=64)
    assert second.engine_core.thread_governor.max_threads == cpu_threads.engine_cores()
    second.generate(prompts(1), greedy(1), use_tqdm=False)
    assert second.engine_core.last_step_times.cpu_threads == cpu_threads.engine_cores()
    torch.set_num_threads(cpu_threads.engine_cores())


BUSY = "while True: pass"


@pytest.mark.slow
def test_beside_busy_programs_the_governor_gives_up_threads_and_outputs_do_not_change():
    """Real contention: as many pure-Python loops as cores, each in a session of its own (as another
    program would be, so the scheduler shares the cores between sessions), beside an LLM."""
    cores = cpu_threads.engine_cores()
    if cores < 2:
        missing(f"torch has {cores} thread here: there is no thread to give up")  # CI has two cores: it fails there
    model = str(tiny_model_with_tokenizer("llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4))
    fixed = LLM(model, num_kv_blocks=256, cpu_threads=cores)
    expected = [o.outputs[0].token_ids for o in fixed.generate(prompts(16), greedy(48), use_tqdm=False)]
    llm = LLM(model, num_kv_blocks=256)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True) for _ in range(cores)]
    try:
        outputs = llm.generate(prompts(16) * 4, greedy(48), use_tqdm=False)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    governor = llm.engine_core.thread_governor
    assert governor.changes, "the governor kept every thread while other programs held the cores"
    _, threads, usage = governor.changes[0]
    assert threads == cores - 1 and usage < cores - 0.5  # a window in which the team lacked a core
    assert [o.outputs[0].token_ids for o in outputs] == expected * 4  # fewer threads, the same tokens
    torch.set_num_threads(cores)
