"""What every part of benchmarks/gpu_check.py shares: its rows, how it times, how it measures an error.

    Row               one line of the table: part, what was measured, the result
    device_seconds    median time of one call: CUDA events (triton.testing.do_bench) on a GPU,
                      the wall clock on the CPU of a smoke run
    relative_error    max |got - want| / (atol + rtol |want|): <= 1 passes torch.allclose
    guarded           a case that raises becomes a FAILED row, and the part goes on
"""

import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Row:
    part: str
    what: str
    result: str

    @property
    def failed(self) -> bool:
        return self.result.startswith("FAILED")


def device_seconds(fn, device: torch.device, smoke: bool) -> float:
    """Median seconds of one fn() call, after a warm-up (which compiles what it must)."""
    if device.type == "cuda":
        import triton.testing

        # CUDA events around each call, the L2 cache flushed between calls; no host sync in the timing.
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(1 if smoke else 5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def timer_name(device: torch.device) -> str:
    """How device_seconds timed, for the table."""
    return "CUDA events" if device.type == "cuda" else "wall clock"


def relative_error(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> float:
    """The largest error in units of the tolerance torch.allclose allows at that element (NaN counts as inf)."""
    got, want = got.float().cpu(), want.float().cpu()
    ratio = (got - want).abs() / (atol + rtol * want.abs())
    return float(torch.nan_to_num(ratio, nan=float("inf")).max())


def guarded(part: str, what: str, fn) -> list[Row]:
    """fn()'s rows, or one FAILED row naming the exception: one failing case never ends the run."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - recorded in the table, with where it came from
        where = traceback.extract_tb(error.__traceback__)[-1]
        return [Row(part, what, f"FAILED: {type(error).__name__}: {error} ({where.filename}:{where.lineno})")]
