"""AdaFlash (Qian et al. 2026, arXiv 2607.19223): its draft loss and its adaptive length head, held to the guarantees.

- ``AdaFlashLoss`` by hand: α = 1 is CE on the target's argmax, α = 0 is T²·KL(q^T ‖ p^T), the per-slot clip;
- ``LengthMSE``: the label is the greedy accepted length (hand-made patterns), the loss sits at one slot per anchor,
  and it trains the head only (the draft loss never reaches the head);
- the head on ``DFlashDrafter``: off by default (no weights, old configs build), ``propose`` submits the cut the head
  predicts, the training forward's ``drafted`` is that cut, greedy decoding stays the target's, sampled decoding stays
  lossless (χ²), offline rounds honour ``drafted`` (greedy: the engine's rounds exactly; sampled: a brute-force
  enumeration), trees ignore the head, and checkpoints round-trip;
- ``init_from`` adds the head to a drafter trained without it (and only that), the regime overlay fits the head
  alone, and benchmarks/length_head.py runs.
"""

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers.benchmarks import run_benchmark
from helpers.decoding import argmax_reference, random_prompts
from helpers.drafters import record_draft_lengths, target_context
from helpers.fits import fit_checkpoint, quiet_trainer
from helpers.offline import enumerate_rounds
from helpers.overlays import QUICKSTART, ROOT, config_files, meant_config, printed_config, printed_of, restated
from helpers.sampling import PROMPT, assert_matches, empirical, exact_joint

from lightning_spec import SamplingConfig, TreeConfig, generate, load_drafter, offline_rounds
from lightning_spec.checkpoint import init_weights, save_drafter
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.drafters import Anchors, DFlashDrafter, DraftOutput
from lightning_spec.evaluation.offline import offline_report
from lightning_spec.module import DraftModule
from lightning_spec.objectives import AdaFlashLoss, ExpDecay, LengthMSE, Mixture, Objective, StepContext
from lightning_spec.objectives.adaflash import greedy_accepted_length

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
OVERLAY = ROOT / "experiments" / "regimes" / "length_head_init.yaml"


@pytest.fixture(scope="module")
def small_target(make_random_llama):
    """Vocabulary 8: an untrained drafter's drafts are often accepted, so runs of every length happen."""
    return make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0, eos=3)


