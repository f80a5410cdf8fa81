"""Decoding: how a drafter's proposals are verified (verify.py, proposals.py, trees.py, the ``Proposer`` contract in
proposer.py), the one loop every drafter uses (engine.py), how to decode as one value (plans.py) and the policy
that chooses it (auto/); the exact rounds of known outputs (rounds.py, exact.py) and a prompt set decoded and timed
(timed.py). Deploy-time adaptation, which also trains its drafter, is ``lightning_spec/adaptation.py``."""

from lightning_spec.decoding.engine import Generation, generate

__all__ = ["Generation", "generate"]
