"""How long a test waits for a condition: the bound it names, times PATIENCE.

A bound is reached only when the test is failing, so a generous one costs nothing when it
passes; but on a busy machine (the suite passes at a load average of 4 on 2 cores) what takes
0.1 s when idle can take a few seconds. The helpers that wait (server_checks.wait_until,
wait_until_gone, ...) scale every bound they are given by this factor; TINYSERVE_TEST_PATIENCE
sets it. A test never sleeps a fixed time in place of waiting for what it needs.
"""

import os

PATIENCE = float(os.environ.get("TINYSERVE_TEST_PATIENCE", "6"))


def patient(seconds: float) -> float:
    """A bound of `seconds` on an idle machine, as long as this machine may need."""
    return seconds * PATIENCE