def spread_head(drafter: DFlashDrafter, target, scale: float = 1.5, prefix: list[int] = ()) -> DFlashDrafter:
    """Random head weights rescaled so that its logit has median 0 and spread ``scale`` on random blocks (after
    ``prefix``): the predictions (and so the cuts) range over the whole 0..1 instead of sitting at the init's 0.5."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (16, 24), generator=g)
    ids[:, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    features = target(ids, layers=drafter.target_layers, logits=False).features
    head = drafter.length
    blocks = torch.arange(len(prefix) - 1, len(prefix) + 3) if prefix else torch.arange(20)  # (A,) the anchors
    with torch.no_grad():
        for layer in (head.down, head.res, head.out):
            layer.weight.normal_(std=1.0, generator=g)
        seen = []
        hook = head.out.register_forward_hook(lambda module, args, out: seen.append(out))
        drafter(batch, features, Anchors.all(blocks.expand(16, -1)))
        hook.remove()
        z = seen[0]
        a = scale / z.std()
        head.out.weight.mul_(a)
        head.out.bias.mul_(a).sub_(a * z.median())
    return drafter


def with_head(target, make_block_drafter, k: int = 4, seed: int = 0, prefix: list[int] = (), **kwargs) -> DFlashDrafter:
    drafter = make_block_drafter(target, block_size=k, seed=seed, length_head=True, **kwargs)
    return spread_head(drafter, target, prefix=prefix)


def run(drafter, target, batch, anchors=None) -> DraftOutput:
    features = target(batch["input_ids"], layers=drafter.target_layers, logits=False).features
    return drafter(batch, features, anchors)


def random_batch(target, n: int = 2, s: int = 18, prompt: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (n, s), generator=g)
    mask = torch.zeros(n, s, dtype=torch.bool)
    mask[:, prompt:] = True
    return {"input_ids": ids, "loss_mask": mask}


# ------------------------------------------------------------------------------------------------- the losses
def test_adaflash_loss_by_hand():
    torch.manual_seed(0)
    n, a, k, v = 2, 3, 4, 7
    logits = torch.randn(n, a, k, v, dtype=torch.float64, requires_grad=True)
    target = torch.randn(n, a, k, v, dtype=torch.float64) * 2
    valid = torch.ones(n, a, k, dtype=torch.bool)
    draft = DraftOutput(logits, torch.zeros(n, a, k, dtype=torch.long), valid, torch.zeros(n, a, dtype=torch.long))
    ctx = StepContext(target_logits=target)
    assert AdaFlashLoss.needs_target
    ce = F.cross_entropy(logits.reshape(-1, v), target.argmax(-1).reshape(-1), reduction="none").view(n, a, k)
    torch.testing.assert_close(AdaFlashLoss(alpha=1.0)(draft, ctx), ce)  # α = 1: CE on argmax p (at T = 1 always)
    torch.testing.assert_close(AdaFlashLoss(alpha=1.0, temperature=3.0)(draft, ctx), ce)
    for t in (1.0, 2.0):
        q, p = (logits / t).softmax(-1), (target / t).softmax(-1)
        rkl = t**2 * (q * (q.log() - p.log())).sum(-1)  # T²·KL(q^T ‖ p^T), reverse
        close = dict(rtol=1e-5, atol=1e-6)  # p is formed in float32 (SamplingConfig), as for every loss
        torch.testing.assert_close(AdaFlashLoss(alpha=0.0, temperature=t)(draft, ctx), rkl, **close)
        torch.testing.assert_close(AdaFlashLoss(alpha=0.8, temperature=t)(draft, ctx), 0.8 * ce + 0.2 * rkl, **close)
    assert not torch.allclose(rkl, t**2 * (p * (p.log() - q.log())).sum(-1))  # not the forward KL

    # the clip: min(T²·KL, c) per slot; a clipped slot passes no gradient through that term
    rkl = (logits.softmax(-1) * (logits.log_softmax(-1) - target.log_softmax(-1))).sum(-1)
    middle = rkl.detach().flatten().sort().values[11:13]
    clip = float(middle.mean())  # half of the slots above it, none at it
    loss = AdaFlashLoss(alpha=0.0, rkl_clip=clip)(draft, ctx)
    torch.testing.assert_close(loss, rkl.clamp(max=clip), rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    clipped = rkl.detach() > clip
    assert bool(clipped.any()) and bool((~clipped).any())
    assert bool((grad[clipped] == 0).all()) and bool((grad[~clipped].abs().sum(-1) > 0).all())
    for kwargs, field in [({"alpha": 1.5}, "loss.alpha"), ({"temperature": 0.0}, "loss.temperature"),
                          ({"rkl_clip": 0.0}, "loss.rkl_clip")]:
        with pytest.raises(ValueError, match=field):
            AdaFlashLoss(**kwargs)


# per anchor: which slots the draft's argmax gets right, which slots are valid, and the greedy accepted length
PATTERNS = [
    ([1, 1, 0, 1], [1, 1, 1, 1], 2),  # a miss at slot 3 ends the run; the later hit does not count
    ([1, 1, 1, 1], [1, 1, 1, 1], 4),  # all accepted
    ([1, 0, 1, 1], [1, 1, 1, 1], 1),
    ([1, 1, 1, 1], [1, 0, 1, 1], 1),  # an invalid slot ends the run
    ([0, 1, 1, 1], [0, 1, 1, 1], 0),  # slot 1 outside the draft vocabulary: nothing accepted, the anchor counts
    ([1, 1, 1, 1], [0, 0, 0, 0], 0),  # no valid slot: the anchor does not count
]


def test_length_label_is_the_greedy_accepted_length_by_hand():
    a, k, v = len(PATTERNS), 4, 6
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, v, (1, a, k), generator=g)
    matched = torch.tensor([[p[0] for p in PATTERNS]], dtype=torch.bool)
    valid = torch.tensor([[p[1] for p in PATTERNS]], dtype=torch.bool)
    argmax = torch.where(matched, labels, (labels + 1) % v)  # the draft's greedy token
    logits = F.one_hot(argmax, v).double() * 5 + torch.rand(1, a, k, v, generator=g, dtype=torch.float64)
    pred = torch.tensor([[0.1, 0.9, 0.5, 0.2, 0.7, 0.3]], dtype=torch.float64, requires_grad=True)
    draft = DraftOutput(logits, labels, valid, torch.zeros(1, a, dtype=torch.long), aux={"length": pred})
    lengths = [p[2] for p in PATTERNS]
    assert greedy_accepted_length(matched, valid).tolist() == [lengths]
    assert not LengthMSE.needs_target

    loss = LengthMSE()(draft, StepContext())  # (1, A, K)
    y = [min((ell + 1) / k, 1.0) for ell in lengths]  # clamp((ℓ + lookahead) / K, 0, 1): 0.75, 1, 0.5, 0.5, 0.25
    first = [0, 0, 0, 0, 1, None]  # the first valid slot holds the anchor's loss
    want = torch.zeros(1, a, k, dtype=torch.float64)
    for i, slot in enumerate(first):
        if slot is not None:
            want[0, i, slot] = (pred[0, i].item() - y[i]) ** 2
    torch.testing.assert_close(loss.detach(), want)
    no_lookahead = LengthMSE(lookahead=0)(draft, StepContext()).detach().sum(-1)[0, :5]
    torch.testing.assert_close(no_lookahead, (pred[0, :5].detach() - torch.tensor(lengths[:5]) / k) ** 2)
    # in its objective: the mean over the anchors that have a valid slot
    terms = Objective(LengthMSE(), normalize="anchors")(draft)
    assert float(terms.den) == 5
    torch.testing.assert_close(terms.value, want.sum() / 5)
    with pytest.raises(ValueError, match=r"draft.aux\['length'\]"):
        LengthMSE()(DraftOutput(logits, labels, valid, torch.zeros(1, a, dtype=torch.long)), StepContext())


def test_length_mse_trains_the_head_only_and_the_draft_loss_never_reaches_it(diverse_target, make_block_drafter):
    drafter = spread_head(make_block_drafter(diverse_target, block_size=4, length_head=True), diverse_target).train()
    batch = random_batch(diverse_target)
    anchors = Anchors.all(torch.arange(3, 16).expand(2, -1))  # the same blocks for every objective below
    head = {f"length.{name}" for name, _ in drafter.length.named_parameters()}

    def grads(objective) -> dict:
        drafter.zero_grad(set_to_none=True)
        draft = run(drafter, diverse_target, batch, anchors)
        terms = objective(draft, target_context(draft, drafter, diverse_target, batch))
        (terms.num / terms.den).backward()
        return {name: p.grad for name, p in drafter.named_parameters()}

    length = grads(Objective(LengthMSE(), normalize="anchors"))
    assert all(length[name] is not None and float(length[name].abs().sum()) > 0 for name in head)
    assert all(length[name] is None for name in length if name not in head)  # the drafter itself: nothing
    draft_loss = grads(Objective(AdaFlashLoss(), ExpDecay(7.0)))
    assert all(draft_loss[name] is None for name in head)
    assert float(draft_loss["fc.weight"].abs().sum()) > 0
    # AdaFlash adds the two: each part's gradient lands where it belongs
    both = grads(Mixture([Objective(AdaFlashLoss(), ExpDecay(7.0)), Objective(LengthMSE(), normalize="anchors")],
                         [1.0, 1.0]))
    for name, grad in both.items():
        torch.testing.assert_close(grad, length[name] if name in head else draft_loss[name])
    # chunks of anchors give the same value
    draft = run(drafter, diverse_target, batch, anchors)
    objective = Objective(LengthMSE(), normalize="anchors")
    torch.testing.assert_close(objective(draft, chunk=3).value, objective(draft).value)


# --------------------------------------------------------------------------------------------- the drafter
def test_the_head_is_off_by_default_and_old_configs_build(diverse_target, make_block_drafter):
    plain = make_block_drafter(diverse_target, block_size=4, seed=3)
    assert plain.length is None and not any(k.startswith("length.") for k in plain.state_dict())
    assert plain.config_dict()["length_head"] is False
    out = run(plain, diverse_target, random_batch(diverse_target))
    assert out.aux == {} and out.drafted is None
    # the same seed gives the same backbone with the head
    headed = make_block_drafter(diverse_target, block_size=4, seed=3, length_head=True)
    state = headed.state_dict()
    assert {k for k in state if not k.startswith("length.")} == set(plain.state_dict())
    assert all(torch.equal(v, state[k]) for k, v in plain.state_dict().items())
    # a config written before the head existed (no length_* keys) builds the same drafter
    old = {k: v for k, v in plain.config_dict().items() if not k.startswith("length")}
    rebuilt = DFlashDrafter(**old)
    rebuilt.bind(diverse_target)
    rebuilt.load_state_dict(plain.state_dict())
    for kwargs, field in [({"length_rate": 0.0}, "drafter.length_rate"), ({"length_min": 5}, "drafter.length_min"),
                          ({"length_min": -1}, "drafter.length_min")]:
        with pytest.raises(ValueError, match=field):
            DFlashDrafter(block_size=4, length_head=True, **kwargs)


@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "T1"])
def test_propose_submits_the_cut_the_head_predicts_and_the_forward_reports_it(diverse_target, make_block_drafter,
                                                                            sampling):
    k = 4
    drafter = with_head(diverse_target, make_block_drafter, k=k, length_min=0)
    cuts = set()
    for i, prompt in enumerate(random_prompts(diverse_target.vocab_size, lengths=(3, 7, 12, 5, 9, 4, 6, 10))):
        prefix = diverse_target(torch.tensor([prompt[:-1]]), layers=drafter.target_layers, logits=False).features
        state = drafter.begin(prefix)
        anchor = torch.tensor(prompt[-1:])
        with torch.no_grad():
            pred = float(drafter.length(drafter.block_hidden(state, anchor)[0, 1:]))
        proposal = drafter.propose(state, anchor, sampling, torch.Generator().manual_seed(i))
        cut = proposal.num_drafted
        assert cut == min(max(round(pred * k * drafter.length_rate), 0), k)  # clamp(round(pred K rate), min, K)
        cuts.add(cut)
        ids = torch.tensor([prompt + proposal.tokens.tolist() + [0] * (k - cut)])  # the realised tokens, then filler
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
        out = run(drafter, diverse_target, batch, Anchors.all(torch.tensor([[len(prompt) - 1]])))
        assert int(out.drafted[0, 0]) == cut
        assert float(out.aux["length"][0, 0].detach()) == pytest.approx(pred, abs=1e-5)
        if cut and sampling.greedy:
            assert proposal.tokens.tolist() == out.logits[0, 0, :cut].argmax(-1).tolist()
        elif cut:
            torch.testing.assert_close(proposal.probs, T1.probs(out.logits[0, 0, :cut]), rtol=1e-4, atol=1e-6)
        drafter.use_length_head = False  # the run-time switch: full blocks, no cut reported, the head still runs
        assert drafter.propose(state, anchor, sampling, torch.Generator()).num_drafted == k
        off = run(drafter, diverse_target, batch, Anchors.all(torch.tensor([[len(prompt) - 1]])))
        assert off.drafted is None and "length" in off.aux
        drafter.use_length_head = True
    assert len(cuts) >= 3, cuts


def test_greedy_decoding_is_lossless_and_offline_rounds_honour_the_cut(small_target, make_block_drafter):
    lengths, accepted, differs = set(), 0, False
    for seed, k in [(0, 2), (1, 3), (2, 4)]:
        drafter = with_head(small_target, make_block_drafter, k=k, seed=seed, length_min=0)
        pairs, cut_rounds, full_rounds = [], [], []
        for i, prompt in enumerate([[1, 5, 3, 0], [6], [2, 2, 7, 1, 4, 4], [0, 1]]):
            prompt = prompt + [seed + i]
            cut = generate(small_target, prompt, 16, GREEDY, drafter=drafter)
            assert cut.tokens == argmax_reference(small_target, prompt, 16)  # shorter blocks, the same output
            assert all(0 <= d <= k for d in cut.draft_lengths)
            lengths.update(cut.draft_lengths)
            accepted += sum(cut.accept_lengths)
            drafter.use_length_head = False
            full_rounds.append(float(generate(small_target, prompt, 16, GREEDY, drafter=drafter).rounds))
            drafter.use_length_head = True
            pairs.append((prompt, cut.tokens))
            cut_rounds.append(float(cut.rounds))
        assert offline_rounds(small_target, drafter, pairs, GREEDY, batch_size=3).tolist() == cut_rounds
        drafter.use_length_head = False  # the same rollouts scored without the cut: the engine's full-block rounds
        assert offline_rounds(small_target, drafter, pairs, GREEDY, batch_size=3).tolist() == full_rounds
        differs |= cut_rounds != full_rounds
    assert {0, 4} <= lengths and len(lengths) >= 4, lengths  # empty, full and cut blocks all ran
    assert accepted > 0 and differs  # drafts were accepted, and the cut changed the rounds


def test_sampled_offline_rounds_equal_brute_force_enumeration_with_cut_blocks(small_target, make_block_drafter):
    """Under T = 1: the offline evaluator's exact rounds against every acceptance pattern of the DECODING path (the
    proposal's own probabilities, with A = 0 past its cut)."""
    k = 3
    drafter = with_head(small_target, make_block_drafter, k=k, seed=2, length_min=0)
    cuts = set()
    pairs = [(p, generate(small_target, p, 7 + i, T1, seed=i).tokens)
             for i, p in enumerate([[1, 5, 3, 0], [6], [2, 2, 7]])]
    report = offline_report(small_target, drafter, pairs, T1, batch_size=2)
    reached, accepted = [0.0] * k, [0.0] * k
    for (prompt, response), rounds in zip(pairs, report.rounds.tolist()):
        x = torch.tensor(prompt + response)
        s = len(x)
        p = T1.probs(small_target(x[None]).logits[0].double()).double()  # (S, V): row t - 1 gives p_t
        features = small_target(x[None], layers=drafter.target_layers, logits=False).features
        accept, drafted = {}, {}
        for n in range(len(prompt) - 1, s - 1):
            proposal = drafter.propose(drafter.begin(features[:, :n]), x[n : n + 1], T1)
            cut = drafted[n] = proposal.num_drafted
            cuts.add(cut)
            row = []
            for h in range(min(k, s - 1 - n)):
                p_x = float(p[n + h, x[n + 1 + h]])
                q_x = float(proposal.probs[h, x[n + 1 + h]]) if h < cut else 0.0
                row.append(min(1.0, q_x / p_x) if p_x > 0 else 0.0)
            accept[n] = row + [0.0] * (k - len(row))
        want, re, ac = enumerate_rounds(accept, len(prompt) - 1, s - 1, k, drafted)
        assert rounds == pytest.approx(want, rel=1e-5, abs=1e-6)
        reached = [a + b for a, b in zip(reached, re)]
        accepted = [a + b for a, b in zip(accepted, ac)]
    assert len(cuts) >= 3, cuts
    # per slot too: AR_k's denominator counts only the rounds that submitted slot k
    assert report.slot_reached.tolist() == pytest.approx(reached, rel=1e-5, abs=1e-6)
    assert report.slot_accepted.tolist() == pytest.approx(accepted, rel=1e-5, abs=1e-6)


