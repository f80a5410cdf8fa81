"""The two-branch DFlash family (``drafters/dfly.py``, ``drafters/domino.py``): DFly's fusion context and
hidden-state correction, Domino's GRU correction, the left-to-right chain both draft with, and Domino's λ-scheduled
loss (``TwoBranchCE``).

The decoding guarantees (greedy ≡ plain, χ² at T = 1, offline ≡ engine, save/load) hold through
tests/drafters/test_families.py; here the pieces are checked by hand, and the invariant those rest on is checked
directly with corrections far from their zero start: the training forward, teacher-forced on the tokens a proposal
drew, gives exactly the distributions ``propose`` drew them from.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers.objectives import batch_of

from lightning_spec import SamplingConfig, load_target
from lightning_spec.drafters import Anchors, DFlashDrafter, DFlyDrafter, DominoDrafter, DraftOutput
from lightning_spec.drafters.block import previous_tokens
from lightning_spec.module import DraftModule
from lightning_spec.objectives import CE, AUFSupport, ExpDecay, Objective, StepContext, TwoBranchCE

T1, GREEDY = SamplingConfig(temperature=1.0), SamplingConfig()


def bound(cls, target, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    drafter = cls(**{"block_size": 4, "num_layers": 1, **kwargs})
    drafter.bind(target)
    return drafter.eval()


def stirred(drafter):
    """Corrections far from their zero start, so the left-to-right path changes what is drafted."""
    torch.manual_seed(1)
    with torch.no_grad():
        if isinstance(drafter, DominoDrafter):
            drafter.embed_proj[2].weight.normal_(std=2.0)
        elif drafter.correction is not None:
            drafter.correction.down_proj.weight.normal_(std=1.0)
    return drafter


# ------------------------------------------------------------------------------ forward == what propose draws
FAMILIES = {
    "dfly": lambda t, **kw: bound(DFlyDrafter, t, **kw),
    "dfly_no_correction": lambda t, **kw: bound(DFlyDrafter, t, hidden_correction=False, **kw),
    "domino": lambda t, **kw: bound(DominoDrafter, t, gru_size=8, correction_rank=16, **kw),
    "domino_no_prefix": lambda t, **kw: bound(DominoDrafter, t, gru_size=8, correction_rank=16,
                                              pure_draft_prefix_len=0, **kw),
}


def teacher_forced(drafter, target, prompt: list[int], drafted: list[int]) -> torch.Tensor:
    """The forward's slot logits (K, Vd) of the round anchored at the prompt's last token, its continuation being
    ``drafted``."""
    ids = torch.tensor([prompt + drafted])  # (1, S)
    mask = torch.zeros_like(ids)
    mask[0, len(prompt) :] = 1
    features = target(ids, layers=drafter.target_layers, logits=False).features
    anchors = Anchors.all(torch.tensor([[len(prompt) - 1]]))
    out = drafter({"input_ids": ids, "loss_mask": mask}, features, anchors)
    assert out.valid.all()
    return out.logits[0, 0]


def round_after(drafter, target, prompt: list[int], sampling, seed: int = 0):
    ids = torch.tensor([prompt])
    if len(prompt) > 1:
        features = target(ids[:, :-1], layers=drafter.target_layers, logits=False).features
    else:  # as the engine: a one-token prompt leaves no context
        features = torch.zeros(1, 0, len(drafter.target_layers) * target.hidden_size)
    state = drafter.begin(features)
    return drafter.propose(state, ids[0, -1:], sampling, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("vocab", [None, 40])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_forward_gives_the_distributions_propose_draws_from(family, vocab, diverse_target):
    drafter = stirred(FAMILIES[family](diverse_target, draft_vocab_size=vocab))
    if vocab:
        drafter.vocab.set_from_counts(torch.rand(diverse_target.vocab_size, generator=torch.Generator().manual_seed(0)))
    for prompt in ([5], [3, 17, 60, 2, 41, 9, 77]):
        for seed in range(3):
            proposal = round_after(drafter, diverse_target, prompt, T1, seed)
            logits = teacher_forced(drafter, diverse_target, prompt, proposal.tokens.tolist())
            torch.testing.assert_close(drafter.vocab.scatter(T1.probs(logits)), proposal.probs, rtol=1e-5, atol=1e-6)
        greedy = round_after(drafter, diverse_target, prompt, GREEDY)
        logits = teacher_forced(drafter, diverse_target, prompt, greedy.tokens.tolist())
        assert drafter.vocab.to_target(logits.argmax(-1)).tolist() == greedy.tokens.tolist()


def test_the_left_to_right_path_changes_the_draft(diverse_target):
    """The check above has teeth: the stirred corrections move the slots after the first (each reads its previous
    token), the first slot's distribution is the backbone's in Domino (its pure prefix)."""
    prompt = [3, 17, 60, 2, 41, 9, 77]
    for family in ("dfly", "domino"):
        plain = round_after(FAMILIES[family](diverse_target), diverse_target, prompt, T1).probs
        moved = round_after(stirred(FAMILIES[family](diverse_target)), diverse_target, prompt, T1).probs
        assert (moved[1:] - plain[1:]).abs().max() > 1e-2, family
    plain = round_after(FAMILIES["domino"](diverse_target), diverse_target, prompt, T1).probs
    moved = round_after(stirred(FAMILIES["domino"](diverse_target)), diverse_target, prompt, T1).probs
    torch.testing.assert_close(moved[0], plain[0])


# ---------------------------------------------------------------------------------------------- DFly by hand
def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_dfly_context_is_the_shared_fc_plus_each_layers_fusion(diverse_target):
    drafter = bound(DFlyDrafter, diverse_target, num_layers=2, target_layers=[0, 1])
    torch.testing.assert_close(drafter.fusion.detach(), torch.tensor([[0.0, -2.0], [-2.0, 0.0]]))  # distance prior
    with torch.no_grad():
        drafter.fusion.copy_(torch.tensor([[0.3, -1.0], [2.0, 0.5]]))
    ids = torch.randint(0, diverse_target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    features = diverse_target(ids, layers=[0, 1], logits=False).features  # (2, 9, 2H)
    contexts, shared = drafter.layer_contexts(features)
    h0, h1 = features.chunk(2, dim=-1)
    base = features @ drafter.fc.weight.t()
    w, eps = drafter.ctx_norm.weight, drafter.ctx_norm.eps
    for i, context in enumerate(contexts):
        mix = drafter.fusion[i].softmax(-1)
        torch.testing.assert_close(context, rms(base + mix[0] * h0 + mix[1] * h1, w, eps))
    torch.testing.assert_close(shared, rms(base, w, eps))
    torch.testing.assert_close(shared, drafter.context(features))  # the DFlash context, for the shortcut


def test_dfly_correction_by_hand_and_zero_at_init(diverse_target):
    drafter = bound(DFlyDrafter, diverse_target, correction_size=24)
    c = drafter.correction
    h, e = torch.randn(5, 32), torch.randn(5, 32)
    torch.testing.assert_close(c(h, e), h)  # W_down = 0: the identity
    stirred(drafter)
    x = torch.cat([rms(h, c.hidden_norm.weight, c.hidden_norm.eps), rms(e, c.embed_norm.weight, c.embed_norm.eps)], -1)
    want = h + (F.silu(x @ c.gate_proj.weight.t()) * (x @ c.up_proj.weight.t())) @ c.down_proj.weight.t()
    torch.testing.assert_close(c(h, e), want)
    assert c.gate_proj.weight.shape == (24, 64)


def test_dfly_slot_reads_the_gold_token_before_it(diverse_target):
    """Slot t's correction reads x_{n+t-1}: the anchor, then the gold tokens."""
    ids = torch.arange(10)[None] * 3  # (1, 10)
    starts = torch.tensor([[0, 4, 8]])
    prev = previous_tokens(ids, starts, 4)
    assert prev[0].tolist() == [[0, 3, 6, 9], [12, 15, 18, 21], [24, 27, 27, 27]]  # past the end: clamped, invalid


