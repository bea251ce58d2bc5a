"""llama.cpp as a contender of compare.py: built here, fed compare.py's checkpoint, timed on its workloads.

llama.cpp is the engine a CPU user would pick instead of a Python one: ggml's C/C++
kernels (hand-vectorised for AVX2/AVX-512, their own thread pool) behind an HTTP
server, llama-server, that batches many requests ("slots") into each forward pass.
This module does what a user would do to run compare.py's model on it:

1. sources()  The llama.cpp sources vendored in PyPI's llama-cpp-python sdist (pip
              downloads the source archive only: --no-binary :all: --no-deps). The
              Python bindings are not used: the sdist is simply a pinned llama.cpp tree
              that PyPI serves, with its converter and its `gguf` package (gguf-py).
2. build()    cmake, Release, CPU only (GGML_NATIVE: tuned to this machine's CPU, the
              way llama.cpp builds by default), only the llama-server and llama-batched-bench
              targets, no web UI
              (it would be downloaded), no OpenSSL (we talk HTTP over loopback). Built
              once into ~/.cache/tinyserve-bench/llama.cpp-<version>/ (the cache folder
              is $TINYSERVE_BENCH_CACHE where set) and reused after.
3. convert()  HF folder -> GGUF with the sdist's convert_hf_to_gguf.py, in the model's
              dtype (f32 or bf16), run by convert_main() (see there: two methods of the
              converter are replaced, as it does not know our tokenizer's pre-tokenizer).
4. LlamaServer  llama-server on 127.0.0.1 and a free port, one slot per request of the
              workload, the KV cache in the model's dtype; generate() sends the prompts as
              token-id arrays to /completion, all at once, and returns the generated ids.

Nothing here is a test dependency; compare.py imports it only for --llama-cpp. Needed:
a C/C++ compiler (e.g. Debian's build-essential), and cmake (and ninja, optional) from
the system or from this project's `bench` extra (pip install -e '.[bench]').
"""

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx  # tinyserve's own HTTP client library

from background import die_with_parent

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp we build
CACHE = Path(os.environ.get("TINYSERVE_BENCH_CACHE", Path.home() / ".cache" / "tinyserve-bench"))
BUILD_JOBS = 2  # a one-off build; two jobs keep a small machine usable meanwhile

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",            # -march=native: the vector instructions this CPU has
    "-DBUILD_SHARED_LIBS=OFF",     # one self-contained binary
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # the web UI is not built, nor fetched
    "-DLLAMA_OPENSSL=OFF",         # HTTP on loopback needs no TLS
]
# llama-server for compare.py; llama-batched-bench, llama.cpp's own batched loop without HTTP
# or sampling, for llama_batched.py.
TARGETS = ["llama-server", "llama-batched-bench"]


def home() -> Path:
    """This release's folder in the cache: the sdist, its unpacked tree and the build."""
    return CACHE / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def sources(log: Callable[[str], None] = print) -> Path:
    """The llama.cpp tree inside the llama-cpp-python sdist, downloaded and unpacked once."""
    tree = home() / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    home().mkdir(parents=True, exist_ok=True)
    archive = home() / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not archive.is_file():
        log(f"llama.cpp: downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist for its llama.cpp sources")
        run_logged([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                    "--no-binary", ":all:", "--no-deps", "--dest", str(home())], home() / "download.log")
    with tarfile.open(archive) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # no paths outside home()
        tar.extractall(home(), **safe)
    return tree


