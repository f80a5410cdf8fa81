"""Training objectives as parts of one template, L = Σ_n a_n Σ_t b_{n,t} ℓ_{n,t} / Z (``objective.py``).

No Lightning in here.

Losses ℓ: CE, KL, ReverseKL, TV, JSD, LK, LKAlpha, BernoulliKL, TVMinusOne (E2E/WTV), NegProb (EAL), EDRCost.
Block-position weights b: Uniform, ExpDecay, Geometric, AUFSupport, ValidPrefix, DPACE, E2EWeight, WTVWeight,
EALWeight, EDRReach, PositionProduct (a product of weights), VPDecay (D²SD's variable prefix). Anchor weights a:
AnchorUniform, EDROccupancy. Aux-head losses: ConfidenceBCE (DSpark), RankOrdinal (SpecBlock's rank head),
LengthMSE (AdaFlash's length head), SelectorCE (DFlash2's path selector over a dense base loss). AdaFlashLoss:
AdaFlash's CE on the target argmax + reverse KL.
Objectives: Objective (the template), the ready-made pairs E2E, WTV, EAL and EDR, Mixture (weighted sums), and GRPO
(policy gradient on simulated acceptance). On-policy: DraftOPD (replays the rounds of the live drafter's rollouts).
Every part is called as ``part(draft, ctx)``: the drafter's ``DraftOutput`` and the module's ``StepContext``.
"""

from lightning_spec.objectives.adaflash import AdaFlashLoss, LengthMSE
from lightning_spec.objectives.confidence import ConfidenceBCE
from lightning_spec.objectives.context import PerAnchor, StepContext
from lightning_spec.objectives.draft_opd import DraftOPD
from lightning_spec.objectives.edr import EDR, EDRCost, EDROccupancy, EDRReach
from lightning_spec.objectives.grpo import GRPO
from lightning_spec.objectives.losses import (
    CE,
    JSD,
    KL,
    LK,
    TV,
    BernoulliKL,
    LKAlpha,
    Loss,
    NegProb,
    ReverseKL,
    TVMinusOne,
)
from lightning_spec.objectives.objective import E2E, EAL, WTV, LossTerms, Mixture, Objective, TargetInfo
from lightning_spec.objectives.rank import RankOrdinal
from lightning_spec.objectives.selector import SelectorCE
from lightning_spec.objectives.two_branch import TwoBranchCE
from lightning_spec.objectives.vp import VPDecay
from lightning_spec.objectives.weights import (
    DPACE,
    AnchorUniform,
    AnchorWeight,
    AUFSupport,
    E2EWeight,
    EALWeight,
    ExpDecay,
    Geometric,
    PositionProduct,
    PositionWeight,
    Uniform,
    ValidPrefix,
    WTVWeight,
)

__all__ = [
    "AUFSupport", "AnchorUniform", "AnchorWeight", "BernoulliKL", "CE", "ConfidenceBCE", "DPACE", "DraftOPD", "E2E",
    "E2EWeight", "EAL", "EALWeight", "EDR", "EDRCost", "EDROccupancy", "EDRReach", "ExpDecay", "GRPO", "Geometric",
    "JSD", "KL", "LK", "LKAlpha", "Loss", "LossTerms", "Mixture", "NegProb", "Objective", "PerAnchor",
    "PositionProduct", "PositionWeight", "RankOrdinal", "ReverseKL", "SelectorCE", "StepContext", "TV", "TVMinusOne",
    "TargetInfo",
    "TwoBranchCE", "Uniform", "ValidPrefix", "VPDecay", "WTV", "WTVWeight",
    "AdaFlashLoss", "LengthMSE",
]
