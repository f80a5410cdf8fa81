"""DSpark (Cheng et al. 2026, arXiv 2607.05147): its pieces by hand, and its variable-length blocks held to the
guarantees (tests/drafters/test_families.py runs the generic ones for "dspark" and "dspark_rnn").

- the Markov head (Eq. 5), the RNN head (Eq. 6) and the confidence head (Eq. 7) against their formulas, teacher-forced
  on the gold previous tokens;
- the decoding invariant directly: ``propose`` draws slot t from the distribution the training forward gives slot t
  on the realised tokens, and the forward's ``drafted`` is the cut ``propose`` made;
- the prefix scheduler against a literal transcription of Alg. 1, and its non-anticipation;
- with the scheduler cutting blocks: greedy output = the target's, offline rounds = the engine's, and χ² losslessness;
- ``ConfidenceBCE`` (Eq. 8, 11) by hand, with no gradient through c*; the overlay's objective = 0.1 CE + 0.9 L1 + BCE;
- Sequential Temperature Scaling recovers known temperatures; ``calibrate`` stores them in the drafter state.
"""

import math
from pathlib import Path

import pytest
import torch
import yaml
from helpers.decoding import MAX_NEW, argmax_reference, random_prompts
from helpers.drafters import record_draft_lengths, target_context
from helpers.sampling import PROMPT, assert_matches, empirical, exact_joint

from lightning_spec import SamplingConfig, generate, load_drafter, offline_rounds
from lightning_spec.checkpoint import build, save_drafter
from lightning_spec.drafters import Anchors, DraftOutput, DSparkDrafter
from lightning_spec.drafters.dspark import (
    MarkovHead,
    cpu_verify_cost,
    expected_calibration_error,
    prefix_length,
    sequential_temperature_scaling,
)
from lightning_spec.evaluation.offline import offline_report
from lightning_spec.objectives import CE, TV, ConfidenceBCE, ExpDecay, Mixture, Objective, StepContext

ROOT = Path(__file__).resolve().parents[2]
K = 4
GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
CUTTING = [1.0, 1.3, 1.6, 1.9, 2.2]  # cost(T) = 1 + 0.3 (T - 1): admitting a slot pays only while a_j is large
MILD = [1.0, 1.05, 1.1, 1.15, 1.2]  # cost(T) = 1 + 0.05 (T - 1): the trained drafter below drafts 3 or 4 slots


def dspark(target, k: int = K, seed: int = 0, draft_vocab: int | None = None, **kwargs) -> DSparkDrafter:
    torch.manual_seed(seed)
    drafter = DSparkDrafter(block_size=k, num_layers=1, num_anchors=64, markov_rank=8, draft_vocab_size=draft_vocab,
                            **kwargs)
    drafter.bind(target)
    if draft_vocab is not None:  # the highest ids: low ids (the anchors of these tests) fall outside
        drafter.vocab.set_from_counts(torch.arange(target.vocab_size).float())
    return drafter.eval()


def token_dependent_confidence(drafter: DSparkDrafter) -> DSparkDrafter:
    """A confidence head whose c_k swings with the previous token (large W1 rows, a large weight on them), so the
    scheduler cuts blocks at different slots from round to round."""
    with torch.no_grad():
        drafter.sequential.embed.weight.normal_(std=1.0)
        drafter.confidence.weight[:, -drafter.markov_rank :].normal_(std=1.0)
        drafter.confidence.bias.fill_(1.0)
    return drafter


def random_batch(target, n: int = 2, s: int = 18, prompt: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (n, s), generator=g)
    mask = torch.zeros(n, s, dtype=torch.bool)
    mask[:, prompt:] = True
    return {"input_ids": ids, "loss_mask": mask}


def run(drafter, target, batch, anchors=None) -> DraftOutput:
    features = target(batch["input_ids"], layers=drafter.target_layers, logits=False).features
    return drafter(batch, features, anchors)


def every_anchor(batch) -> Anchors:
    n, s = batch["input_ids"].shape
    return Anchors.all(torch.arange(s - 1).expand(n, -1))


# ------------------------------------------------------------------------------------------- the heads by hand
def test_forward_shapes_and_the_slot_layout(diverse_target):
    drafter = dspark(diverse_target, draft_vocab=50)
    batch = random_batch(diverse_target)
    out = run(drafter, diverse_target, batch)
    n, a = out.anchors.shape
    h = diverse_target.hidden_size
    assert out.hidden.shape == (n, a, K, h) and out.logits.shape == (n, a, K, 50)
    assert out.aux["confidence"].shape == (n, a, K) and out.drafted.shape == (n, a)
    assert int(out.drafted.min()) >= 0 and int(out.drafted.max()) <= K
    assert drafter.mask_embedding.shape == (K - 1, h)  # the anchor slot is a prediction: K inputs, K outputs
    gold = batch["input_ids"].gather(1, (out.anchors[..., None] + torch.arange(1, K + 1)).clamp(max=17).view(n, -1))
    labels, inside = drafter.vocab.to_draft(gold.view(n, a, K))
    assert torch.equal(out.labels[out.valid], labels[out.valid]) and bool(inside[out.valid].all())