def find_tool(name: str) -> str | None:
    """A command from this interpreter's environment (the `bench` extra) first, else from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.is_file() else shutil.which(name)


def run_logged(command: list[str], log_file: Path, **kwargs) -> None:
    """Run a command with its output in log_file; on failure raise with the log's end."""
    with open(log_file, "w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kwargs)
    if done.returncode != 0:
        tail = log_file.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{command[0]} failed ({done.returncode}); the end of {log_file}:\n{tail}")


def build(log: Callable[[str], None] = print) -> Path:
    """llama-server and llama-batched-bench, built once from the sdist's sources (see the module's
    docstring); llama-server's path (llama-batched-bench sits beside it)."""
    build_dir = home() / "build"
    binary = build_dir / "bin" / "llama-server"
    stamp = build_dir / "tinyserve-build.json"
    recipe = {"flags": CMAKE_FLAGS, "targets": TARGETS}
    if all((build_dir / "bin" / t).is_file() for t in TARGETS) and stamp.is_file() \
            and json.loads(stamp.read_text()) == recipe:
        return binary
    cmake = find_tool("cmake")
    if cmake is None:
        raise RuntimeError("building llama.cpp needs cmake: pip install -e '.[bench]' (or the system's cmake)")
    tree = sources(log)
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={find_tool('ninja')}"] if find_tool("ninja") else []
    log(f"llama.cpp: building {' and '.join(TARGETS)} from {tree} into {build_dir} (once; {BUILD_JOBS} jobs, "
        "several minutes on two cores)")
    start = time.perf_counter()
    build_dir.mkdir(parents=True, exist_ok=True)
    run_logged([cmake, "-S", str(tree), "-B", str(build_dir), *generator, *CMAKE_FLAGS], build_dir / "configure.log")
    run_logged([cmake, "--build", str(build_dir), "--target", *TARGETS, "--parallel", str(BUILD_JOBS)],
               build_dir / "build.log")
    stamp.write_text(json.dumps(recipe))
    log(f"llama.cpp: built in {time.perf_counter() - start:.0f} s")
    return binary


# ---- HF checkpoint -> GGUF -------------------------------------------------------------

# llama.cpp's name for the pre-tokenizer whose split regex is tinyserve's PRETOKENIZE_REGEX
# (tinyserve/models/tokenizer.py: Qwen2's, digits one at a time).
PRE_TOKENIZER = "qwen2"


def convert(hf_folder: str, outfile: Path, outtype: str) -> Path:
    """Write the checkpoint in hf_folder as GGUF, weights in outtype ("f32" or "bf16"), by convert_main()."""
    tree = sources()
    command = [sys.executable, __file__, "convert", str(tree), hf_folder, str(outfile), outtype]
    run_logged(command, outfile.with_suffix(".convert.log"))
    return outfile


def convert_main(tree: str, hf_folder: str, outfile: str, outtype: str) -> None:
    """convert_hf_to_gguf.py with two methods of its TextModel replaced, both about the tokenizer.

    - The BPE pre-tokenizer is named, not detected. The converter recognises a
      tokenizer's pre-tokenizer by the hash of the ids it gives one test string, from a
      table of published models; our freshly trained tokenizer is in no table, and the
      converter stops there. get_vocab_base_pre is the method that looks the hash up:
      here it returns the name of llama.cpp's pre-tokenizer with our split regex. The
      benchmark sends token ids, never text, so this only decides how llama-server would
      split text, and even that matches tinyserve.
    - The SentencePiece attempt is skipped. For a Llama the converter tries a
      SentencePiece tokenizer.model first (importing the sentencepiece package before it
      looks for the file), then a Llama-2-style HF tokenizer, then byte-level BPE. Our
      checkpoint has no tokenizer.model: the replacement raises the FileNotFoundError the
      converter itself raises then, without needing sentencepiece installed.

    The converter's own `gguf` package (gguf-py) is the one next to it in the sdist.
    """
    sys.path[:0] = [tree, str(Path(tree) / "gguf-py")]
    import conversion
    import convert_hf_to_gguf

    def no_sentencepiece_model(self):
        raise FileNotFoundError(f"{self.dir_model / 'tokenizer.model'}: none, the tokenizer is byte-level BPE")

    conversion.TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    conversion.TextModel._set_vocab_sentencepiece = no_sentencepiece_model
    sys.argv = ["convert_hf_to_gguf.py", hf_folder, "--outfile", outfile, "--outtype", outtype]
    convert_hf_to_gguf.main()


# ---- llama-server ------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process serving one GGUF; generate() runs a workload through it.

    Settings: --parallel = the workload's number of requests (every request gets a slot at
    once, as every engine here takes them all at once); -c = that many times the longest
    request (prompt + output), since llama-server splits -c evenly between its slots; the
    KV cache in the model's dtype (--cache-type-k/-v); flash attention left at
    llama.cpp's default, "auto" (on where the backend supports the KV type; at
    --log-verbosity 4 it logs its choice: flash_attention()); --threads and
    --threads-batch = the threads torch uses; batch sizes llama.cpp's defaults (-b 2048,
    -ub 512). No reuse between runs: the prompt cache in RAM is off (--cache-ram 0) and
    every request says cache_prompt false, as tinyserve runs with prefix caching off.
    """

    def __init__(self, binary: Path, gguf: Path, kv_type: str, parallel: int, context: int, threads: int,
                 log_file: Path):
        self.port = free_port()
        self.log_file = log_file
        self.command = [
            str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "--parallel", str(parallel), "--ctx-size", str(context),
            "--cache-type-k", kv_type, "--cache-type-v", kv_type,
            "--threads", str(threads), "--threads-batch", str(threads),
            "--cache-ram", "0", "--no-webui",
            "--log-verbosity", "4",  # "info" from the library too: what flash attention "auto" became
        ]
        with open(log_file, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        # trust_env=False: no proxy from the environment, straight to loopback
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600, trust_env=False,
                                   limits=httpx.Limits(max_connections=parallel))
        try:
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise

    def wait_until_ready(self, timeout: float = 120) -> None:
        """Poll /health until the model is loaded (200; 503 while loading)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_file.read_text(errors="replace")[-3000:]

    def complete(self, prompt: list[int], n_predict: int) -> list[int]:
        """One request: greedy, EOS ignored, exactly n_predict new tokens (checked); their ids."""
        body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
                "cache_prompt": False, "return_tokens": True}
        response = self.client.post("/completion", json=body)
        response.raise_for_status()
        result = response.json()
        tokens = result["tokens"]
        if len(tokens) != n_predict or result["tokens_predicted"] != n_predict:
            raise RuntimeError(f"llama-server generated {len(tokens)} tokens "
                               f"(tokens_predicted {result['tokens_predicted']}), asked for {n_predict}")
        if result["tokens_evaluated"] != len(prompt):
            raise RuntimeError(f"llama-server read {result['tokens_evaluated']} prompt tokens, sent {len(prompt)}")
        return tokens

    def generate(self, workload) -> list[list[int]]:
        """Every request of the workload at once (one thread each); the generated ids, in order."""
        with ThreadPoolExecutor(len(workload.prompts)) as pool:
            return list(pool.map(self.complete, workload.prompts, workload.output_lens))

    __call__ = generate  # a runner of compare.py: workload -> generated ids

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def flash_attention(log_file: Path) -> str:
    """What llama.cpp chose for flash attention, as its log says: the setting, then what "auto" became.

    llama_context logs "flash_attn = auto", then, resolving auto against what the
    backend supports for these tensor types, "Flash Attention enabled" (or "... not
    supported, set to disabled").
    """
    setting, outcome = "not stated in the log", None
    for line in log_file.read_text(errors="replace").splitlines():
        if re.search(r"\bflash_attn\s+=", line):
            setting = line.split("=", 1)[1].strip()
        elif "Flash Attention" in line and ("enabled" in line or "disabled" in line):
            outcome = line.split("Flash Attention", 1)[1].strip()
    return setting if outcome is None else f"{setting} -> {outcome}"


