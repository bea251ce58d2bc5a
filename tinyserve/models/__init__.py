"""Models: the Llama-family decoder (llama.py), RoPE (rope.py) and the Hugging Face loader (loader.py)."""