@pytest.mark.parametrize("markov", ["vanilla", "rnn"])
def test_markov_and_confidence_heads_by_hand(diverse_target, markov):
    drafter = dspark(diverse_target, draft_vocab=50, markov=markov)
    with torch.no_grad():  # trained-looking heads: B and c far from their near-zero init
        for p in (*drafter.sequential.parameters(), *drafter.confidence.parameters()):
            p.normal_(std=0.5)
    batch = random_batch(diverse_target)
    out = run(drafter, diverse_target, batch)
    ids, vd = batch["input_ids"], 50
    n, a = out.anchors.shape
    prev = ids.gather(1, (out.anchors[..., None] + torch.arange(K)).clamp(max=17).view(n, -1)).view(n, a, K)
    rows = torch.where(prev >= 96 - vd, prev - (96 - vd), torch.full_like(prev, vd))  # ids 46..95 are 0..49
    assert bool((rows == vd).any()) and bool((rows < vd).any())  # tokens outside the draft vocabulary share a row
    w1, w2 = drafter.sequential.embed.weight, drafter.sequential.out.weight  # (Vd + 1, r), (Vd, r)
    e = w1[rows]  # (N, A, K, r) W1[x_{k-1}], x_0 = the anchor, then the gold tokens
    if markov == "vanilla":
        m = e  # Eq. 5
    else:  # Eq. 6, written out: z = [s; W1[x]; h], s' = σ(W_g z) s + (1 - σ(W_g z)) tanh(W_c z), m = tanh(W_o z)
        r = drafter.markov_rank
        wg, wc, wo = drafter.sequential.rnn.weight.split(r)
        bg, bc, bo = drafter.sequential.rnn.bias.split(r)
        s, ms = torch.zeros(n, a, r), []
        for k in range(K):
            z = torch.cat([s, e[:, :, k], out.hidden[:, :, k]], -1)
            g = torch.sigmoid(z @ wg.T + bg)
            ms.append(torch.tanh(z @ wo.T + bo))
            s = g * s + (1 - g) * torch.tanh(z @ wc.T + bc)
        m = torch.stack(ms, 2)
    expected = drafter.head(out.hidden) + m @ w2.T  # U_k + B_k (Eq. 4)
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
    conf = torch.cat([out.hidden, e], -1) @ drafter.confidence.weight[0] + drafter.confidence.bias  # Eq. 7
    torch.testing.assert_close(out.aux["confidence"], conf, rtol=1e-5, atol=1e-5)


def test_markov_head_gradient_check():
    torch.manual_seed(0)
    head = MarkovHead("rnn", rank=3, rows=6, hidden=4, vocab=5).double()
    prev = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)  # (N, K, r)
    hidden = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p, h: head.out(head.unroll(p, h)), (prev, hidden))


# --------------------------------------------------------------------------------- the decoding invariant
@pytest.mark.parametrize("markov", ["vanilla", "rnn"])
def test_propose_draws_from_the_forward_distributions_and_cuts_where_it_says(diverse_target, markov):
    drafter = token_dependent_confidence(dspark(diverse_target, draft_vocab=60, markov=markov, verify_cost=CUTTING))
    lengths = set()
    for i, prompt in enumerate(random_prompts(diverse_target.vocab_size, lengths=(3, 7, 12, 5, 9, 4))):
        prefix = diverse_target(torch.tensor([prompt[:-1]]), layers=drafter.target_layers, logits=False).features
        state = drafter.begin(prefix)
        proposal = drafter.propose(state, torch.tensor(prompt[-1:]), T1, torch.Generator().manual_seed(i))
        k = proposal.num_drafted
        lengths.add(k)
        ids = torch.tensor([prompt + proposal.tokens.tolist() + [0] * (K - k)])  # the realised tokens, then filler
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
        out = run(drafter, diverse_target, batch, Anchors.all(torch.tensor([[len(prompt) - 1]])))
        assert int(out.drafted[0, 0]) == k
        if k:
            q = T1.probs(out.logits[0, 0, :k])  # (k, Vd)
            torch.testing.assert_close(q, proposal.probs[:, drafter.vocab.ids], rtol=1e-4, atol=1e-6)
    assert len(lengths) >= 2, lengths  # the scheduler did cut blocks at different slots


