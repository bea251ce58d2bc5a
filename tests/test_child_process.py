"""ChildProcess: a new interpreter whose main module is tinyserve's, never the caller's script."""

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.patience import patient
from tinyserve.engine.child_process import ChildProcess


def exit_with(code: int) -> None:
    raise SystemExit(code)


def report_main(path: str) -> None:
    """What the child's __main__ is, written where the parent reads it."""
    with open(path, "w") as out:
        out.write(sys.modules["__main__"].__spec__.name)


def sleep_long() -> None:
    time.sleep(600)


def test_the_child_runs_its_target_with_its_arguments_and_says_how_it_ended(tmp_path):
    child = ChildProcess(report_main, {"path": str(tmp_path / "main")}, name="reporter")
    child.start()
    child.join(patient(30))
    assert child.exitcode == 0 and (tmp_path / "main").read_text() == "tinyserve.engine.child_process"
    failing = ChildProcess(exit_with, {"code": 3}, name="failing")
    failing.start()
    failing.join(patient(30))
    assert failing.exitcode == 3 and not failing.is_alive()


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "pipe"])
def test_the_sentinel_turns_readable_when_the_child_ends_and_terminate_is_sigterm(pidfd, monkeypatch):
    if not pidfd:  # what a system without pidfd_open (macOS) gets
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    child = ChildProcess(sleep_long, {}, name="sleeper")
    child.start()
    assert child.is_alive() and select.select([child.sentinel], [], [], 0)[0] == []
    child.terminate()
    assert select.select([child.sentinel], [], [], patient(30))[0] == [child.sentinel]
    child.join(patient(30))
    assert child.exitcode == -signal.SIGTERM


def test_a_child_whose_parent_stopped_before_sending_its_work_exits_quietly():
    """A SIGTERM right after the spawn stops the parent before it writes the child's work to its stdin: the
    child then reads end-of-file, and exits 0 without a traceback in the server's log."""
    done = subprocess.run([sys.executable, "-m", "tinyserve.engine.child_process"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
