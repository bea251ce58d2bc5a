"""The offline API: `LLM(model).generate(prompts, sampling_params)`, as in vLLM.

Everything runs in this process, through the same front end as the server: prompts
are rendered and tokenized (stage ②), validated and fanned out by the input
processor, registered with the output processor (stage ③), and an LLMEngine steps
its in-process engine until every request is done, the output processor (stage ⑧)
turning token ids back into text.
"""

import atexit
import contextlib
import itertools
from dataclasses import asdict
from pathlib import Path

import msgspec
from tqdm.auto import tqdm

from tinyserve import assemble
from tinyserve.config import ModelInfo
from tinyserve.frontend.input_processor import ProcessedPrompt
from tinyserve.frontend.llm_engine import LLMEngine
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import start_request_spans
from tinyserve.lora.request import lora_requests_per_prompt
from tinyserve.lifecycle.tracing import (
    flush_tracing,
    keep_images_in,
    new_run_dir,
    setup_tracing,
    shutdown_tracing,
    trace_cap_bytes,
    tracing_enabled,
    write_manifest,
)
from tinyserve.models.fingerprint import manifest_fingerprint
from tinyserve.models.tokenizer import load_tokenizer
from tinyserve.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from tinyserve.pooling_params import PoolingParams
from tinyserve.sampling_params import SamplingParams

_PROGRESS_BAR_MIN_PROMPTS = 8


