"""The dtype flags (--dtype, --kv-cache-dtype): their names here, the torch dtypes on first use.

The command line builds its choices from the names without importing torch (`tinyserve
--help` answers at once); `torch_dtypes` maps them when an engine needs them.
"""

DTYPE_NAMES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# --kv-cache-dtype, as vLLM names them: "auto" stores keys and values in the model's dtype.
# A 16-bit cache under a float32 model halves the bytes a decode step reads (llama.cpp's
# default); fp8 (E4M3, or E5M2 for range) quarters them. The fp8 caches use per-tensor
# scales of 1.0, vLLM's default without a calibrated checkpoint: values are stored as they
# are, E4M3 saturating at +-448.
KV_CACHE_DTYPE_NAMES = {"auto": None, "bfloat16": "bfloat16", "float16": "float16",
                        "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def torch_dtypes(names: dict) -> dict:
    """{flag value: torch dtype, or None for "auto"} for DTYPE_NAMES or KV_CACHE_DTYPE_NAMES."""
    import torch

    return {key: None if value is None else getattr(torch, value) for key, value in names.items()}


def resolve_dtype(name: str, device, config: dict):
    """The weights' torch dtype for --dtype `name` on `device`, given the checkpoint's config.json."""
    import torch

    dtypes = torch_dtypes(DTYPE_NAMES)
    if name != "auto":
        return dtypes[name]
    if device.type != "cuda":
        return torch.float32  # CPU default: exact parity with transformers' fp32 reference
    checkpoint = config.get("dtype") or config.get("torch_dtype") or "float32"
    return dtypes.get(checkpoint, torch.float32) or torch.float32
