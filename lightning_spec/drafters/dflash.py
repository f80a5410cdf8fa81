"""DFlashDrafter: the DFlash block-parallel drafter (Chen, Liang, Liu 2026, arXiv 2602.06036).

Reads top to bottom:
1. Context: features of chosen target layers, concatenated, fused by ``fc`` + RMSNorm -> H_ctx (N, S, H).
2. Every draft layer injects H_ctx into its keys and values (KV injection): K = [W_K H_ctx ; W_K h],
   V = [W_V H_ctx ; W_V h]; queries come from the block only.
3. A block is ``[anchor, MASK x K]`` (K + 1 positions) embedded with the target's frozen embedding (the mask
   is a learned vector). Attention is bidirectional inside the block; the block sees context strictly before
   the anchor, because at inference the anchor (the bonus token) has no target hidden state yet.
4. Slot t = 1..K predicts x_{n+t} through the target's frozen LM head, optionally restricted to a reduced
   draft vocabulary (as EAGLE-3's, Li et al. 2025, arXiv 2503.01840; the d2t / t2d maps of
   its SpecForge and vLLM speculators checkpoints, target id = draft id + d2t[draft id]).
5. Optional adaptive length head (AdaFlash, Qian et al. 2026, arXiv 2607.19223, its "two_model" head): from the
   block's detached slot states it predicts how much of the block will be accepted, and a chain round submits
   only k = clamp(round(pred * K * length_rate), length_min, K) of the K drafted tokens (``LengthHead``).

Naming: ``block_size`` = K = draft proposals per round, everywhere in this package (README "Conventions").
DFlash papers count the anchor in their block, so their B = 16 is ``block_size: 15`` here.

The body lives in ``block.py`` (``ParallelBlockDrafter``), which DSpark, D²SD, DFly and Domino extend too; DFlash
is that body as published, so this file only names the family. Its export codecs (speculators and SGLang
``dflash``) are registered under ``family = "dflash"``.
"""

from __future__ import annotations

from lightning_spec.drafters.block import ParallelBlockDrafter


class DFlashDrafter(ParallelBlockDrafter):
    """DFlash (Chen, Liang, Liu 2026, arXiv 2602.06036): ``ParallelBlockDrafter`` as published, with its options
    (AdaFlash's length head, the context shortcut, Qwen3's q/k norm, one shared mask token); the arguments are
    documented on ``ParallelBlockDrafter``."""

    family = "dflash"