def test_sampling_is_lossless_with_the_head(make_random_llama, make_block_drafter):
    target = make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)
    drafter = with_head(target, make_block_drafter, k=2, length_min=0, prefix=PROMPT)  # cuts vary after PROMPT
    lengths = record_draft_lengths(drafter)
    counts, _ = empirical(target, T1, drafter, runs=1000)
    assert_matches(counts, exact_joint(target, PROMPT, T1), target.vocab_size, 3, "length head")
    assert set(lengths) == {0, 1, 2}, sorted(set(lengths))


def test_trees_ignore_the_head(diverse_target, make_block_drafter):
    drafter = with_head(diverse_target, make_block_drafter, k=4)
    tree = TreeConfig(nodes=6, top_k=2)
    for prompt in random_prompts(diverse_target.vocab_size, lengths=(3, 7, 12)):
        state = drafter.begin(diverse_target(torch.tensor([prompt[:-1]]), layers=drafter.target_layers,
                                             logits=False).features)
        anchor = torch.tensor(prompt[-1:])
        with_cut = drafter.position_logits(state, anchor)
        grown = generate(diverse_target, prompt, 12, GREEDY, drafter=drafter, plan=tree)
        drafter.use_length_head = False
        assert torch.equal(drafter.position_logits(state, anchor), with_cut)
        full = generate(diverse_target, prompt, 12, GREEDY, drafter=drafter, plan=tree)
        drafter.use_length_head = True
        assert grown.tokens == full.tokens == argmax_reference(diverse_target, prompt, 12)
        assert grown.draft_lengths == full.draft_lengths and grown.rounds == full.rounds


