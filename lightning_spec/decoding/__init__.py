"""Decoding: how a drafter's proposals are verified (verify.py, proposals.py, trees.py, the ``Proposer`` contract in
proposer.py), the one loop every drafter uses (engine.py), how to decode as one value (plans.py) and the policies
that choose or change it (auto/, adaptation.py); the exact rounds of known outputs (exact.py) and a prompt set
decoded and timed (timed.py)."""

from lightning_spec.decoding.engine import Generation, generate

__all__ = ["Generation", "generate"]
