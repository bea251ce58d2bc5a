"""Stage ②, the input processor: what the user sent becomes EngineCoreRequests.

The text is rendered and tokenized by the Renderer it extends (render.py); token ids are
taken as they are. Every input is checked here, once, before anything reaches the engine
(`make_requests`), for the offline LLM and the server alike; an n > 1 request fans out
here into n engine requests.
"""

import logging
import secrets
import time

from tinyserve.config import ModelInfo, check_kv_fit
from tinyserve.distributed.kv_transfer.config import KVTransferConfig
from tinyserve.distributed.kv_transfer.params import check_kv_transfer_params
from tinyserve.errors import InvalidInputError
from tinyserve.frontend.render import ProcessedPrompt, Renderer
from tinyserve.pooling_params import POOLING_SAMPLING_PARAMS, PoolingParams
from tinyserve.lora.registry import LoRAChecker
from tinyserve.lora_request import LoRARequest
from tinyserve.multimodal.media import MediaConnector
from tinyserve.wire.messages import EngineCoreRequest, ReasoningEnd
from tinyserve.sampling_params import SamplingParams
from tinyserve.structured_output import check_structured_outputs

logger = logging.getLogger("tinyserve.requests")
_LOG_PROMPT_CHARS = 200
_LOG_PROMPT_TOKENS = 40


