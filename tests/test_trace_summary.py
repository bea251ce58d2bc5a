"""`tinyserve trace summarize` on every shipped run: its step counts agree, and it lists the requests.

The header's steps, the engine table's and the stage table's tinyserve.step samples count
the same steps: those that ran requests, with the empty ones (an engine telling its worker of
released blocks, and nothing else) counted apart. The request list gives each request's id
as `tinyserve trace request` takes it.
"""

import re
from pathlib import Path

import pytest

from tinyserve.cli.main import main
from tinyserve.trace_reading.run import load_run
from tinyserve.trace_reading.summary import summarize

RUNS = sorted(Path(__file__).resolve().parents[1].joinpath("traces").glob("recorded-*"))
HEADER_STEPS = re.compile(r", (\d+) engine steps(?: \(\+(\d+) empty, releasing blocks\))?, (\d+) engine\(s\)$")


def engine_rows(lines: list[str]) -> list[list[str]]:
    return [line.split() for line in lines if re.match(r"engine \d+ ", line)]


@pytest.mark.parametrize("folder", RUNS, ids=lambda p: p.name)
def test_the_headers_steps_are_the_engine_tables_steps(folder):
    run = load_run(folder)
    lines = summarize(run, max_requests=None).splitlines()
    steps, empty, engines = HEADER_STEPS.search(lines[0]).groups()
    rows = engine_rows(lines)
    assert len(rows) == int(engines) == len(run.engine_indices)
    assert sum(int(row[3]) for row in rows) == int(steps)  # engine N, requests, steps, empty, ...
    assert sum(int(row[4]) for row in rows) == int(empty or 0)
    assert int(steps) + int(empty or 0) == len(run.steps)
    step_samples = next(line.split() for line in lines if line.startswith("tinyserve.step "))
    assert int(step_samples[1]) == len(run.steps)


def test_a_run_with_empty_steps_says_so():
    run = load_run(next(folder for folder in RUNS if folder.name == "recorded-cases"))
    empty = sum(1 for s in run.steps if not s.request_ids)
    assert empty > 0
    assert f"{len(run.steps) - empty} engine steps (+{empty} empty, releasing blocks)" in summarize(run)


@pytest.mark.parametrize("folder", RUNS, ids=lambda p: p.name)
def test_every_request_is_listed_with_what_trace_request_shows(folder):
    run = load_run(folder)
    text = summarize(run, max_requests=None)
    listed = text[text.index("requests, by arrival"):].splitlines()[2:]
    assert len(listed) == len(run.requests)
    by_id = {line.split()[0]: line.split() for line in listed}
    for r in run.requests:
        row = by_id[r.request_id]
        assert row[2:4] == [str(r.num_prompt_tokens if r.num_prompt_tokens is not None else "-"),
                            str(r.num_output_tokens)]
        assert row[4] == ("-" if r.ttft_s is None else f"{r.ttft_s * 1e3:.2f}")
        if r.http_span is not None:
            assert row[1].startswith("/v1/")


def test_the_list_is_cut_at_max_requests_and_says_how_to_see_the_rest():
    run = load_run(next(folder for folder in RUNS if len(load_run(folder).requests) > 3))
    text = summarize(run, max_requests=2)
    listed = text[text.index("requests, by arrival"):].splitlines()
    assert len(listed) == 2 + 2 + 1  # title, header, two requests, the rest
    assert listed[-1] == f"... and {len(run.requests) - 2} more (tinyserve trace summarize --all-requests lists them)"


def test_an_id_from_the_list_is_one_trace_request_shows(capsys):
    folder = next(folder for folder in RUNS if folder.name == "recorded-cases")
    assert main(["trace", "summarize", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"`tinyserve trace request {folder} ID` shows one" in out
    first_id = out[out.index("requests, by arrival"):].splitlines()[2].split()[0]
    assert main(["trace", "request", str(folder), first_id]) == 0
    assert capsys.readouterr().out.startswith(f"request {first_id} ")
