"""Evaluation: exact offline rounds on target rollouts (offline.py), the online runner over several drafters
(online.py), the ``lightning-spec evaluate`` command (cli.py) and its reports (report.py), and the inputs they read,
opened once at the edge (inputs.py). What they build on lives below: decoding a prompt set timed
(``decoding/timed.py``), the exact rounds of known outputs (``decoding/exact.py``) and the paired statistics
(``lightning_spec/paired.py``)."""

from lightning_spec.evaluation.inputs import open_rollouts
from lightning_spec.evaluation.offline import OfflineReport, offline_report, offline_rounds
from lightning_spec.evaluation.online import OnlineRun, OnlineTimings, online_statistics

__all__ = ["OfflineReport", "OnlineRun", "OnlineTimings", "offline_report", "offline_rounds", "online_statistics",
           "open_rollouts"]