# ------------------------------------------------------------------------------------------- the scheduler
def algorithm_1(conf: list[float], cost: list[float]) -> int:
    """DSpark Alg. 1 for one request, line by line, in Python floats (SPS(B) = 1 / cost(B))."""
    survive = [math.prod(conf[: j + 1]) for j in range(len(conf))]
    candidates = sorted(((a, j + 1) for j, a in enumerate(survive) if a > 0), key=lambda x: -x[0])
    length, batch, tau = 0, 1, 1.0
    best, chosen = tau / cost[batch - 1], 0
    for a, j in candidates:
        length, batch, tau = j, batch + 1, tau + a
        theta = tau / cost[batch - 1]
        if theta > best:
            best, chosen = theta, length
        else:
            break
    return chosen


def test_prefix_length_is_algorithm_1():
    cost = torch.tensor([1.0, 1.45, 1.49, 1.53])
    # Θ = 1, 1.9 / 1.45 = 1.310, 2.35 / 1.49 = 1.577, 2.395 / 1.53 = 1.565: two slots
    assert int(prefix_length(torch.tensor([0.9, 0.5, 0.1]), cost)) == 2
    assert int(prefix_length(torch.tensor([0.4, 0.99, 0.99]), cost)) == 0  # Θ(1) = 1.4 / 1.45 < 1: nothing
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        k = int(torch.randint(1, 7, (1,), generator=g))
        conf = torch.rand(k, generator=g) ** 0.3
        cost = torch.cat([torch.ones(1), 1 + torch.rand(k, generator=g).cumsum(0) * 0.2])
        expected = algorithm_1(conf.tolist(), cost.tolist())
        assert int(prefix_length(conf, cost)) == expected
        if expected + 1 < k:  # non-anticipating: c after the slot that stopped it cannot matter
            changed = conf.clone()
            changed[expected + 1 :] = torch.rand(k - expected - 1, generator=g)
            assert int(prefix_length(changed, cost)) == expected


def test_default_verify_cost_and_bad_arguments(diverse_target):
    assert [round(cpu_verify_cost(t), 2) for t in (1, 2, 4, 9)] == [1.0, 1.45, 1.53, 1.73]
    drafter = DSparkDrafter(block_size=3)
    assert drafter.costs.tolist() == pytest.approx([1.0, 1.45, 1.49, 1.53])
    with pytest.raises(ValueError, match="drafter.verify_cost"):
        DSparkDrafter(block_size=3, verify_cost=[1.0, 1.2])
    with pytest.raises(ValueError, match="drafter.markov "):
        DSparkDrafter(markov="gru")
    with pytest.raises(ValueError, match="drafter.markov_rank"):
        DSparkDrafter(markov_rank=0)


# ---------------------------------------------------------------------- variable-length blocks, end to end
def dspark_objective(gamma: float = 4.0) -> Mixture:
    part = lambda loss: Objective(loss, ExpDecay(gamma))  # noqa: E731
    return Mixture([part(CE()), part(TV()), part(ConfidenceBCE())], [0.1, 1.8, 1.0])