class LLM:
    """Offline generation. `trace_dir` writes a traced run folder (offline.jsonl) there, capped
    at about `trace_max_mb` if given (oldest steps dropped first); `otlp_endpoint` exports the
    same spans over OTLP/HTTP."""

    def __init__(self, model: str | None = None, *, trace_dir: str | None = None, otlp_endpoint: str | None = None,
                 trace_max_mb: float | None = None, **engine_args) -> None:
        self.engine_args = assemble.engine_args(model=model, **engine_args)  # checked, the layers' flags too
        self.model_name = model or "tinyserve-default"
        self.model_info = ModelInfo.from_args(self.engine_args)
        self.trace_run_dir = self._start_tracing(trace_dir, otlp_endpoint, trace_max_mb)
        self.tokenizer = load_tokenizer(self.model_info.path)
        # Traced (here or by an LLM before): each sampled request without a seed gets one, so the run replays.
        self.llm_engine = LLMEngine(self.engine_args, self.model_info, self.tokenizer,
                                    seed_unseeded=tracing_enabled())
        self.input_processor = self.llm_engine.input_processor
        self._request_counter = itertools.count()

    @property
    def engine_core(self):
        """The in-process engine (scheduler, KV cache, model runner), for looking inside."""
        return self.llm_engine.engine_core

    def shutdown(self) -> None:
        """Stop the engine: its tensor-parallel worker processes end, its process group goes.
        Only a tensor-parallel LLM holds anything an interpreter's exit would not free."""
        self.llm_engine.shutdown()

    def get_metrics(self) -> list:
        """vLLM's LLM.get_metrics(): metric objects, each with a `name` and labels and a `value` (counters)
        or `values` (vectors); here speculative decoding's counters (spec_decode/metrics.py), under the
        `tinyserve:` prefix. Empty for an engine without --speculative-config."""
        from tinyserve.entrypoints.api.metrics import DEFAULT_METRICS_PREFIX
        from tinyserve.spec_decode.metrics import spec_decode_metrics

        stats = self.engine_core.get_stats().spec_decoding_stats
        if stats is None:
            return []
        return spec_decode_metrics(DEFAULT_METRICS_PREFIX, stats, {"model_name": self.model_name, "engine": "0"})

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: SamplingParams' defaults, with
        whatever the model's generation_config.json sets (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens), as vLLM's generation_config="auto"."""
        return SamplingParams(**self.model_info.generation_defaults)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, token-id dicts {"prompt_token_ids": [...]}, or a mix.

        A flat list of ints is one prompt of token ids; an empty list gives an empty list.
        lora_request: a LoRARequest (tinyserve.lora.request) for every prompt, or a list of one per
        prompt (None: the base model), with enable_lora=True, as vLLM's.
        """
        prompts = self._prompt_list(prompts)
        if not prompts:
            return []
        return self._run(prompts, self.input_processor.tokenize_prompt, schema.OPERATION_TEXT_COMPLETION,
                         self._params_per_prompt(sampling_params, len(prompts)), use_tqdm, lora_request)

    def encode(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = True, *,
               pooling_task: str = "embed") -> list[PoolingRequestOutput]:
        """A vector per prompt, from a pooling model (`LLM(model, runner="pooling")`), as vLLM's LLM.encode.

        prompts: as generate's; pooling_params: a PoolingParams or a dict of its fields (as a trace logs them).
        Each request is one pass over its prompt and done (engine/core/pooling_scheduler.py).
        """
        prompts = self._prompt_list(prompts)
        if not prompts:
            return []
        params = pooling_params or PoolingParams(task=pooling_task)
        if isinstance(params, dict):
            params = PoolingParams(**{"task": pooling_task, **params})
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        return self._run(prompts, self.input_processor.tokenize_prompt, schema.OPERATION_EMBEDDINGS,
                         [params] * len(prompts), use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeddings of the prompts (`output.outputs.embedding`, a list of floats), as vLLM's LLM.embed.

        The server's --pooler-config decides how (default: the last token's hidden state, L2-normalised)."""
        return [EmbeddingRequestOutput.from_base(output)
                for output in self.encode(prompts, pooling_params, use_tqdm, pooling_task="embed")]

    @staticmethod
    def _prompt_list(prompts) -> list:
        """prompts as a list: a string, a dict or a flat list of token ids is one prompt."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a string, a prompt dict, a list of token ids, or a list of them")
        return [list(p) if isinstance(p, tuple) else p for p in prompts]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             lora_request=None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of conversations.

        continue_final_message=True (with add_generation_prompt=False): each reply continues the
        conversation's last message, as in vLLM's LLM.chat. chat_template_kwargs are passed to
        the template (enable_thinking=False, say); so are tools, OpenAI-style function tools the
        template shows the model (to constrain a call, use SamplingParams.structured_outputs).
        """
        conversations = messages if messages and isinstance(messages[0], list) else [messages]

        def render(conversation) -> ProcessedPrompt:
            return self.input_processor.tokenize_chat(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                template_kwargs=chat_template_kwargs, tools=tools,
            )

        return self._run(conversations, render, schema.OPERATION_CHAT,
                         self._params_per_prompt(sampling_params, len(conversations)), use_tqdm, lora_request)

    def _run(self, prompts: list, render, operation: str, params: list, use_tqdm: bool, lora_request=None) -> list:
        """Render, check and queue every prompt (params: one per prompt), then step until all are done."""
        order = self._queue(prompts, render, operation, params, lora_requests_per_prompt(lora_request, len(prompts)))
        engine = self.llm_engine
        try:
            return self._run_engine(order, use_tqdm and len(order) >= _PROGRESS_BAR_MIN_PROMPTS)
        except BaseException:
            # Interrupted (Ctrl-C in a notebook) or failed: abort what this call queued, so its
            # KV blocks are freed and the next call starts from an idle engine.
            engine.abort_request(list(order))
            raise
        finally:  # even when interrupted: the steps that ran are in the trace file
            if self.trace_run_dir is not None or tracing_enabled():
                engine.flush_spans()
                flush_tracing()

    def _queue(self, prompts: list, render, operation: str, params: list, loras: list) -> dict[str, int]:
        """Render and check every prompt, then queue them all; request id -> its index.

        Every request is built and checked before the first one is queued: one bad prompt
        rejects the call and leaves the engine untouched. Each request's spans are registered
        under its id (engine.observers) until it is queued, so the front end finds them.
        """
        engine = self.llm_engine
        opened, made = [], []  # every request's spans; (id, params, prompt, engine requests)
        with contextlib.ExitStack() as observing:
            try:
                for raw_prompt, p, lora in zip(prompts, params, loras):
                    request_id = str(next(self._request_counter))
                    spans = start_request_spans(operation, self.model_name, request_id)
                    opened.append(spans)
                    observing.enter_context(engine.observers.observing(request_id, spans))
                    p = engine.input_processor.seeded(p)  # a traced LLM: a sampled request without a seed gets one
                    with spans.stage(schema.RENDER) as render_span:
                        prompt = render(raw_prompt)
                        messages = raw_prompt if operation == schema.OPERATION_CHAT else None
                        spans.log_inputs(render_span, prompt=prompt.prompt, prompt_token_ids=prompt.prompt_token_ids,
                                         sampling_params=p, messages=messages, mm_features=prompt.mm_features)
                        spans.log_lora(lora, render_span)
                    made.append((request_id, p, prompt, engine.make_requests(request_id, prompt, p, lora_request=lora)))
            except Exception as error:
                for spans in opened:
                    spans.fail(error)
                raise
            for request_id, p, prompt, requests in made:
                engine.add_request(request_id, prompt, p, requests)
        return {request_id: index for index, (request_id, *_) in enumerate(made)}

    def _start_tracing(self, trace_dir: str | None, otlp_endpoint: str | None,
                       trace_max_mb: float | None) -> Path | None:
        max_bytes = trace_cap_bytes(trace_max_mb)
        if trace_dir is None and otlp_endpoint is None:
            return None
        run_dir = new_run_dir(trace_dir) if trace_dir is not None else None
        if run_dir is not None:
            write_manifest(run_dir, model=self.engine_args.model, served_model_name=self.model_name,
                           engine_args=asdict(self.engine_args), data_parallel_size=1,
                           model_fingerprint=manifest_fingerprint(self.model_info.path), trace_max_mb=trace_max_mb)
        # Export when the engine flushes its spans (every few hundred steps and at the end
        # of generate), in this thread: not on a timer, from a thread competing with the model.
        setup_tracing(schema.SERVICE_OFFLINE, run_dir / schema.OFFLINE_TRACE_FILE if run_dir else None, otlp_endpoint,
                      export_every_ms=60_000, max_bytes=max_bytes)
        keep_images_in(run_dir)
        atexit.register(shutdown_tracing)
        return run_dir

    def _run_engine(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        progress = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        while self.llm_engine.has_unfinished_requests:
            request_outputs = self.llm_engine.step()
            finished += request_outputs
            progress.update(len(request_outputs))
        progress.close()
        return sorted(finished, key=lambda output: order[output.request_id])

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        """One SamplingParams for each prompt. A dict is taken as SamplingParams' fields (as a trace logs them)."""
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, dict):
            try:
                sampling_params = msgspec.convert(sampling_params, SamplingParams)
            except msgspec.ValidationError as error:
                raise ValueError(f"sampling_params: {error}") from None
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if isinstance(sampling_params, list) and len(sampling_params) == count:
            return [self._params_per_prompt(p, 1)[0] for p in sampling_params]
        raise ValueError(f"sampling_params must be one SamplingParams (or dict of its fields) or a list of {count} "
                         "(one per prompt)")
