"""lightning_spec: train and compare draft models for speculative decoding with PyTorch Lightning.

The public API, stable (tests and outside tools use exactly these): ``SamplingConfig``, ``load_target``,
``load_drafter``, ``generate``, ``offline_rounds``, ``TreeConfig``. README "Python API" shows them at work. What
a user can cause (a bad argument, file or data) raises ``UserError``, a ``ValueError`` (``errors.py``).
"""

from lightning_spec.checkpoint import load_drafter
from lightning_spec.decoding.engine import generate
from lightning_spec.decoding.trees import TreeConfig
from lightning_spec.errors import UserError
from lightning_spec.evaluation.offline import offline_rounds
from lightning_spec.sampling import SamplingConfig
from lightning_spec.target_loading import load_target

__all__ = ["SamplingConfig", "TreeConfig", "UserError", "generate", "load_drafter", "load_target", "offline_rounds"]