@pytest.fixture(scope="module")
def cutting_drafter(diverse_target):
    """A DSpark drafter trained with its own loss on the target's greedy continuations (its confidence head learns
    where it is accepted), with a verify cost that makes the scheduler cut."""
    prompts = random_prompts(diverse_target.vocab_size)
    drafter = dspark(diverse_target, verify_cost=MILD).train()
    rows = [p + argmax_reference(diverse_target, p, MAX_NEW) for p in prompts]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, row) in enumerate(zip(prompts, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(p) : len(row)] = True
    batch = {"input_ids": ids, "loss_mask": mask}
    objective = dspark_objective()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(40):
        draft = run(drafter, diverse_target, batch)
        terms = objective(draft, target_context(draft, drafter, diverse_target, batch))
        opt.zero_grad()
        (terms.num / terms.den).backward()
        opt.step()
    return drafter.eval(), prompts


def test_cut_blocks_keep_greedy_output_and_offline_rounds_exact(cutting_drafter, diverse_target):
    drafter, prompts = cutting_drafter
    pairs, real, drafted = [], [], []
    for prompt in prompts:
        out = generate(diverse_target, prompt, MAX_NEW, drafter=drafter)
        assert out.tokens == argmax_reference(diverse_target, prompt, MAX_NEW)
        pairs.append((prompt, out.tokens))
        real.append(float(out.rounds))
        drafted += out.draft_lengths
    assert any(0 < d < K for d in drafted) and K in drafted, drafted  # cut and full blocks both ran
    assert offline_rounds(diverse_target, drafter, pairs, GREEDY).tolist() == real
    # per slot too (greedy: exactly the real rounds'): slot k is reached by the rounds that submitted it and accepted
    # every slot before it (AR_k's denominator), accepted by those that also accepted it
    # (within the response: the last round's slots past its final token are not scored offline)
    reached, accepted = [0.0] * K, [0.0] * K
    for prompt, response in pairs:
        out = generate(diverse_target, prompt, MAX_NEW, drafter=drafter)
        anchor, last = len(prompt) - 1, len(prompt) + len(response) - 1
        for submitted, kept in zip(out.draft_lengths, out.accept_lengths):
            for h in range(min(K, last - anchor)):
                reached[h] += h < submitted and h <= kept
                accepted[h] += h < kept
            anchor += kept + 1
    report = offline_report(diverse_target, drafter, pairs, GREEDY)
    assert report.slot_reached.tolist() == reached and report.slot_accepted.tolist() == accepted


def test_calibration_is_saved_with_the_drafter_and_moves_the_cuts(cutting_drafter, diverse_target, tmp_path):
    drafter, prompts = cutting_drafter
    held_out = [random_batch(diverse_target, n=3, s=20, seed=s) for s in range(2)]
    try:
        result = drafter.calibrate(held_out, T1, grid=[0.25, 0.5, 1.0, 2.0, 4.0])
        assert drafter.confidence_temperature.tolist() == result.temperature.tolist()
        assert set(result.temperature.tolist()) <= {0.25, 0.5, 1.0, 2.0, 4.0}
        done = ~torch.isnan(result.ece_after)
        assert bool(done[0]) and bool((result.ece_after[done] <= result.ece_before[done] + 1e-12).all())
        assert "confidence_temperature" in drafter.state_dict()
        loaded = load_drafter(save_drafter(drafter, tmp_path / "d", "random"), target=diverse_target)
        assert torch.equal(loaded.confidence_temperature, drafter.confidence_temperature)
        # hotter or colder confidences change where the scheduler cuts
        drafter.confidence_temperature.fill_(0.25)
        sharp = run(drafter, diverse_target, held_out[0], every_anchor(held_out[0])).drafted
        drafter.confidence_temperature.fill_(4.0)
        soft = run(drafter, diverse_target, held_out[0], every_anchor(held_out[0])).drafted
        assert not torch.equal(sharp, soft)
    finally:
        drafter.confidence_temperature.fill_(1.0)


def test_sampling_is_lossless_with_cut_blocks(make_random_llama):
    target = make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)
    drafter = token_dependent_confidence(dspark(target, k=2, verify_cost=CUTTING[:3]))
    lengths = record_draft_lengths(drafter)
    counts, _ = empirical(target, T1, drafter, runs=1000)
    assert_matches(counts, exact_joint(target, PROMPT, T1), target.vocab_size, 3, "dspark cut")
    assert len(set(lengths)) >= 2, sorted(set(lengths))  # blocks were cut at different slots


# ------------------------------------------------------------------------------------------------ the loss
def test_confidence_bce_by_hand_without_gradient_through_the_target():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, K, 7, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 3, K, 7, dtype=torch.float64)
    z = torch.randn(2, 3, K, dtype=torch.float64, requires_grad=True)
    draft = DraftOutput(logits, torch.zeros(2, 3, K, dtype=torch.long), torch.ones(2, 3, K, dtype=torch.bool),
                        torch.zeros(2, 3, dtype=torch.long), aux={"confidence": z})
    ctx = StepContext(target_logits=target)
    loss = ConfidenceBCE()(draft, ctx)
    c_star = 1 - 0.5 * (logits.softmax(-1) - target.softmax(-1)).abs().sum(-1)  # Eq. 8
    c = torch.sigmoid(z)
    by_hand = -(c_star * c.log() + (1 - c_star) * (1 - c).log())  # Eq. 11
    torch.testing.assert_close(loss, by_hand.detach(), rtol=1e-6, atol=1e-7)  # p, q in float32 (SamplingConfig)
    loss.sum().backward()
    assert logits.grad is None  # sg(c*): the confidence loss never moves the draft distribution
    torch.testing.assert_close(z.grad, (c - c_star).detach())
    assert torch.autograd.gradcheck(lambda x: ConfidenceBCE()(
        DraftOutput(logits.detach(), draft.labels, draft.valid, draft.anchors, aux={"confidence": x}), ctx),
        (z.detach().clone().requires_grad_(),))
    with pytest.raises(ValueError, match="ConfidenceBCE"):
        ConfidenceBCE()(DraftOutput(logits, draft.labels, draft.valid, draft.anchors), ctx)