# -------------------------------------------------------------------------------------------- Domino by hand
def domino_batch(target):
    batch = batch_of(target)
    anchors = Anchors(torch.tensor([[4, 9, 12]] * 3), torch.ones(3, 3, dtype=torch.bool))
    return batch, target(batch["input_ids"], layers=[1], logits=False).features, anchors


@pytest.mark.parametrize("prefix", [0, 1, 2])
def test_domino_final_logits_by_hand(diverse_target, prefix):
    drafter = stirred(bound(DominoDrafter, diverse_target, gru_size=8, correction_rank=16,
                            pure_draft_prefix_len=prefix, target_layers=[1]))
    batch, features, anchors = domino_batch(diverse_target)
    out = drafter(batch, features, anchors).materialize()
    base = out.aux["base_logits"]  # (N, A, K, V)
    torch.testing.assert_close(base, drafter.head(out.hidden))
    ids = batch["input_ids"]
    w1, w2 = drafter.embed_proj[0].weight, drafter.embed_proj[2].weight
    for i in range(3):
        for j, n in enumerate(anchors.positions[i].tolist()):
            for t in range(1, 5):  # slot t: the GRU has read x_n .. x_{n+t-1}, one token at a time
                state = None
                for tok in ids[i, n : n + t].tolist():
                    g, state = drafter.gru(diverse_target.embed_tokens(torch.tensor([[tok]])), state)
                z = out.hidden[i, j, t - 1]
                delta = w2 @ F.silu(w1 @ torch.cat([z, g[0, 0]]))
                want = base[i, j, t - 1] + (delta if t > prefix else 0)
                torch.testing.assert_close(out.logits[i, j, t - 1], want, rtol=1e-5, atol=1e-5)


