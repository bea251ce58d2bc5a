"""LoRA adapters over HTTP, as vLLM serves them: listed in /v1/models, loaded and unloaded at run time.

    GET  /v1/models                    the base model, then each adapter: {"id": name, "root": its path,
                                       "parent": the base model's served name}
    POST /v1/load_lora_adapter         {"lora_name": "sql", "lora_path": "/adapters/sql"}   200 text
    POST /v1/unload_lora_adapter       {"lora_name": "sql"}                                  200 text

The two runtime routes exist only when TINYSERVE_ALLOW_RUNTIME_LORA_UPDATING (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) is true: anyone who can reach the server could otherwise
make it read files from its disk. An adapter is checked when it is loaded (its config,
rank and shapes: 400 naming what is wrong), so a request naming it never fails for that.
Unloading stops new requests from naming it (404 from then on); those already running
finish under it, and each engine lets go of its weights.
"""

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tinyserve.entrypoints.api.errors import APIError
from tinyserve.errors import InvalidInputError
from tinyserve.lora.registry import runtime_lora_updating_allowed


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def lora_model_cards(ctx, base_card: dict) -> list[dict]:
    """A /v1/models card for each adapter: the base model's, with the adapter's id, root and parent."""
    if ctx.loras is None:
        return []
    return [base_card | {"id": name, "root": lora.lora_path, "parent": ctx.model_names[0]}
            for name, lora in ctx.loras.adapters.items()]


def add_lora_routes(app: FastAPI, ctx) -> None:
    if not runtime_lora_updating_allowed():
        return

    def registry():
        if ctx.loras is None:
            raise APIError(400, "LoRA is not enabled on this server (--enable-lora)", "lora_name")
        return ctx.loras

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        loras = registry()
        if body.lora_name in loras.adapters:
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        try:
            loras.add(body.lora_name, body.lora_path)
        except InvalidInputError as error:
            raise APIError(400, str(error), error.param) from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        loras = registry()
        lora = loras.get(body.lora_name)
        if lora is None or body.lora_int_id not in (None, lora.lora_int_id):
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name")
        try:
            loras.remove(body.lora_name)
        except KeyError:  # unloaded meanwhile, through another API process
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name") from None
        for engine_index in ctx.engine.live_engine_indices:
            await ctx.engine.client.call_utility("remove_lora", lora.lora_int_id, engine_index=engine_index)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
