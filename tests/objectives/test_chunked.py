"""The objective in chunks of anchors equals the objective over all anchors, in value and in gradient.

Chunking (``DraftModule(loss_chunk=...)``) keeps only one chunk's draft and target logits alive at a time and
recomputes them in the backward pass; it must change memory only, never the loss.
"""

import pytest
import torch
from helpers.objectives import batch_of

from lightning_spec import load_target
from lightning_spec.drafters import DFlashDrafter
from lightning_spec.module import DraftModule
from lightning_spec.objectives import (
    EDR,
    KL,
    TV,
    AUFSupport,
    ExpDecay,
    Mixture,
    Objective,
    ValidPrefix,
)
from lightning_spec.objectives.objective import E2E
from lightning_spec.sampling import SamplingConfig

OBJECTIVES = {
    "kl_decay_weight": lambda: Objective(KL(), ExpDecay(2.0)),
    "tv_slots": lambda: Objective(TV(), normalize="slots"),
    "auf_anchors": lambda: Objective(KL(), AUFSupport(), normalize="anchors"),  # weights from the draft argmax
    "valid_prefix_sequences": lambda: Objective(KL(), ValidPrefix(), normalize="sequences"),
    "e2e": lambda: E2E(),  # b_t = Π α with gradient: a whole block per anchor
    "mixture": lambda: Mixture([Objective(KL(), ExpDecay(2.0)), Objective(TV(), ExpDecay(2.0))], [0.1, 1.8]),
    "edr": lambda: EDR(sampling=SamplingConfig(temperature=1.0), max_anchors=6, chunk_size=4),
}


@pytest.fixture(scope="module")
def target64():
    """The tiny target in float64: chunking changes the order of float sums, so parity is checked beyond
    float32 rounding."""
    return load_target("tiny-random", dtype=torch.float64)


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("chunk", [1, 3])
def test_chunked_objective_equals_the_whole(target64, name, chunk):
    torch.manual_seed(0)
    drafter = DFlashDrafter(block_size=3, num_layers=1, num_anchors=7, draft_vocab_size=100)
    module = DraftModule(drafter, OBJECTIVES[name](), target=target64, feature_cache="off").double()
    module.drafter.vocab.set_from_counts(torch.arange(target64.vocab_size).float())
    batch = module.seeded(batch_of(target64), salt=0)
    results = []
    for loss_chunk in (None, chunk):
        module.hparams.loss_chunk = loss_chunk
        module.drafter.zero_grad()
        draft, terms = module.draft_step(batch, use_cache=False)
        assert draft.num_anchors > chunk  # the chunked run really is in several chunks
        terms.num.backward()
        grads = {k: p.grad.clone() for k, p in module.drafter.named_parameters() if p.grad is not None}
        results.append((terms.num.detach(), terms.den, grads))
    (num, den, grads), (num_c, den_c, grads_c) = results
    torch.testing.assert_close(num_c, num, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(den_c, den, rtol=1e-6, atol=1e-6)
    assert grads and grads.keys() == grads_c.keys()
    for key in grads:
        torch.testing.assert_close(grads_c[key], grads[key], rtol=1e-6, atol=1e-6, msg=key)


def test_a_bad_chunk_is_one_sentence(tiny_target):
    with pytest.raises(ValueError, match="model.loss_chunk"):
        DraftModule(DFlashDrafter(block_size=2), Objective(), target=tiny_target, loss_chunk=0)
