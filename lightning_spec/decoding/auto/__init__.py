"""Decoding chosen from measured costs: plain, n-gram lookup, the drafter's chain or one of its trees (with or
without n-gram candidates), whichever is expected to give the most tokens per second on this machine, picked over
plain decoding only when it is sure enough to be faster.

A plan's speed is tokens per round over seconds per round, and both are measured, not assumed:
- tokens per round: the plan's rounds scored exactly on calibration outputs, the target's own answers to a few
  prompts (``decoding.exact``: ``replay_tree_rounds`` replays every round and gives its size, so proposals whose size
  varies, such as n-gram lookups that find nothing, are costed round by round; drawn chains under sampling are
  scored from one teacher-forced forward, ``decoding.exact.score_outputs``);
- seconds per round: the proposal's time plus the target's verify forward over the anchor and the proposal's nodes,
  both timed on this machine against a warm KV cache (``measure_costs``; the target's times are kept for the
  process, per machine, dtype, thread count and target), plus the loop's own bookkeeping per round, measured as
  what a timed decode spent beyond those (``round_overhead``: plain decoding's from the calibration decodes, a
  speculative plan's from one decode of a calibration prompt with it); each prompt's prefill is added once.
Each plan is estimated per calibration prompt; its expected tokens/s is Σ tokens / Σ seconds over them.

Plain decoding is one of the plans and the judge: another plan is picked only when the one-sided lower
confidence bound of its pooled speedup over plain, Σ plain seconds / Σ its seconds (``speedup_bound``: a t
interval on the log of that ratio by the delta method, paired over prompts because every plan is scored on the
same outputs) exceeds 1 + ``margin``. Picking the best of many plans is held to a 5% error as a whole
(``decide``): from 4 calibration prompts the candidate is the plan with the highest bound on every other prompt,
and it is picked only if its bound on the remaining prompts, which did not choose it, clears the margin; with
fewer prompts the bounds of all m plans hold together (Šidák, ``family_confidence``). The best of twenty bounds
each at 95% would pick a plan no faster than plain in 13-16% of runs. A point estimate would take whatever the
calibration prompts happened to favour: two of them whose answers repeated themselves made an n-gram trie look
1.42x faster, and it measured 0.69x on other prompts.
One calibration prompt gives no bound, so it keeps plain decoding.

What the estimate still leaves out: the cache's growth over an answer (verify times are taken at one context
length; the measured per-round residual absorbs it only for plain and the plans decoded to measure it), the
bookkeeping of speculative plans not decoded (they take the largest measured), and prompts unlike the
calibration ones. ``benchmarks/decode_speed.py`` reports measured over expected as engine efficiency.

One job a file: ``candidates.py`` (the plans compared), ``costs.py`` (what a round costs here), ``estimate.py`` (a
plan's rounds and seconds per calibration prompt), ``judge.py`` (the bounds, from ``lightning_spec/paired.py``, and
the pick), ``choice.py`` (``choose_decoding`` and its ``Choice``).
"""

from lightning_spec.decoding.auto.candidates import PLAIN, candidates
from lightning_spec.decoding.auto.choice import PROBES, Choice, choose_decoding
from lightning_spec.decoding.auto.costs import Costs, machine_name, measure_costs, round_overhead
from lightning_spec.decoding.auto.estimate import Estimate, estimate, output_features
from lightning_spec.decoding.auto.judge import (
           CONFIDENCE,
           MARGIN,
           Verdict,
           decide,
           on_prompts,
           pick,
           speedup_bound,
           with_bounds,
)

__all__ = ["CONFIDENCE", "MARGIN", "PLAIN", "PROBES", "Choice", "Costs", "Estimate", "Verdict", "candidates",
           "choose_decoding", "decide", "estimate", "machine_name", "measure_costs", "on_prompts", "output_features",
           "pick", "round_overhead", "speedup_bound", "with_bounds"]