@dataclass(frozen=True)
class Setup:
    """What compare.py's llama.cpp contenders share: the binary, a GGUF per dtype, the server settings."""
    binary: Path
    ggufs: dict[str, Path]  # "f32" / "bf16" -> the checkpoint in that dtype
    parallel: int
    context: int
    threads: int
    log_dir: Path

    def server(self, dtype: str) -> LlamaServer:
        """A llama-server on the GGUF of dtype, its KV cache in the same dtype."""
        return LlamaServer(self.binary, self.ggufs[dtype], dtype, self.parallel, self.context, self.threads,
                           self.log_file(dtype))

    def log_file(self, dtype: str) -> Path:
        return self.log_dir / f"llama-server-{dtype}.log"

    def settings(self) -> str:
        return (f"--parallel {self.parallel} --ctx-size {self.context} ({self.context // self.parallel} a slot) "
                f"--threads {self.threads} --threads-batch {self.threads} --cache-ram 0 --log-verbosity 4, "
                f"--cache-type-k/-v = the weights' dtype, flash attention left to llama.cpp")


def prepare(hf_folder: str, workloads, scratch: Path, threads: int, log: Callable[[str], None] = print) -> Setup:
    """Build llama-server (or find it built), convert the checkpoint to f32 and bf16 GGUF, size the server.

    One slot per request of the workload, each slot as long as the longest request
    (prompt + output, over all the workloads), rounded up to a multiple of 256 tokens
    (llama.cpp pads a slot's length to that anyway).
    """
    binary = build(log)
    scratch.mkdir(parents=True, exist_ok=True)
    ggufs = {dtype: convert(hf_folder, scratch / f"model-{dtype}.gguf", dtype) for dtype in ("f32", "bf16")}
    parallel = len(workloads[0].prompts)
    longest = max(len(p) for p in workloads[0].prompts) + max(max(w.output_lens) for w in workloads)
    return Setup(binary, ggufs, parallel, parallel * 256 * math.ceil(longest / 256), threads, scratch)


def version(binary: Path) -> str:
    """llama-server's own version line, e.g. "version: 0.5.0-dev (build 1, commit 0c1e570)"."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "unknown"


if __name__ == "__main__":
    if sys.argv[1:2] == ["convert"] and len(sys.argv) == 6:
        convert_main(*sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} convert LLAMA_CPP_TREE HF_FOLDER OUTFILE f32|bf16")