def test_offline_tree_rounds_with_the_head_are_the_real_tree_rounds(small_target, make_block_drafter):
    """The head cuts chains only: offline tree scoring must ignore ``drafted`` as tree decoding does."""
    drafter = with_head(small_target, make_block_drafter, k=3, length_min=0)
    tree = TreeConfig(nodes=4, top_k=2)
    pairs, real = [], []
    for prompt in ([1, 5, 3, 0], [6, 2], [2, 2, 7, 1, 4, 4], [0, 1, 3]):
        gen = generate(small_target, prompt, 16, GREEDY, drafter=drafter, plan=tree)
        pairs.append((prompt, gen.tokens))
        real.append(float(gen.rounds))
    assert offline_rounds(small_target, drafter, pairs, GREEDY, tree=tree, batch_size=2).tolist() == real


# ---------------------------------------------------------------------------------------- checkpoints, regime
def test_a_drafter_with_the_head_round_trips(diverse_target, make_block_drafter, tmp_path):
    drafter = with_head(diverse_target, make_block_drafter, k=4, length_rate=1.1, length_min=2)
    ckpt = fit_checkpoint(drafter, tmp_path / "last.ckpt", diverse_target.name)
    prompt = random_prompts(diverse_target.vocab_size, lengths=(6,))[0]
    want = generate(diverse_target, prompt, 12, GREEDY, drafter=drafter)
    for path in (ckpt, save_drafter(drafter, tmp_path / "exported", diverse_target.name)):
        loaded = load_drafter(path, target=diverse_target)
        assert loaded.config_dict() == drafter.config_dict() and loaded.use_length_head
        assert (loaded.length_head, loaded.length_rate, loaded.length_min) == (True, 1.1, 2)
        got = loaded.state_dict()
        assert any(k.startswith("length.") for k in got)
        assert got.keys() == drafter.state_dict().keys()
        assert all(torch.equal(v, got[k]) for k, v in drafter.state_dict().items())
        again = generate(diverse_target, prompt, 12, GREEDY, drafter=loaded)
        assert (again.tokens, again.draft_lengths) == (want.tokens, want.draft_lengths)


