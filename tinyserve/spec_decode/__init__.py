"""Speculative decoding (vLLM's --speculative-config): guess several tokens, check them in one pass.

    propose   drafts of the next k tokens, cheaply: ngram_proposer.py (the request's own text),
              draft_model_proposer.py (a small model with the target's vocabulary)
    verify    one target forward pass over the newest token and the drafts: k + 1 sets of logits
    accept    the drafts the target agrees with, and one token of its own (rejection_sampler.py)

Greedy requests get exactly the tokens of one-token-a-step decoding; sampled ones exactly the
target's distribution. The engine's step is unchanged: the layer plugs in through
SpecDecodeScheduler, SpecDecodeModelRunner and hooks (layer.py; docs/design.md).
"""
