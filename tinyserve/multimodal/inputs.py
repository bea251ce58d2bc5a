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

EncoderCache holds each image's rows by content hash (mm_hash), up to `max_rows` rows. What it keeps
is the scheduler's to decide (scheduling.py, vLLM's EncoderCacheManager): each step it marks the
images this step's requests need (`needed`: those they are in the middle of, and those their chunks
reach) and lets an image be encoded only while the needed ones and it fit; an image no running
request needs stays, for a later request with the same image, until room is needed (`trim` evicts
those, oldest first). So a chunk that cuts through an image always finds its rows in the next
step, and a second request with the same image reuses them.
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
        self.needed: set[str] = set()  # the scheduler's, this step: images this step's requests need
        self.queries = self.hits = 0  # vLLM's mm_cache_queries / mm_cache_hits, over the engine's life

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self.entries

    def get(self, mm_hash: str) -> torch.Tensor | None:
        self.queries += 1
        rows = self.entries.get(mm_hash)
        if rows is not None:
            self.hits += 1
            self.entries.move_to_end(mm_hash)
        return rows

    def put(self, mm_hash: str, rows: torch.Tensor) -> None:
        """Keep an image's rows; images no running request needs go, oldest first, while past max_rows."""
        self.entries[mm_hash] = rows
        self.rows += rows.shape[0]
        self.trim(keep=mm_hash)

    def trim(self, keep: str | None = None) -> None:
        """Past max_rows, images this step does not need go, oldest first (the scheduler's call at each step)."""
        for old in [h for h in self.entries if h not in self.needed and h != keep]:
            if self.rows <= self.max_rows:
                break
            self.rows -= self.entries.pop(old).shape[0]


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
            started, self.last_step["started_at"] = time.perf_counter(), time.time()
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
            self.last_step.update(encoded=len(missing), encode_s=time.perf_counter() - started,
                                  rows=sum(f.length for f in missing), hashes=[f.identifier for f in missing])
        return found
