"""Lightning callbacks: decoding-based validation, offline evaluation, domain re-weighting from validation MAL, and
the on-policy rollouts that on-policy regimes train on (a replay buffer decoded by the live drafter).

``MetricsCallback`` is their base (history, publishing, state, the per-domain MAL they declare);
``EvaluationCallback`` adds when an evaluation runs. A callback of your own on either base can feed
``DomainReweighting``.
"""

from lightning_spec.callbacks.base import EvaluationCallback, MetricsCallback
from lightning_spec.callbacks.domain_weighting import DomainReweighting
from lightning_spec.callbacks.offline_evaluation import OfflineEvaluation
from lightning_spec.callbacks.on_policy import OnPolicyRollouts
from lightning_spec.callbacks.spec_validation import SpecDecodeValidation

__all__ = [
    "DomainReweighting", "EvaluationCallback", "MetricsCallback", "OfflineEvaluation", "OnPolicyRollouts",
    "SpecDecodeValidation",
]
