"""Eagle3Drafter: EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv 2503.01840), with EAGLE-3.1's options: target features fused by ``fc`` from a low, a
middle and a high layer, one decoder layer over [embedding ; hidden], K autoregressive slots with its own KV cache,
trained by training-time test. The body, which P-EAGLE (``peagle.py``) shares, is ``eagle.py``; its docstring reads
the method top to bottom.
"""

from __future__ import annotations

from lightning_spec.drafters.eagle import EagleDrafter


class Eagle3Drafter(EagleDrafter):
    __doc__ = EagleDrafter.__doc__

    family = "eagle3"
