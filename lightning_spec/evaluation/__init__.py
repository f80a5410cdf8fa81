"""Evaluation: real decoding over prompt sets (benchmark.py), exact offline rounds on target rollouts
(offline.py), the online runner over several drafters (online.py), paired comparisons with bootstrap intervals
over prompts (paired.py), and the inputs they read, opened once at the edge (inputs.py)."""

from lightning_spec.evaluation.benchmark import DecodeReport, decode_prompts
from lightning_spec.evaluation.inputs import open_rollouts
from lightning_spec.evaluation.offline import OfflineReport, offline_report, offline_rounds
from lightning_spec.evaluation.online import OnlineRun, OnlineTimings, online_statistics
from lightning_spec.evaluation.paired import Bootstrap, Comparison, bootstrap_mal, compare, compare_reports

__all__ = [
    "Bootstrap",
    "Comparison",
    "DecodeReport",
    "OfflineReport",
    "OnlineRun",
    "OnlineTimings",
    "bootstrap_mal",
    "compare",
    "compare_reports",
    "decode_prompts",
    "offline_report",
    "offline_rounds",
    "online_statistics",
    "open_rollouts",
]
