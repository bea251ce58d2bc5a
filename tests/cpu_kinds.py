"""The two kinds of x86 CPU the suite must pass on, and how to run tests as the other one.

A CPU with AVX-512 BF16 or AMX multiplies bf16 itself: oneDNN and ATen take their bf16
paths there, and a bf16 model keeps its bf16 weights (kernels/cpu_bf16.py). One without
(AVX2 only, such as AMD Zen 3) has tinyserve compute bf16 in fp32 instead. Results differ
between the two by bf16 rounding, so the tests whose numbers depend on it run on both:

- on a CPU with the instructions, the other kind is real: ONEDNN_MAX_CPU_ISA=AVX2 and
  ATEN_CPU_CAPABILITY=avx2, set before torch starts, hold oneDNN and ATen to AVX2, and
  oneDNN then reports no bf16 support, so tinyserve takes its fp32 path too;
- on a CPU without them, the instructions cannot be had: the other kind is tinyserve's
  bf16 path forced on (bf16 weights and attention, through torch's portable bf16 code),
  while oneDNN's weight packing stays where oneDNN can run it.

tests/test_cpu_kinds.py starts pytest again with TINYSERVE_TEST_CPU_KIND set; the conftest
calls take_the_kind_asked_for(), which fails the run if the kind did not take.
"""

import os

KIND_VARIABLE = "TINYSERVE_TEST_CPU_KIND"
BF16 = "bf16-matmuls"
NO_BF16 = "no-bf16-matmuls"


def native_kind() -> str:
    from tinyserve.kernels.cpu_bf16 import cpu_has_bf16_matmuls

    return BF16 if cpu_has_bf16_matmuls() else NO_BF16


def other_kind_environment() -> dict[str, str]:
    """The environment variables that make a new pytest process the other kind of CPU from this one."""
    if native_kind() == BF16:
        return {KIND_VARIABLE: NO_BF16, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    return {KIND_VARIABLE: BF16}


def take_the_kind_asked_for() -> None:
    """In a process started with KIND_VARIABLE: force the bf16 path if asked, and check the kind."""
    wanted = os.environ.get(KIND_VARIABLE)
    if wanted is None:
        return
    from tinyserve.kernels import cpu_bf16
    from tinyserve.models import packed_linear  # noqa: F401 - takes the real check first: it packs only where oneDNN can

    if wanted == BF16 and not cpu_bf16.cpu_has_bf16_matmuls():
        cpu_bf16.cpu_has_bf16_matmuls = lambda: True
    if native_kind() != wanted:
        raise RuntimeError(f"{KIND_VARIABLE}={wanted} did not take: this process is {native_kind()}")
