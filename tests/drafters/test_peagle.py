"""PEagleDrafter (P-EAGLE, vLLM's parallel drafting): one layer call per round, slots 2..K reading the mask token and
the placeholder (and nothing drafted), training's slots equal to decoding's, COD thinning the loss in training only.
The guarantees every family meets (greedy = plain, the sampling distribution, offline = engine, trees, export) are in
tests/drafters/test_families.py, tests/decoding/ and tests/export/."""

import pytest
import torch

from lightning_spec import SamplingConfig
from lightning_spec.drafters import Anchors, PEagleDrafter
from lightning_spec.errors import UserError

K = 4
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def drafter(diverse_target):
    torch.manual_seed(0)
    d = PEagleDrafter(block_size=K, draft_vocab_size=48, mask_token_id=3)
    d.bind(diverse_target)
    d.vocab.set_from_counts(torch.rand(diverse_target.vocab_size))
    with torch.no_grad():  # larger weights than the 0.02 init, and a placeholder that is not zero
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return d.eval()


@pytest.fixture(scope="module")
def sequence(diverse_target, drafter):
    torch.manual_seed(1)
    ids = torch.randint(0, diverse_target.vocab_size, (1, 16))
    return ids, diverse_target(ids, layers=drafter.target_layers, logits=False).features  # (1, S, F)


@pytest.mark.parametrize("n", [0, 5, 11])
def test_decoding_gives_the_training_forwards_slots(drafter, sequence, n):
    """The K distributions a round draws from are the training forward's at that anchor (the offline evaluator and
    the trees read the forward)."""
    ids, feats = sequence
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    trained = drafter(batch, feats, Anchors.all(torch.tensor([[n]]))).logits[0, 0]  # (K, Vd)
    decoded = drafter.position_logits(drafter.begin(feats[:, :n], ids[:, :n]), ids[0, n : n + 1])
    torch.testing.assert_close(decoded, trained, atol=1e-5, rtol=1e-5)


def test_a_round_is_one_layer_call_and_reads_no_drafted_token(drafter, sequence, monkeypatch):
    ids, feats = sequence
    state = drafter.begin(feats[:, :8], ids[:, :8])
    calls = []
    qkv = drafter.layer.qkv
    monkeypatch.setattr(drafter.layer, "qkv", lambda *a: calls.append(a[0].shape) or qkv(*a))
    proposal = drafter.propose(state, ids[0, 8:9], GREEDY)
    assert calls == [torch.Size([1, K, drafter.fc.out_features])]  # the K slots together
    assert proposal.tokens.numel() == K
    assert state.nodes[0].item() == ids[0, 8].item()  # extend reads the anchor and the drafts from here


def test_slots_after_the_first_read_the_mask_token_and_the_placeholder(drafter, sequence):
    ids, feats = sequence
    state = drafter.begin(feats[:, :8], ids[:, :8])
    before = drafter.position_logits(state, ids[0, 8:9])
    with torch.no_grad():
        drafter.mask_hidden.add_(1.0)
    try:
        after = drafter.position_logits(state, ids[0, 8:9])
    finally:
        with torch.no_grad():
            drafter.mask_hidden.sub_(1.0)
    torch.testing.assert_close(after[0], before[0])  # slot 1 reads the anchor and g_{n-1} only
    assert not torch.allclose(after[1:], before[1:])
    drafter.mask_token_id = 4
    try:
        assert not torch.allclose(drafter.position_logits(state, ids[0, 8:9])[1:], before[1:])
    finally:
        drafter.mask_token_id = 3


def test_cod_thins_the_loss_at_deep_slots_in_training_only(diverse_target):
    torch.manual_seed(0)
    d = PEagleDrafter(block_size=K, num_anchors=512, mask_token_id=3)
    d.bind(diverse_target)
    n, s = 8, 200
    batch = {"input_ids": torch.randint(0, diverse_target.vocab_size, (n, s)),
             "loss_mask": torch.ones(n, s, dtype=torch.bool), "anchor_seed": torch.arange(n)}
    anchors = Anchors.all(torch.arange(s - K).expand(n, -1))
    keep = d.cod_keep(batch, anchors)  # (N, A, K)
    share = keep.float().mean(dim=(0, 1))
    torch.testing.assert_close(share, torch.tensor([1.0, 0.7, 0.49, 0.343]), atol=0.03, rtol=0)
    assert torch.equal(keep, d.cod_keep(batch, anchors))  # drawn from the seeds: the same in any batch layout
    feats = diverse_target(batch["input_ids"], layers=d.target_layers, logits=False).features
    d.train()
    trained = d(batch, feats, anchors).valid
    d.eval()
    scored = d(batch, feats, anchors).valid
    assert scored.all() and torch.equal(trained, keep & scored)
    floor = PEagleDrafter(block_size=K, mask_token_id=3, down_sample_ratio=0.5, down_sample_ratio_min=0.2)
    share = floor.cod_keep(batch, anchors).float().mean(dim=(0, 1))
    torch.testing.assert_close(share, torch.tensor([1.0, 0.5, 0.25, 0.2]), atol=0.03, rtol=0)


def test_a_missing_mask_token_is_one_sentence(diverse_target):
    with pytest.raises(UserError, match="PEagleDrafter.mask_token_id=None must be a token of the target"):
        PEagleDrafter(block_size=K).bind(diverse_target)
    with pytest.raises(UserError, match="down_sample_ratio"):
        PEagleDrafter(block_size=K, mask_token_id=3, down_sample_ratio=0)
