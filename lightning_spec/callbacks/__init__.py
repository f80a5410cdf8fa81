"""Lightning callbacks: decoding-based validation, offline evaluation, domain re-weighting from validation MAL."""

from lightning_spec.callbacks.domain_weighting import DomainReweighting
from lightning_spec.callbacks.offline_validation import OfflineEvaluation
from lightning_spec.callbacks.spec_validation import SpecDecodeValidation

__all__ = ["DomainReweighting", "OfflineEvaluation", "SpecDecodeValidation"]