def test_init_from_adds_the_head_to_a_drafter_trained_without_it(diverse_target, make_block_drafter, tmp_path):
    plain = make_block_drafter(diverse_target, block_size=3, seed=1)
    folder = save_drafter(plain, tmp_path / "plain", diverse_target.name)
    child = make_block_drafter(diverse_target, block_size=3, seed=2, length_head=True)
    fresh = {k: v.clone() for k, v in child.state_dict().items() if k.startswith("length.")}
    parent = init_weights(child, folder, diverse_target.fingerprints)
    assert parent["path"] == str(folder)
    got = child.state_dict()
    assert all(torch.equal(v, got[k]) for k, v in plain.state_dict().items())  # the trained drafter's weights
    assert all(torch.equal(v, got[k]) for k, v in fresh.items())  # the head keeps its own
    # only the added head may be missing: a file WITH the head does not load into a drafter without one, nor a file
    # of other sizes into one with the head
    headed = save_drafter(child, tmp_path / "headed", diverse_target.name)
    with pytest.raises(ValueError, match=r"does not fit model.drafter .*length\."):
        init_weights(make_block_drafter(diverse_target, block_size=3), headed, diverse_target.fingerprints)
    with pytest.raises(ValueError, match="does not fit model.drafter"):
        init_weights(make_block_drafter(diverse_target, block_size=3, num_layers=2, length_head=True), folder,
                     diverse_target.fingerprints)


