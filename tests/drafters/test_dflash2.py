"""DFlash2 (``drafters/dflash2.py``) and its loss (``objectives/selector.py``), piece by piece.

The decoding guarantees (greedy ≡ plain, χ² at T = 1, offline ≡ engine, save/load, DDP, every architecture) hold
through the family tests; here: the convolution by hand and inside its block, the selector's scores and the skip rule
of its loss, the identity start (a DFlash warm start drafts what the DFlash drafts), the invariant the offline
evaluator rests on with every new weight far from its start, and the errors.
"""

import pytest
import torch

from lightning_spec import SamplingConfig, generate
from lightning_spec.checkpoint import save_drafter
from lightning_spec.checkpoint.load import init_weights
from lightning_spec.drafters import Anchors, DFlash2Drafter, DFlashDrafter, DraftOutput, Eagle3Drafter
from lightning_spec.drafters.dflash2 import BlockConv
from lightning_spec.errors import UserError
from lightning_spec.objectives import KL, Objective, SelectorCE, StepContext

T1, GREEDY = SamplingConfig(temperature=1.0), SamplingConfig()
SIZES = dict(block_size=4, num_layers=1, qk_norm=True, mask_token_id=1)
DFLASH2 = dict(conv_group_size=8, selector_rank=8, selector_top_k=5)


