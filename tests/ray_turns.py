"""Tests that start a Ray cluster take turns (a helper module, not tests).

Ray's clusters on one machine find one another: a server that starts Ray looks for the
address the last cluster left in Ray's temp folder (tinyserve/distributed/ray_cluster.py,
as `ray.init` does) and joins it. Two tests running side by side (`make test` runs two
at a time) would then share one cluster, and the first to finish would stop it under the
other. So each holds this machine-wide lock while its cluster lives.
"""

import contextlib
import fcntl
import os
import tempfile


@contextlib.contextmanager
def ray_cluster_turn():
    """Wait until no other test on this machine holds a Ray cluster, then hold the turn."""
    with open(os.path.join(tempfile.gettempdir(), "tinyserve-tests-ray.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
