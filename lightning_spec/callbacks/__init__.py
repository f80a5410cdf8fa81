"""Lightning callbacks: decoding-based validation (and, later, domain re-weighting)."""

from lightning_spec.callbacks.spec_validation import SpecDecodeValidation

__all__ = ["SpecDecodeValidation"]
