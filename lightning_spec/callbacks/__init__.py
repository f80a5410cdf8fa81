"""Lightning callbacks: decoding-based validation, offline evaluation (and, later, domain re-weighting)."""

from lightning_spec.callbacks.offline_validation import OfflineEvaluation
from lightning_spec.callbacks.spec_validation import SpecDecodeValidation

__all__ = ["OfflineEvaluation", "SpecDecodeValidation"]
