"""sglang-adatree: adaptive tree speculative decoding for SGLang.

Glossary (the same words are used in code, database columns, API fields and chart labels):

* shape: ``(steps, topk, num_draft_tokens)`` of a draft tree. ``steps`` is the number of draft
  forward passes (the tree's depth), ``topk`` the branching factor of each expansion and
  ``num_draft_tokens`` the number of tree nodes the target verifies, the root included.
  ``steps = 0`` means no speculation.
* envelope: the largest shape over the candidate set; memory is sized for it.
* draft tokens: tokens proposed by the draft model for one verify step.
* accepted tokens: draft tokens the target agrees with (greedy: equal to its argmax after the
  same prefix; sampling: accepted by speculative sampling).
* bonus token: the token the target itself contributes after the last accepted draft token.
* emitted tokens: tokens a request gains in one verify step = accepted draft tokens + 1 bonus.
* acceptance length: mean emitted tokens per request per verify step.
* goodput: emitted tokens per second of step time (batch total).
* decision source: why a shape was chosen: ``pin``, ``model``, ``fallback``, ``explore``,
  ``probe`` (a new batch speculating at a predicted loss for what it measures), ``warmup``,
  ``catch-up`` (the draft's extend before speculating again).
* policy version: one trained cost model + acceptance prior, stored with its validation metrics.
"""

__version__ = "0.1.0"
