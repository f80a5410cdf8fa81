"""The bootstrap's draws, spelled out for the tests of what they resample (tests/test_paired.py)."""

from collections.abc import Sequence

import numpy as np

from lightning_spec.paired import _clusters, _draw


def resample_weights(keys: Sequence[str], strata: Sequence[str] | None, n_resamples: int, seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Cluster index per row (R,) and bootstrap counts (B, C): how often each cluster is drawn in each resample, as
    ``bootstrap_mal`` draws them; within every stratum the counts sum to the stratum's number of clusters."""
    ids, groups = _clusters(keys, strata)
    return ids, _draw(groups, int(ids.max()) + 1, n_resamples, np.random.default_rng(seed))