def test_the_overlay_objective_is_dspark_loss_and_chunks_exactly(diverse_target):
    spec = yaml.safe_load((ROOT / "experiments" / "drafters" / "dspark.yaml").read_text())
    assert spec["model"]["drafter"]["class_path"] == "lightning_spec.drafters.DSparkDrafter"
    objective = build(spec["model"]["objective"])
    drafter = dspark(diverse_target, draft_vocab=50)
    batch = random_batch(diverse_target, n=3)
    draft = run(drafter, diverse_target, batch)
    ctx = target_context(draft, drafter, diverse_target, batch)
    terms = objective(draft, ctx)
    # by hand: Σ w_k v (0.1 CE + 0.9 ‖p - q‖₁ + BCE) / Σ w_k v, w = exp(-k/4) with k = 0..K-1 (DeepSpec's decay)
    logq, p = draft.logits.log_softmax(-1), ctx.target_logits.softmax(-1)
    ce = -logq.gather(-1, draft.labels[..., None])[..., 0]
    l1 = (p - logq.exp()).abs().sum(-1)
    c_star = 1 - 0.5 * l1
    bce = torch.nn.functional.binary_cross_entropy_with_logits(draft.aux["confidence"], c_star.detach(),
                                                              reduction="none")
    w = torch.exp(-torch.arange(K) / 4.0) * draft.valid
    expected = (w * (0.1 * ce + 0.9 * l1 + bce)).sum() / w.sum()
    torch.testing.assert_close(terms.num / terms.den, expected, rtol=1e-5, atol=1e-6)
    # the lazy Markov logits indexed by anchor: chunks of 5 anchors give the same loss and gradients
    grads = []
    for chunk in (None, 5):
        drafter.zero_grad()
        out = run(drafter, diverse_target, batch)
        t = objective(out, target_context(out, drafter, diverse_target, batch), chunk=chunk)
        (t.num / t.den).backward()
        grads.append([p.grad.clone() for p in drafter.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert drafter.sequential.embed.weight.grad.abs().sum() > 0 and drafter.confidence.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------ calibration
def test_sequential_temperature_scaling_recovers_known_temperatures():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20000, 3, generator=g) * 2
    true_t = torch.tensor([2.0, 0.5, 1.0])
    acc = torch.sigmoid(z / true_t)  # the acceptance each slot really has
    ok = torch.ones_like(z, dtype=torch.bool)
    ok[:100, 2] = False  # blocks whose last slot is not supervised do not count for it
    result = sequential_temperature_scaling(z, acc, ok, torch.tensor([0.25, 0.5, 1.0, 2.0, 4.0]))
    assert result.temperature.tolist() == true_t.tolist()
    assert result.ece_after.tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)
    assert bool((result.ece_before[:2] > 0.01).all())
    assert result.blocks.tolist() == [20000, 20000, 19900]


def test_expected_calibration_error_by_hand():
    pred = torch.tensor([[0.05, 0.15, 0.95, 0.92]])
    truth = torch.tensor([0.0, 1.0, 1.0, 0.0])
    # bins of width 0.1: {0.05}, {0.15}, {0.95, 0.92}: |0.05| + |0.15 - 1| + |1.87 - 1| over 4
    assert float(expected_calibration_error(pred, truth, 10)[0]) == pytest.approx((0.05 + 0.85 + 0.87) / 4)


def test_calibration_targets_under_greedy_are_argmax_matches(cutting_drafter, diverse_target):
    drafter, _ = cutting_drafter
    batch = random_batch(diverse_target, n=2, s=16, seed=3)
    z, acc, ok = drafter._held_out_blocks([batch], GREEDY, chunk=64)
    assert set(acc.unique().tolist()) <= {0.0, 1.0}
    out = run(drafter, diverse_target, batch, every_anchor(batch))
    last = diverse_target(batch["input_ids"], logits=True).logits.argmax(-1)  # (N, S) the target's next token
    n = batch["input_ids"].shape[0]
    pos = (out.anchors[..., None] + torch.arange(K)).clamp(max=15).view(n, -1)
    match = drafter.vocab.to_target(out.logits.argmax(-1)) == last.gather(1, pos).view_as(out.valid)  # (N, A, K)
    starts = batch["loss_mask"][:, 1:]  # (N, S - 1): the anchors n whose next token is supervised, row by row
    assert torch.equal(acc, match[starts].float())
    torch.testing.assert_close(z, out.aux["confidence"][starts])