def test_an_untrained_domino_is_its_dflash_backbone(diverse_target):
    """W_2 = 0 at init: the same backbone weights give DFlashDrafter's logits and proposals exactly."""
    domino = bound(DominoDrafter, diverse_target, gru_size=8, context_shortcut=True)
    block = bound(DFlashDrafter, diverse_target, seed=1, context_shortcut=True)
    missing, unexpected = block.load_state_dict(domino.state_dict(), strict=False)
    assert not missing and unexpected and all(k.startswith(("gru.", "embed_proj.")) for k in unexpected)
    batch, features, anchors = domino_batch(diverse_target)
    want = block(batch, features, anchors).logits
    torch.testing.assert_close(domino(batch, features, anchors).logits, want, rtol=0, atol=0)
    prompt = [3, 17, 60, 2, 41, 9, 77]
    for sampling in (GREEDY, T1):
        a = round_after(domino, diverse_target, prompt, sampling)
        b = round_after(block, diverse_target, prompt, sampling)
        assert a.tokens.tolist() == b.tokens.tolist()
        if b.probs is not None:
            torch.testing.assert_close(a.probs, b.probs)


@pytest.mark.parametrize("field,kwargs", [
    ("pure_draft_prefix_len", {"pure_draft_prefix_len": 4}),
    ("gru_size", {"gru_size": 0}),
    ("correction_rank", {"correction_rank": 0}),
])
def test_domino_bad_arguments_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"drafter.{field}"):
        DominoDrafter(block_size=4, **kwargs)


def test_dfly_bad_correction_size_names_the_field():
    with pytest.raises(ValueError, match="drafter.correction_size"):
        DFlyDrafter(correction_size=0)


def test_config_dict_is_the_init_arguments(diverse_target):
    for cls, extra in ((DFlyDrafter, {"hidden_correction": False, "correction_size": 16}),
                       (DominoDrafter, {"gru_size": 8, "correction_rank": 16, "pure_draft_prefix_len": 2})):
        drafter = cls(block_size=4, num_anchors=7, **extra)
        rebuilt = cls(**drafter.config_dict())
        assert rebuilt.config_dict() == drafter.config_dict() and extra.items() <= drafter.config_dict().items()


# ------------------------------------------------------------------------------------------- TwoBranchCE
def test_the_base_weight_decays_linearly_to_zero():
    part = TwoBranchCE(start=0.8, decay_ratio=0.5)
    assert [part.weight(u) for u in (None, 0.0, 0.25, 0.5, 0.9, 1.0)] == pytest.approx([0.8, 0.8, 0.4, 0, 0, 0])
    assert TwoBranchCE(start=1.0, decay_ratio=2.0).weight(1.0) == pytest.approx(0.5)  # still positive at the end


