"""Decoding: pure acceptance rules (verify.py) and the one loop every drafter uses (engine.py)."""

from lightning_spec.decoding.engine import Generation, generate

__all__ = ["Generation", "generate"]
