"""Evaluation: real decoding over prompt sets (benchmark.py), exact offline rounds on target rollouts
(offline.py) and paired comparisons with bootstrap intervals over prompts (paired.py)."""

from lightning_spec.evaluation.benchmark import DecodeReport, decode_prompts
from lightning_spec.evaluation.offline import OfflineReport, offline_report, offline_rounds
from lightning_spec.evaluation.paired import Comparison, bootstrap_mal, compare, compare_reports

__all__ = [
    "Comparison",
    "DecodeReport",
    "OfflineReport",
    "bootstrap_mal",
    "compare",
    "compare_reports",
    "decode_prompts",
    "offline_report",
    "offline_rounds",
]
