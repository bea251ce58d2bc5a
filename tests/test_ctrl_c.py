"""Ctrl-C in a terminal: `make serve` drains the server and ends with status 0, no traceback.

A real pseudo-terminal: the test writes ^C to it, and the terminal's line discipline sends
SIGINT to its foreground process group, exactly as a keyboard would. Without
scripts/foreground.py that group holds make, the server and its engines, and make
reports "*** [serve] Interrupt"; without SIGINT ignored from an engine's first instruction,
a Ctrl-C while the engines start kills one with a KeyboardInterrupt traceback.
"""

import os
import pty
import select
import sys
import time
from pathlib import Path

import pytest

from tinyserve.testing import free_port
from tinyserve.trace_reading import load_run

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
STARTED = b"Application startup complete."
ENGINES_STARTING = b"Started server process"  # uvicorn's first line: the engines are loading


def make_serve_in_a_terminal(trace_dir: Path, interrupt_after: bytes, delay_s: float = 0.0,
                             timeout_s: float = 300) -> tuple[int, str]:
    """Run `make serve` (this environment, its set-up taken as done) under a new pty; press
    Ctrl-C `delay_s` after `interrupt_after` is printed; return make's exit status and output."""
    venv = Path(sys.prefix)
    command = ["make", "-s", "-C", str(ROOT), "-o", str(venv / ".serve-installed"), "serve", f"VENV={venv}",
               f"PORT={free_port()}", f"SERVE_ARGS=--trace-dir {trace_dir}"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: make, with the pty as its controlling terminal
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.execvp(command[0], command)
    output, pressed, seen_at, deadline = b"", False, None, time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if seen_at is None and interrupt_after in output:
                seen_at = time.monotonic()
            if not pressed and seen_at is not None and time.monotonic() >= seen_at + delay_s:
                os.write(fd, b"\x03")  # the terminal turns it into SIGINT for its foreground group
                pressed = True
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: every process holding the terminal has exited
                    break
                if not chunk:
                    break
                output += chunk
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert pressed, f"{interrupt_after!r} never appeared:\n{output.decode(errors='replace')[-3000:]}"
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


def test_ctrl_c_on_make_serve_drains_and_exits_0_without_a_traceback(tmp_path):
    status, output = make_serve_in_a_terminal(tmp_path, STARTED)
    assert status == 0, output[-3000:]
    assert "draining 0 in-flight request(s)" in output and "Application shutdown complete." in output
    for noise in ("Traceback", "KeyboardInterrupt", "Interrupt", "Error"):
        assert noise not in output, output[-3000:]
    [run_dir] = tmp_path.iterdir()  # the trace files were flushed and closed
    assert load_run(run_dir).manifest["served_model_name"] == "tinyserve-default"


def test_ctrl_c_while_the_engines_start_still_ends_cleanly(tmp_path):
    # Half a second in, the engine process is still importing torch: SIGINT reaches it there.
    status, output = make_serve_in_a_terminal(tmp_path, ENGINES_STARTING, delay_s=0.5)
    assert status == 0, output[-3000:]
    assert "Traceback" not in output and "killed by SIGINT" not in output, output[-3000:]
