"""Run a command as the terminal's foreground process group, so that Ctrl-C reaches it alone.

    python scripts/foreground.py COMMAND [ARGS...]      exits with COMMAND's status

`make serve` runs the server through this. A Ctrl-C in a terminal sends SIGINT to every
process of the terminal's foreground group, make included, and make then reports
"*** [serve] Interrupt" and exits 130 however cleanly the server drained. Here the command
gets a process group of its own and the terminal, as a job-control shell gives each job,
so make never sees the Ctrl-C and ends with the server's own status: 0 after a clean
drain. Without a controlling terminal (CI, a pipe) the command simply runs.
"""

import os
import signal
import subprocess
import sys


def controlling_terminal() -> int | None:
    """A descriptor of this process's terminal, if this process is in its foreground group."""
    try:
        tty = os.open("/dev/tty", os.O_RDWR)
    except OSError:
        return None
    if os.tcgetpgrp(tty) != os.getpgrp():
        os.close(tty)
        return None
    return tty


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    tty = controlling_terminal()
    if tty is None:
        return exit_status(subprocess.call(argv))
    child = subprocess.Popen(argv, preexec_fn=os.setpgrp)  # noqa: PLW1509 (no threads here)
    try:
        os.setpgid(child.pid, child.pid)  # the child does it too: whichever runs first wins the race
    except (PermissionError, ProcessLookupError):
        pass  # it has exec'd already (its group is set) or is gone
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # taking the terminal back from a background group
    try:
        os.tcsetpgrp(tty, child.pid)
        return exit_status(child.wait())
    finally:
        os.tcsetpgrp(tty, os.getpgrp())
        os.close(tty)


def exit_status(returncode: int) -> int:
    """A shell's way of saying a child was killed by a signal: 128 + its number."""
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