class InputProcessor(Renderer):
    """The render stage (render.py) plus the checks of everything else a request carries."""

    @classmethod
    def from_engine_args(cls, model_info: ModelInfo, tokenizer, args, *,
                         seed_unseeded: bool = False) -> "InputProcessor":
        return cls(model_info, tokenizer, args.block_size, args.max_logprobs, args.scheduling_policy,
                   args.structured_outputs_backend, args.runner, LoRAChecker.from_engine_args(model_info.path, args),
                   speculative=args.speculative_config is not None,
                   kv_transfer=KVTransferConfig.from_dict(args.kv_transfer_config)
                   if args.kv_transfer_config is not None else None, seed_unseeded=seed_unseeded,
                   enable_prompt_embeds=args.enable_prompt_embeds,
                   limit_images_per_prompt=(args.limit_mm_per_prompt or {}).get("image"),
                   media=MediaConnector(args.allowed_local_media_path, tuple(args.allowed_media_domains or ())),
                   content_format=args.chat_template_content_format)

    def __init__(self, model_info: ModelInfo, tokenizer, block_size: int, max_logprobs: int = 20,
                 scheduling_policy: str = "fcfs", structured_outputs_backend: str = "xgrammar",
                 runner: str = "generate", lora_checker: LoRAChecker | None = None, speculative: bool = False,
                 kv_transfer: KVTransferConfig | None = None, seed_unseeded: bool = False,
                 enable_prompt_embeds: bool = False, limit_images_per_prompt: int | None = None,
                 media=None, content_format: str = "auto") -> None:
        """max_logprobs: the most logprobs or prompt_logprobs a request may ask for (vLLM's flag, default 20).
        scheduling_policy: the engine's; a request's priority means something only under "priority".
        structured_outputs_backend: the engine's grammar library (it must compile a request's constraint).
        runner: the engine's (EngineArgs.runner): "generate" takes SamplingParams, "pooling" PoolingParams.
        seed_unseeded: a traced run's (`serve --trace`, a traced LLM): see `seeded`.
        enable_prompt_embeds: the engine's (--enable-prompt-embeds): prompts may come as embeddings (render.py).
        limit_images_per_prompt: the engine's --limit-mm-per-prompt "image" (render.py's images_prompt).
        media: where a chat's image URLs may be read from (tinyserve/multimodal/media.py).
        content_format: the engine's --chat-template-content-format (render.py's Renderer)."""
        super().__init__(model_info, tokenizer, enable_prompt_embeds=enable_prompt_embeds,
                         limit_images_per_prompt=limit_images_per_prompt, media=media, content_format=content_format)
        self.runner = runner
        self.structured_outputs_backend = structured_outputs_backend
        self.scheduling_policy = scheduling_policy
        self.block_size = block_size
        self.max_logprobs = max_logprobs
        # A request's LoRA adapter, checked against the engine's settings (tinyserve/lora/registry.py).
        self.lora_checker = lora_checker or LoRAChecker(model_info.path, enable_lora=False, max_lora_rank=0)
        self.speculative = speculative  # --speculative-config: structured outputs are refused (spec_decode/)
        self.kv_transfer = kv_transfer  # --kv-transfer-config's: kv_transfer_params are served (distributed/)
        self.seed_unseeded = seed_unseeded
        if seed_unseeded:
            logging.getLogger("tinyserve").info("tracing: each sampled request without a seed gets a random one, "
                                                "logged in its trace, so that the run replays")

    def seeded(self, params):
        """The params to run with: with seed_unseeded, a sampled request without a seed gets a random 63-bit one.

        A traced run must replay from its trace, which logs the params. A seed drawn at random gives
        the same distribution as no seed, and the trace then holds the seed that produced the output.
        Greedy, seeded and pooling requests are left as they are (nothing else is drawn at random).
        """
        if (not self.seed_unseeded or isinstance(params, PoolingParams) or params.is_greedy
                or params.seed is not None):
            return params
        return params.clone(seed=secrets.randbits(63))

    def check_extra_args(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """SamplingParams.extra_args: kv_transfer_params alone, and only where a KV connector serves them (the
        engine checks their fields against its role); never silently ignored."""
        extra_args = params.extra_args or {}
        unknown = sorted(set(extra_args) - {"kv_transfer_params"})
        if unknown:
            raise InvalidInputError(f"extra_args: unknown key(s) {unknown}; known: ['kv_transfer_params']", "extra_args")
        if extra_args.get("kv_transfer_params") is None:
            return
        if not self.kv_transfer:
            raise InvalidInputError("kv_transfer_params needs an engine started with --kv-transfer-config "
                                    "(disaggregated prefill)", "kv_transfer_params")
        if params.n != 1:
            raise InvalidInputError("kv_transfer_params are for one sample (n=1): one prefill hands its K/V to one "
                                    "decode", "kv_transfer_params")
        check_kv_transfer_params(self.kv_transfer, self.block_size, prompt_token_ids, params)

    def check_structured_outputs(self, structured_outputs) -> None:
        """A constraint the grammar library cannot compile is a 400; so is any under speculative decoding."""
        if self.speculative:
            raise InvalidInputError("structured outputs are not supported with speculative decoding "
                                    "(--speculative-config)", "structured_outputs")
        check_structured_outputs(structured_outputs, self.structured_outputs_backend)

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        sampling_params: SamplingParams,
        *,
        num_kv_blocks: int,
        arrival_time: float | None = None,
        priority: int = 0,
        trace_context: dict[str, str] | None = None,
        lora_request: LoRARequest | None = None,
        reasoning_end: ReasoningEnd | None = None,
    ) -> list[EngineCoreRequest]:
        """Check the request, then fan it out: one EngineCoreRequest per sample (n > 1 → n of them).

        This is the one place a request is validated, for the offline LLM and the server
        alike: the prompt against the vocabulary and max_model_len, token ids in the
        sampling parameters (bad_words tokenized first), and whether the request could
        ever fit in the KV pool of `num_kv_blocks` blocks. Child i of an n > 1 request gets `child_request_id(...)`
        and, if seeded, the seed + i, so the n samples differ yet each is reproducible. reasoning_end: where a
        constraint starts, given by a reasoning parser (wire/messages.py's ReasoningEnd); None: at the first token.
        """
        self.check_runner(sampling_params)
        self.model_info.validate_prompt(prompt.prompt_token_ids)
        self.lora_checker.check(lora_request)  # an adapter this engine can serve (a pooling one serves none)
        if isinstance(sampling_params, PoolingParams):
            return [self._pooling_request(request_id, prompt, sampling_params, num_kv_blocks=num_kv_blocks,
                                          arrival_time=arrival_time, priority=priority, trace_context=trace_context)]
        if priority != 0 and self.scheduling_policy != "priority":  # as vLLM: never silently ignored
            raise InvalidInputError(f"priority={priority} needs --scheduling-policy priority; this engine schedules "
                                    f"{self.scheduling_policy!r}", "priority")
        self.check_embeds_params(prompt, sampling_params)
        self.check_extra_args(prompt.prompt_token_ids, sampling_params)
        sampling_params = self.resolve_bad_words(sampling_params)
        self.check_token_ids(sampling_params)
        sampling_params = self.resolve_logprobs(sampling_params)
        if sampling_params.structured_outputs is not None:
            self.check_structured_outputs(sampling_params.structured_outputs)
        check_kv_fit(len(prompt.prompt_token_ids), sampling_params.max_tokens, self.model_info.max_model_len,
                     self.block_size, num_kv_blocks)
        arrival_time = arrival_time if arrival_time is not None else time.time()
        n = sampling_params.n
        return [
            EngineCoreRequest(
                request_id=child_request_id(request_id, index, n),
                prompt_token_ids=prompt.prompt_token_ids,
                sampling_params=sampling_params if n == 1 else sampling_params.clone(
                    n=1, seed=child_seed(sampling_params.seed, index)),
                eos_token_ids=self.model_info.eos_token_ids,
                arrival_time=arrival_time,
                priority=priority,
                trace_context=trace_context or {},
                lora_request=lora_request,
                reasoning_end=reasoning_end if sampling_params.structured_outputs is not None else None,
                prompt_embeds=prompt.prompt_embeds, mm_features=prompt.mm_features,
            )
            for index in range(n)
        ]

    @staticmethod
    def check_embeds_params(prompt: ProcessedPrompt, sampling_params: SamplingParams) -> None:
        """A prompt given as embeddings has no tokens to score: prompt_logprobs is a 400, as in vLLM."""
        if prompt.prompt_embeds is not None and sampling_params.prompt_logprobs is not None:
            raise InvalidInputError("prompt_logprobs is not compatible with prompt embeds: the prompt has no tokens "
                                    "to score", "prompt_logprobs")

    def check_runner(self, params) -> None:
        """SamplingParams for a generating engine, PoolingParams for a pooling one; else a 400 saying which this is."""
        if isinstance(params, PoolingParams) and self.runner != "pooling":
            raise InvalidInputError("this model is served as a generative model (it generates text), not a pooling "
                                    "(embedding) model; serve it with --runner pooling (or --convert embed) to "
                                    "compute embeddings", "model")
        if not isinstance(params, PoolingParams) and self.runner == "pooling":
            raise InvalidInputError("this model is served as a pooling (embedding) model (--runner pooling): it "
                                    "computes embeddings (/v1/embeddings, /pooling, LLM.embed), it does not "
                                    "generate text", "model")

    def _pooling_request(self, request_id: str, prompt: ProcessedPrompt, pooling_params: PoolingParams, *,
                         num_kv_blocks: int, arrival_time: float | None, priority: int,
                         trace_context: dict[str, str] | None) -> EngineCoreRequest:
        """A pooling request: its prompt must fit the KV pool; one engine request, nothing to sample."""
        if prompt.mm_features:
            raise InvalidInputError("a pooling request takes no images yet", "multi_modal_data")
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidInputError(f"priority={priority} needs --scheduling-policy priority; this engine schedules "
                                    f"{self.scheduling_policy!r}", "priority")
        check_kv_fit(len(prompt.prompt_token_ids), POOLING_SAMPLING_PARAMS.max_tokens, self.model_info.max_model_len,
                     self.block_size, num_kv_blocks)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt.prompt_token_ids,
            sampling_params=POOLING_SAMPLING_PARAMS,
            eos_token_ids=self.model_info.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            trace_context=trace_context or {},
            pooling_params=pooling_params,
            prompt_embeds=prompt.prompt_embeds,
        )

    def resolve_bad_words(self, sampling_params: SamplingParams) -> SamplingParams:
        """bad_words tokenized by this tokenizer (SamplingParams.update_from_tokenizer), on a copy: the
        caller's SamplingParams may serve other prompts."""
        if not sampling_params.bad_words:
            return sampling_params
        resolved = sampling_params.clone()
        resolved.update_from_tokenizer(self.tokenizer)
        return resolved

    def check_token_ids(self, sampling_params: SamplingParams) -> None:
        """Every token id a request names is in the vocabulary; those outside it are named, all of them (as vLLM)."""
        for name, token_ids in (("stop_token_ids", sampling_params.stop_token_ids),
                                ("logit_bias", sampling_params.logit_bias),
                                ("allowed_token_ids", sampling_params.allowed_token_ids),
                                ("logprob_token_ids", sampling_params.logprob_token_ids),
                                ("bad_words", [t for word in sampling_params.bad_words_token_ids or () for t in word])):
            outside = [token_id for token_id in token_ids or () if not 0 <= token_id < self.model_info.vocab_size]
            if outside:
                raise InvalidInputError(f"{name} contains {', '.join(map(str, outside[:20]))}"
                                        f"{' ...' if len(outside) > 20 else ''}, outside the vocabulary "
                                        f"[0, {self.model_info.vocab_size})", name)

    def resolve_logprobs(self, sampling_params: SamplingParams) -> SamplingParams:
        """logprobs and prompt_logprobs checked against --max-logprobs, -1 (vLLM's "the whole vocabulary")
        made the vocabulary's size; --max-logprobs -1 allows the whole vocabulary."""
        vocab_size = self.model_info.vocab_size
        limit = vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)
        resolved = {}
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(sampling_params, name)
            asked = vocab_size if value == -1 else value
            if asked is not None and asked > limit:
                whole = " (-1: the whole vocabulary)" if value == -1 else ""
                raise InvalidInputError(f"{name}={value}{whole} is more than the most this engine returns, {limit} "
                                        f"(--max-logprobs {self.max_logprobs}, vocabulary {vocab_size})", name)
            if value == -1:
                resolved[name] = vocab_size
        return sampling_params.clone(**resolved) if resolved else sampling_params


def child_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: seed + index, wrapped around within the 64-bit range every seed may take."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """The engine's id for sample `index` of a request: the request's own id when n == 1."""
    return parent_id if n == 1 else f"{index}_{parent_id}"


def log_inputs(request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> None:
    """One line per request with what it asked for (prompt and ids truncated), as vLLM logs."""
    text = None if prompt.prompt is None else prompt.prompt[:_LOG_PROMPT_CHARS]
    logger.info(
        "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s (%d tokens)",
        request_id, text, params, prompt.prompt_token_ids[:_LOG_PROMPT_TOKENS], len(prompt.prompt_token_ids),
    )