def two_branch_output(logits, base, labels):
    return DraftOutput(logits, labels, torch.ones_like(labels, dtype=torch.bool), aux={"base_logits": base})


def test_two_branch_ce_by_hand_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    logits, base = torch.randn(2, 3, 4, 11, generator=g), torch.randn(2, 3, 4, 11, generator=g)
    labels = torch.randint(0, 11, (2, 3, 4), generator=g)
    ell = TwoBranchCE(start=1.0, decay_ratio=0.8)(two_branch_output(logits, base, labels),
                                                  StepContext(progress=0.2))  # λ = 0.75
    ce = lambda x: F.cross_entropy(x.reshape(-1, 11), labels.reshape(-1), reduction="none").view(2, 3, 4)
    torch.testing.assert_close(ell, 0.25 * ce(logits) + 0.75 * ce(base))

    part = TwoBranchCE(start=0.6)
    fn = lambda a, b: part(two_branch_output(a, b, labels[:1, :1]), StepContext(progress=0.1))
    args = (logits[:1, :1].double().requires_grad_(), base[:1, :1].double().requires_grad_())
    assert torch.autograd.gradcheck(fn, args)


def test_two_branch_ce_needs_the_second_branch(diverse_target):
    drafter = bound(DFlashDrafter, diverse_target, target_layers=[1])
    batch, features, anchors = domino_batch(diverse_target)
    with pytest.raises(ValueError, match="DominoDrafter"):
        Objective(TwoBranchCE(), ExpDecay(2.0))(drafter(batch, features, anchors))


@pytest.mark.parametrize("bad,field", [({"start": 1.5}, "loss.start"), ({"decay_ratio": 0}, "loss.decay_ratio")])
def test_two_branch_ce_bad_arguments_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        TwoBranchCE(**bad)


@pytest.fixture(scope="module")
def target64():
    return load_target("tiny-random", dtype=torch.float64)


@pytest.mark.parametrize("weight", ["decay", "auf"])
def test_domino_objective_in_chunks_equals_the_whole(target64, weight):
    """Both heads of a Domino forward evaluated per chunk of anchors give the whole batch's loss and gradients, with
    the module's training progress reaching the part; AUF's support composes with the two-branch loss."""
    torch.manual_seed(0)
    drafter = DominoDrafter(block_size=3, num_layers=1, num_anchors=7, draft_vocab_size=100, gru_size=8,
                            correction_rank=16)
    position = ExpDecay(2.0) if weight == "decay" else AUFSupport()
    module = DraftModule(drafter, Objective(TwoBranchCE(start=1.0), position), target=target64,
                         feature_cache="off").double()
    module.drafter.vocab.set_from_counts(torch.arange(target64.vocab_size).float())
    stirred(module.drafter)
    module.training_progress = lambda: 0.3  # λ = 0.4: both branches carry gradient
    batch = module.seeded(batch_of(target64), salt=0)
    assert module.draft_and_context(batch, use_cache=False)[1].progress == 0.3  # what the part reads
    results = []
    for loss_chunk in (None, 2):
        module.hparams.loss_chunk = loss_chunk
        module.drafter.zero_grad()
        draft, terms = module.draft_step(batch, use_cache=False)
        assert draft.num_anchors > 2
        terms.num.backward()
        grads = {k: p.grad.clone() for k, p in module.drafter.named_parameters() if p.grad is not None}
        results.append((terms.num.detach(), terms.den, grads))
    (num, den, grads), (num_c, den_c, grads_c) = results
    torch.testing.assert_close(num_c, num, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(den_c, den, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_c.keys() and {"gru.weight_ih_l0", "embed_proj.2.weight"} <= grads.keys()
    for key in grads:
        torch.testing.assert_close(grads_c[key], grads[key], rtol=1e-6, atol=1e-6, msg=key)
    # and the value is the two CEs mixed by λ = 0.4 under the position weight
    draft.materialize()
    ce = Objective(CE(), position)
    final = ce(draft).value
    base = DraftOutput(draft.aux["base_logits"], draft.labels, draft.valid, draft.anchors)
    if weight == "decay":  # AUF's support is taken from the final logits, which the base branch's are not
        torch.testing.assert_close(terms.value, 0.6 * final + 0.4 * ce(base).value)
