"""Training objectives as parts of one template (DESIGN.md "The one equation"); no Lightning in here."""

from lightning_spec.objectives.losses import CE, KL, TV, Loss
from lightning_spec.objectives.objective import LossTerms, Objective
from lightning_spec.objectives.weights import AnchorUniform, AnchorWeight, ExpDecay, PositionWeight, Uniform

__all__ = [
    "CE", "KL", "TV", "AnchorUniform", "AnchorWeight", "ExpDecay", "Loss", "LossTerms", "Objective",
    "PositionWeight", "Uniform",
]
