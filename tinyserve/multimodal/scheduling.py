"""The scheduler's side of images: the encoder budget and what the encoder cache keeps (vLLM's
_try_schedule_encoder_inputs and EncoderCacheManager), one of the scheduler's token_limits.

A request computes its prompt in chunks; a chunk that reaches an image's placeholders needs the
image's rows, from the encoder cache or encoded this step. For each request the scheduler considers,
before its KV blocks are allocated, this limit walks the images its chunk [start, start + n) covers:

    already in the cache, or encoded this step for another request   → taken as it is
    not: its rows (its placeholder count) fit what is left of this step's encoder budget
         (max_num_encoder_input_tokens) and the cache's room beside the images running
         requests still need (encoder_cache_size)                   → encoded this step
    else                                                             → the chunk stops before the image

so a burst of images is spread over steps, and the text before an image still runs. An image larger
than the whole budget is encoded alone, in a step with no other image. At each step's first call the
cache is told which images running requests are in the middle of (some of their placeholders
computed, not all), and those taken this step join them: they are never evicted; the rest stay for
a later request with the same image until room is needed. (An image found in the cache is taken
whatever the room: its rows are there already, and the cache may stay past its size until the next
step's first call trims it.) A request's image it has not reached yet
holds nothing, so no request waits on room that another's future image keeps.
"""

from tinyserve.multimodal.inputs import EncoderCache


class EncoderBudget:
    """limit(request, start, num_new_tokens, scheduler) -> the tokens the request may compute this step."""

    def __init__(self, cache: EncoderCache, max_num_encoder_input_tokens: int) -> None:
        self.cache = cache
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        self._step_id = -1
        self._budget = 0  # encoder tokens left this step
        self._in_use = 0  # rows of the images requests are in the middle of, and of those taken this step
        self._encoding: set[str] = set()  # images to be encoded this step

    def __call__(self, request, start: int, num_new_tokens: int, scheduler) -> int:
        if not request.mm_features:
            return num_new_tokens
        if scheduler.step_id != self._step_id:
            self._new_step(scheduler)
        end = start + num_new_tokens
        for feature in request.mm_features:
            if feature.offset >= end:
                break
            if feature.offset + feature.length <= start:
                continue  # computed already
            if not self._take(feature):
                return max(0, feature.offset - start)  # stop before it: the text before it still runs
        return num_new_tokens

    def _new_step(self, scheduler) -> None:
        self._step_id = scheduler.step_id
        self._budget = self.max_num_encoder_input_tokens
        self._encoding = set()
        self.cache.needed = {feature.identifier for request in scheduler.running for feature in request.mm_features
                             or () if feature.offset < request.num_computed_tokens < feature.offset + feature.length}
        self.cache.trim()  # what the last step needed past the cache's size goes now
        self._in_use = sum(self.cache.entries[h].shape[0] for h in self.cache.needed if h in self.cache)

    def _take(self, feature) -> bool:
        """This image for this step: kept, or encoded if the budget and the cache's room allow."""
        mm_hash = feature.identifier
        if mm_hash in self._encoding:
            return True
        if mm_hash in self.cache:
            if mm_hash not in self.cache.needed:
                self.cache.needed.add(mm_hash)
                self._in_use += feature.length
            return True
        # An image larger than the whole budget goes in a step that encodes nothing else; one larger than the
        # cache, when the cache holds nothing a request is in the middle of.
        first = self._budget == self.max_num_encoder_input_tokens
        if feature.length > self._budget and not first:
            return False
        if self._in_use + feature.length > self.cache.max_rows and self._in_use > 0:
            return False
        self._budget -= feature.length
        self._in_use += feature.length
        self._encoding.add(mm_hash)
        self.cache.needed.add(mm_hash)
        return True