def bound(cls, target, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    drafter = cls(**kwargs)
    drafter.bind(target)
    return drafter.eval()


def stirred(drafter: DFlash2Drafter) -> DFlash2Drafter:
    """Every DFlash2 weight far from its identity start: dynamic taps, second taps and the selector's projection."""
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight.normal_(std=0.3)
                conv.base_kernel[:, 1].normal_(std=0.5)
        drafter.selector.hidden_projection.weight.normal_(std=3.0)
        drafter.selector.predecessor_codebook.weight.normal_(std=1.0)
        drafter.selector.successor_codebook.weight.normal_(std=1.0)
    return drafter


# -------------------------------------------------------------------------------------------- the convolution
def test_the_convolution_by_hand_and_the_identity_at_its_start():
    torch.manual_seed(0)
    conv = BlockConv(hidden=8, taps=2, group=4)  # 2 groups of 4 channels
    x = torch.randn(1, 6, 8)  # two blocks of 3 positions side by side
    y, kernel = conv.prepare(x, block_len=3)
    torch.testing.assert_close(y, x)  # base [1, 0], W_d = 0: the identity
    torch.testing.assert_close(conv.finish(x, kernel, 3), x)
    with torch.no_grad():
        conv.kernel_projection.weight.normal_()
        conv.base_kernel.normal_()
    y, _ = conv.prepare(x, block_len=3)
    d = (x @ conv.kernel_projection.weight.t()).view(1, 6, 2, 2, 2)[:, :, 0]  # (1, Q, taps, G): the input kernel
    base = conv.base_kernel[0]  # (taps, H)
    for i in range(6):
        want = (base[0] + d[0, i, 0].repeat_interleave(4)) * x[0, i]
        if i % 3:  # a previous position inside the block; none at a block's first position
            want = want + (base[1] + d[0, i, 1].repeat_interleave(4)) * x[0, i - 1]
        torch.testing.assert_close(y[0, i], want)


def test_slots_see_only_their_own_block(diverse_target):
    """With every tap stirred, blocks side by side in the training forward do not see each other: each block's states
    are those it gets computed alone (the taps are zero across block boundaries)."""
    drafter = stirred(bound(DFlash2Drafter, diverse_target, **SIZES, **DFLASH2))
    ids = torch.randint(2, diverse_target.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    features = diverse_target(ids, layers=drafter.target_layers, logits=False).features
    both = drafter.backbone(ids, features, torch.tensor([[5, 11]]))  # (1, 2, B, H)
    for i, start in enumerate((5, 11)):
        alone = drafter.backbone(ids, features, torch.tensor([[start]]))[0, 0]
        torch.testing.assert_close(both[0, i], alone, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- the selector
def test_the_selector_scores_only_the_unary_top_k_by_hand(diverse_target):
    drafter = stirred(bound(DFlash2Drafter, diverse_target, **SIZES, **DFLASH2))
    hidden = torch.randn(3, diverse_target.hidden_size)
    previous = torch.tensor([4, 9, 4])
    logits = drafter.selected(hidden, previous)  # (3, V)
    unary = drafter.head(hidden)
    sel = drafter.selector
    for row in range(3):
        top = unary[row].topk(5).indices
        assert set(torch.isfinite(logits[row]).nonzero()[:, 0].tolist()) == set(top.tolist())
        left = sel.predecessor_codebook.weight[previous[row]] * (sel.hidden_projection.weight @ hidden[row])
        want = unary[row, top] + sel.successor_codebook.weight[top] @ left
        torch.testing.assert_close(logits[row, top], want)
    moved = drafter.selected(hidden[:1], torch.tensor([11]))  # another predecessor: other scores, same candidates
    assert torch.equal(torch.isfinite(moved), torch.isfinite(logits[:1]))
    assert (moved - logits[:1]).nan_to_num(0.0).abs().max() > 1e-3


def teacher_forced(drafter, target, prompt: list[int], drafted: list[int]) -> torch.Tensor:
    """The forward's slot logits (K, Vd) of the round anchored at the prompt's last token, continued by ``drafted``."""
    ids = torch.tensor([prompt + drafted])
    mask = torch.zeros_like(ids)
    mask[0, len(prompt) :] = 1
    features = target(ids, layers=drafter.target_layers, logits=False).features
    out = drafter({"input_ids": ids, "loss_mask": mask}, features, Anchors.all(torch.tensor([[len(prompt) - 1]])))
    assert out.sparse and out.valid.all()
    return out.logits[0, 0]


def round_after(drafter, target, prompt: list[int], sampling, seed: int = 0):
    ids = torch.tensor([prompt])
    features = target(ids[:, :-1], layers=drafter.target_layers, logits=False).features
    state = drafter.begin(features)
    return drafter.propose(state, ids[0, -1:], sampling, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("vocab", [None, 40])
def test_the_forward_gives_the_distributions_the_walk_draws_from(vocab, diverse_target):
    """What the offline evaluator rests on, with every new weight far from its start: teacher-forced on the tokens
    a walk drew, the forward gives the distributions each was drawn from (supported on the slot's candidates)."""
    drafter = stirred(bound(DFlash2Drafter, diverse_target, **SIZES, **DFLASH2, draft_vocab_size=vocab))
    if vocab:
        drafter.vocab.set_from_counts(torch.rand(diverse_target.vocab_size, generator=torch.Generator().manual_seed(0)))
    prompt = [3, 17, 60, 2, 41, 9, 77]
    state = drafter.begin(diverse_target(torch.tensor([prompt[:-1]]), layers=drafter.target_layers,
                                         logits=False).features)
    unary = drafter.vocab.scatter(T1.probs(drafter.head(drafter.block_hidden(state, torch.tensor(prompt[-1:]))[0, 1:])))
    moved = 0
    for seed in range(4):
        proposal = round_after(drafter, diverse_target, prompt, T1, seed)
        logits = teacher_forced(drafter, diverse_target, prompt, proposal.tokens.tolist())
        torch.testing.assert_close(drafter.vocab.scatter(T1.probs(logits)), proposal.probs, rtol=1e-5, atol=1e-6)
        assert ((proposal.probs > 0).sum(-1) <= 5).all()  # drawn from the 5 candidates only
        moved += int((proposal.probs - unary).abs().max() > 1e-2)  # (K, V) against the backbone's own slots
    assert moved == 4  # the selector changed every walk's distributions: the check has teeth
    greedy = round_after(drafter, diverse_target, prompt, GREEDY)
    logits = teacher_forced(drafter, diverse_target, prompt, greedy.tokens.tolist())
    assert drafter.vocab.to_target(logits.argmax(-1)).tolist() == greedy.tokens.tolist()


# --------------------------------------------------------------------------------------------- its loss
def test_selector_ce_skips_a_gold_token_outside_the_candidates(diverse_target):
    drafter = stirred(bound(DFlash2Drafter, diverse_target, **SIZES, **DFLASH2))
    drafter.train()
    ids = torch.randint(2, diverse_target.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    features = diverse_target(ids, layers=drafter.target_layers, logits=False).features
    out = drafter(batch, features)
    ell = SelectorCE(alpha=0.5)(out, None)  # (N, A, K)
    unary = out.aux["base_logits"](out.hidden, torch.arange(out.num_anchors))
    base = -unary.log_softmax(-1).gather(-1, out.labels[..., None])[..., 0]
    logq = out.logits.log_softmax(-1).gather(-1, out.labels[..., None])[..., 0]
    inside = torch.isfinite(logq)
    assert inside.any() and (~inside).any()  # both cases occur: the check has teeth
    torch.testing.assert_close(ell[~inside], base[~inside])  # skipped: the base term alone
    torch.testing.assert_close(ell[inside], base[inside] - 0.5 * logq[inside])
    out = drafter(batch, features)
    target_logits = torch.randn(*out.labels.shape, diverse_target.vocab_size,
                                generator=torch.Generator().manual_seed(4))
    terms = Objective(SelectorCE(base=KL()))(out, StepContext(target_logits=target_logits))  # KL on the unary head
    (terms.num / terms.den).backward()
    assert torch.isfinite(terms.num) and drafter.selector.hidden_projection.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for name, p in drafter.named_parameters() if "conv" in name)


def test_a_dense_loss_on_dflash2_is_refused_in_one_sentence(diverse_target):
    drafter = bound(DFlash2Drafter, diverse_target, **SIZES, **DFLASH2)
    ids = torch.randint(2, diverse_target.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    out = drafter({"input_ids": ids, "loss_mask": torch.ones_like(ids)},
                  diverse_target(ids, layers=drafter.target_layers, logits=False).features)
    with pytest.raises(UserError, match="loss KL needs every token's draft probability.*SelectorCE"):
        Objective(KL())(out)
    with pytest.raises(UserError, match="loss.base must be a loss on the dense unary logits"):
        SelectorCE(base=SelectorCE())
    dense = DraftOutput(out.logits, out.labels, out.valid, out.anchors)
    with pytest.raises(UserError, match="needs the drafter's unary head"):
        SelectorCE()(dense, None)


# ----------------------------------------------------------------------------------------- the identity start
def test_a_dflash_warm_start_drafts_what_the_dflash_drafts(diverse_target, prompts, tmp_path):
    """``model.init_from`` a DFlash checkpoint: DFlash2 takes its weights, its convolutions start as the identity
    and its selector as each slot's argmax, so greedy decoding drafts exactly the DFlash's rounds."""
    from helpers.families import fit_to_greedy_continuations

    dflash = fit_to_greedy_continuations(diverse_target, bound(DFlashDrafter, diverse_target, **SIZES), prompts, 30)
    path = save_drafter(dflash, tmp_path / "dflash", target_spec="diverse")
    warm = bound(DFlash2Drafter, diverse_target, seed=5, **SIZES, **DFLASH2)
    parent = init_weights(warm, path, diverse_target.fingerprints)
    assert parent["drafter_class"].endswith("DFlashDrafter")
    for prompt in prompts:
        a, b = generate(diverse_target, prompt, 16, drafter=dflash), generate(diverse_target, prompt, 16, drafter=warm)
        assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    assert sum(sum(generate(diverse_target, p, 16, drafter=warm).accept_lengths) for p in prompts) > 0
    with pytest.raises(UserError, match="holds a .*DFlashDrafter but model.drafter is a .*Eagle3Drafter"):
        init_weights(bound(Eagle3Drafter, diverse_target, block_size=4), path, diverse_target.fingerprints)


def test_errors_name_the_field_and_the_fix(diverse_target):
    with pytest.raises(UserError, match="drafter.conv_group_size=7 does not divide the target's hidden size 32"):
        bound(DFlash2Drafter, diverse_target, block_size=4, conv_group_size=7)
    with pytest.raises(UserError, match="drafter.selector_top_k=50 exceeds drafter.draft_vocab_size=40"):
        DFlash2Drafter(block_size=4, draft_vocab_size=40, selector_top_k=50)
    with pytest.raises(UserError, match="drafter.conv_kernel_size must be in 1..block_size \\+ 1 = 5"):
        DFlash2Drafter(block_size=4, conv_kernel_size=6)
    with pytest.raises(UserError, match="drafter.selector_top_k=200 exceeds the draft vocabulary \\(96 tokens\\)"):
        bound(DFlash2Drafter, diverse_target, block_size=4, conv_group_size=8, selector_top_k=200)


def test_init_from_target_copies_the_layers_and_leaves_the_convolutions_and_qk_norms_at_their_start(diverse_target):
    """``init_from_target`` on a Llama target: the draft layer's projections and norms are the target's last layer's,
    DFlash2's convolutions stay the identity and the q/k norms (which a Llama layer lacks) stay ones; it once failed
    on both names."""
    last = dict(list(diverse_target.base.layers)[-1].named_parameters())
    for cls, extra in ((DFlashDrafter, {}), (DFlash2Drafter, DFLASH2)):
        drafter = bound(cls, diverse_target, block_size=4, num_layers=1, qk_norm=True, init_from_target=True, **extra)
        layer = drafter.layers[0]
        assert torch.equal(layer.q_proj.weight, last["self_attn.q_proj.weight"])
        assert torch.equal(layer.down_proj.weight, last["mlp.down_proj.weight"])
        assert torch.equal(layer.q_norm.weight, torch.ones_like(layer.q_norm.weight))
        if cls is DFlash2Drafter:
            x = torch.randn(1, 5, diverse_target.hidden_size)
            torch.testing.assert_close(layer.attention_conv.prepare(x, 5)[0], x)
