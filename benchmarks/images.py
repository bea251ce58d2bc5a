"""Images on the built-in vision model (tinyserve-vision), offline: what an image costs, and what tracing costs.

Three measurements in one process, on one `LLM("tinyserve-vision", trace_dir=...)`:

1. **One request at a time**, max_tokens 1, so its wall time is its time to first token: an image
   chat (256 placeholder rows and 21 text tokens), a text-only prompt of the same 277 tokens, the
   encoder's own seconds in the image request's step (the multimodal layer's last_step), and the
   processor's alone (multimodal/processor.py's process, timed apart on a picture of the same size). The
   encoder's share of TTFT is encode / image TTFT; the image's cost beyond its tokens is image
   TTFT - text TTFT (the processor in the render stage, and the encoder).
2. **A burst**: N image requests at once (16 output tokens each, greedy), every image new (fresh
   seeds each run: no encoder-cache or prefix-cache hits): image requests per second.
3. **Tracing's cost** on that burst: tracing switched off and on between runs in the same process
   (tracing_cost.py's Switchable; who goes first alternating), the median per-round ratio.

    python benchmarks/images.py [--repeats 6] [--burst 32]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tracing_cost.py and roofline.py, beside this file

from roofline import describe_machine  # noqa: E402
from tracing_cost import Switchable  # noqa: E402

from tinyserve.lifecycle import tracing  # noqa: E402

QUESTION = "<|im_start|>user\n<image>\nWhat is in this picture?<|im_end|>\n<|im_start|>assistant\n"
OUTPUT_TOKENS = 16


def picture(seed: int):
    """A picture of random pixels and a size of its own (the processor resizes each to 224x224)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = (int(x) for x in rng.integers(160, 480, 2))
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def single(llm, seed: int, params) -> tuple[float, float, float, float]:
    """(image TTFT, text TTFT, encode seconds, processor seconds) of one image request and one text request of its
    length; the processor timed apart, on another picture of the same size."""
    from tinyserve.multimodal.processor import process

    info = llm.llm_engine.model_info
    start = time.perf_counter()
    process(info.path, info.image_token_id, QUESTION, [picture(seed + 10**7)])
    process_s = time.perf_counter() - start
    start = time.perf_counter()
    [out] = llm.generate({"prompt": QUESTION, "multi_modal_data": {"image": picture(seed)}}, params, use_tqdm=False)
    image_s = time.perf_counter() - start
    encode_s = llm.llm_engine.engine_core.hooks.parts["multimodal"].last_step["encode_s"]
    text = [(seed + i) % 4000 + 10 for i in range(len(out.prompt_token_ids))]  # as many tokens, no image
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": text}, params, use_tqdm=False)
    return image_s, time.perf_counter() - start, encode_s, process_s


def main(argv: list[str] | None = None) -> int:
    from tinyserve import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6, help="rounds of the burst, each off and on (default 6)")
    parser.add_argument("--burst", type=int, default=32, help="image requests in the burst (default 32)")
    parser.add_argument("--singles", type=int, default=12, help="single requests of each kind (default 12)")
    args = parser.parse_args(argv)
    print(f"machine: {describe_machine()}")
    first_token = SamplingParams(temperature=0.0, max_tokens=1)
    burst_params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="tinyserve-images-") as tmp:
        llm = LLM("tinyserve-vision", trace_dir=os.path.join(tmp, "traces"), seed=0)
        engine = Switchable(llm)
        engine.switch(False)
        single(llm, 10**6, first_token)  # warm-up
        singles = [single(llm, 10**6 + 1 + i, first_token) for i in range(args.singles)]

        def burst(round_: int) -> list:
            return [{"prompt": QUESTION, "multi_modal_data": {"image": picture(round_ * 1000 + i)}}
                    for i in range(args.burst)]

        def run(round_: int, traced: bool) -> float:
            engine.switch(traced)
            prompts = burst(round_)  # drawn before the clock starts
            start = time.perf_counter()
            llm.generate(prompts, burst_params, use_tqdm=False)
            return time.perf_counter() - start

        run(0, True), run(1, False)  # warm-up, both ways
        times = {True: [], False: []}
        for repeat in range(args.repeats):
            for traced in ((True, False) if repeat % 2 else (False, True)):
                times[traced].append(run(2 + 2 * repeat + traced, traced))
        engine.switch(True)
        llm.shutdown()
        tracing.shutdown_tracing()

    image_ttft, text_ttft, encode, process_s = (statistics.median(column) for column in zip(*singles))
    print(f"\none request at a time, max_tokens 1 (medians of {args.singles}), tracing off:")
    print(f"  image chat (277 tokens, 256 of them the image's):  TTFT {image_ttft * 1e3:6.1f} ms, of which the encoder "
          f"{encode * 1e3:.1f} ms ({encode / image_ttft:.0%})")
    print(f"  text prompt of the same 277 tokens:                TTFT {text_ttft * 1e3:6.1f} ms "
          f"(the image's cost beyond its tokens: {(image_ttft - text_ttft) * 1e3:.1f} ms, "
          f"{image_ttft / text_ttft:.2f}x)")
    print(f"  the processor alone (resize, crop, normalise, placeholders, content hash): {process_s * 1e3:.1f} ms "
          f"({process_s / image_ttft:.0%} of the image chat's TTFT)")
    off, on = statistics.median(times[False]), statistics.median(times[True])
    ratio = statistics.median(t / p for p, t in zip(times[False], times[True]))
    print(f"\na burst of {args.burst} image requests ({OUTPUT_TOKENS} output tokens each, every image new), "
          f"{args.repeats} rounds:")
    print(f"  untraced {off:.2f} s: {args.burst / off:.1f} image requests/s, "
          f"{args.burst * OUTPUT_TOKENS / off:.0f} output tok/s")
    print(f"  traced   {on:.2f} s: {args.burst / on:.1f} image requests/s; per-round ratio traced / untraced "
          f"{ratio:.3f} (median; throughput lost {1 - 1 / ratio:.1%}); rounds "
          f"{', '.join(f'{t / p:.3f}' for p, t in zip(times[False], times[True]))}")
    print(f"\nat the end: load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
