"""The model runner's side of images: each image's rows at its placeholder positions, through an encoder cache.

The runner flattens a step's batch (engine/worker/model_runner.py); an image's placeholder tokens are
ordinary positions of its request's prompt, all the same id. This hook, one of the runner's
embeds_hooks, finds the placeholder positions this step computes, gets each image's rows from the
encoder cache (running the image encoder, vision.py, once for the images not in it), and writes them
over the looked-up rows:

    batch:          A (prompt 0-9: text 0-2, image 3-7, text 8-9)      B (decode)
    input_ids:      t0 t1 t2 P  P  P  P  P  t8 t9                      b9          (P: the image token)
    inputs_embeds:  E  E  E  i0 i1 i2 i3 i4 E  E                       E[b9]       (i: the image's rows)

A chunk that cuts through a placeholder run writes the part of the image it covers; the next chunk
finds the image's rows in the cache and writes the rest, without encoding it again.

EncoderCache is vLLM's encoder cache in its simplest form: an image's rows by content hash (mm_hash),
least recently used first out past `max_rows`. A second request with the same image reuses them; an
image evicted between two chunks is encoded again (the same rows).
"""

import collections
import time

import numpy as np
import torch


class EncoderCache:
    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.entries: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self.rows = 0
        self.queries = self.hits = 0  # vLLM's mm_cache_queries / mm_cache_hits, over the engine's life

    def get(self, mm_hash: str) -> torch.Tensor | None:
        self.queries += 1
        rows = self.entries.get(mm_hash)
        if rows is not None:
            self.hits += 1
            self.entries.move_to_end(mm_hash)
        return rows

    def put(self, mm_hash: str, rows: torch.Tensor) -> None:
        self.entries[mm_hash] = rows
        self.rows += rows.shape[0]
        while self.rows > self.max_rows and len(self.entries) > 1:
            _, evicted = self.entries.popitem(last=False)
            self.rows -= evicted.shape[0]


class ImageInputs:
    def __init__(self, model, encoder, cache: EncoderCache) -> None:
        self.model, self.encoder, self.cache = model, encoder, cache
        self.last_step = {"encoded": 0, "hits": 0, "encode_s": 0.0}  # what the step span says (layer.py)

    def __call__(self, scheduled_requests, states, input_ids: torch.Tensor,
                 rows: torch.Tensor | None) -> torch.Tensor | None:
        pieces = []  # (flat index of the first row, the feature, its rows [first, last))
        flat = 0
        for scheduled, state in zip(scheduled_requests, states):
            start, end = scheduled.num_computed_tokens, scheduled.num_computed_tokens + scheduled.num_new_tokens
            for feature in state.mm_features or ():
                first, last = max(start, feature.offset), min(end, feature.offset + feature.length)
                if first < last:
                    pieces.append((flat + first - start, feature, first - feature.offset, last - feature.offset))
            flat += scheduled.num_new_tokens
        self.last_step = {"encoded": 0, "hits": 0, "encode_s": 0.0}
        if not pieces:
            return rows
        if rows is None:
            rows = self.model.embed_tokens(input_ids)
        images = self._rows_of({feature.identifier: feature for _, feature, _, _ in pieces}, rows.device)
        for at, feature, first, last in pieces:
            rows[at:at + last - first] = images[feature.identifier][first:last].to(rows.dtype)
        return rows

    def _rows_of(self, features: dict, device: torch.device) -> dict[str, torch.Tensor]:
        """Each image's rows [length, hidden]: from the cache, or encoded now, the missing ones in one batch."""
        found = {mm_hash: self.cache.get(mm_hash) for mm_hash in features}
        missing = [features[mm_hash] for mm_hash, rows in found.items() if rows is None]
        self.last_step["hits"] = len(features) - len(missing)
        if missing:
            started = time.perf_counter()
            pixels = torch.stack([torch.from_numpy(np.frombuffer(f.pixel_values, np.float32).reshape(f.shape).copy())
                                  for f in missing]).to(device)
            with torch.no_grad():
                encoded = self.encoder(pixels)
            for feature, rows in zip(missing, encoded):
                if rows.shape[0] != feature.length:
                    raise ValueError(f"image {feature.identifier[:12]} gives {rows.shape[0]} rows for "
                                     f"{feature.length} placeholder tokens")
                found[feature.identifier] = rows
                self.cache.put(feature.identifier, rows)
            self.last_step.update(encoded=len(missing), encode_s=time.perf_counter() - started)
        return found