def test_the_overlay_fits_the_head_on_the_quickstart():
    files = config_files(OVERLAY)
    assert files == [QUICKSTART, OVERLAY]
    assert restated(yaml.safe_load(OVERLAY.read_text()), yaml.safe_load(QUICKSTART.read_text())) == []
    printed = printed_config(*files)
    assert printed == printed_of(meant_config(files))
    assert printed["model"]["drafter"]["init_args"]["length_head"] is True
    objective = printed["model"]["objective"]["init_args"]
    assert objective["loss"]["class_path"] == "lightning_spec.objectives.LengthMSE"
    assert objective["position_weight"]["class_path"] == "lightning_spec.objectives.Uniform"
    assert objective["normalize"] == "anchors"


def test_fitting_the_head_alone_leaves_the_drafter_as_trained(tiny_target, make_block_drafter, data_files,
                                                             tmp_path):
    """The regime of the overlay: init_from a drafter without the head, LengthMSE alone: the head moves, nothing
    else does."""
    start = make_block_drafter(tiny_target, block_size=3, seed=0, num_anchors=8)
    folder = save_drafter(start, tmp_path / "dflash", "tiny-random")
    dm = SpecDataModule(target="tiny-random", train_sources=[data_files["train"]], eval_sources=[data_files["eval"]],
                        train_limit=None, max_length=64, batch_size=4, val_fraction=0.2)
    module = DraftModule(DFlashDrafter(block_size=3, num_layers=1, num_anchors=8, length_head=True),
                         Objective(LengthMSE(), normalize="anchors"), target="tiny-random", lr=1e-2,
                         init_from=str(folder))
    head_before = {k: v.clone() for k, v in module.drafter.state_dict().items() if k.startswith("length.")}
    quiet_trainer(max_steps=3, default_root_dir=tmp_path).fit(module, datamodule=dm)
    got = module.drafter.state_dict()
    assert all(torch.equal(v, got[k]) for k, v in start.state_dict().items())
    assert any(not torch.equal(v, got[k]) for k, v in head_before.items())


def test_the_benchmark_compares_the_same_drafter_with_and_without_the_head():
    out = run_benchmark("length_head.py", "--target", "tiny-random", "--prompts", "2", "--max-new-tokens", "8",
                        "--block-size", "4", "--threads", "1")
    assert "with / without the head: tokens/s" in out and "cuts chosen by the head" in out
    rows = [line.split() for line in out.splitlines()
            if line.strip().startswith(("plain (drafter", "with the head", "without (K"))]
    assert len(rows) == 3 and all(row[-1] == "2/2" for row in rows)  # greedy: every output equals plain decoding
