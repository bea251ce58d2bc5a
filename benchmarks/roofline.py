"""What this machine is and can do, and the least time any engine could take for a workload on it.

describe_machine() names the CPU, the cores, the library versions and the load;
matmul_flops_per_second() and copy_bytes_per_second() measure, here and now, the
matmul rate (fp32 or bf16) and the memory copy bandwidth (bytes read + written).

roofline() bounds a workload of bench_models.py: its FLOPs (2 per weight per token,
plus attention) at the measured matmul rate, and the bytes an ideal batched engine
must move (every weight once per step, at least one step per output token, plus the
KV cache each decode step reads) at the measured copy bandwidth. The larger of the
two times is the bound.
"""

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from bench_models import BYTES_PER_PARAM, Shape, Workload

# ---- the machine ---------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe_machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{cpu_model()}, {cores} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"transformers {transformers.__version__}, python {platform.python_version()}, "
            f"load average {load} (1/5/15 min)")


def best_time(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_flops_per_second(n: int, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b), repeats=5)


def copy_bytes_per_second(num_bytes: int) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_time(lambda: dst.copy_(src), repeats=5)  # read + write


# ---- the roofline --------------------------------------------------------------------


@dataclass
class Roofline:
    flops: float
    bytes: float
    flops_per_second: float
    bytes_per_second: float

    @property
    def compute_time(self) -> float:
        return self.flops / self.flops_per_second

    @property
    def memory_time(self) -> float:
        return self.bytes / self.bytes_per_second

    @property
    def bound(self) -> float:
        return max(self.compute_time, self.memory_time)


def roofline(shape: Shape, workload: Workload, flops_per_second: float, bytes_per_second: float,
             bytes_per_value: int = BYTES_PER_PARAM) -> Roofline:
    """FLOPs and bytes of the workload for an ideal engine (see the module docstring)."""
    attention_flops_per_context_token = 4 * shape.num_layers * shape.num_heads * shape.head_dim  # QKᵀ and PV
    flops = 0.0
    kv_bytes = 0.0
    for prompt, n in zip(workload.prompts, workload.output_lens):
        positions = len(prompt) + n - 1  # the last sampled token is never fed back
        flops += 2 * shape.body_matmul_params * positions
        flops += attention_flops_per_context_token * positions * (positions + 1) / 2  # causal: position t sees t+1
        flops += 2 * shape.head_params * n  # logits only where a token is sampled
        # Each decode position reads the KV of everything before it.
        kv_bytes += shape.kv_bytes_per_token * sum(range(len(prompt), positions))
    weight_bytes = (shape.body_matmul_params + shape.head_params) * BYTES_PER_PARAM
    steps = max(workload.output_lens)  # at least one step per output token, each reading every weight
    moved = (steps * weight_bytes + kv_bytes) * bytes_per_value / BYTES_PER_PARAM
    return Roofline(flops, moved, flops_per_second, bytes_per_second)
