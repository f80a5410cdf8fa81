"""On-policy training: traced decoding, replay examples whose anchors are the round starts of a known decoding, the
rollout callback's buffer (refresh, staleness, resume, DDP), and Draft-OPD's two streams by hand."""

import math

import lightning as L
import pytest
import torch
from helpers.fits import quiet_trainer

from lightning_spec import generate
from lightning_spec.callbacks import OnPolicyRollouts
from lightning_spec.data.replay import ReplayBuffer, prompt_of, replay_example
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.decoding.engine import Generation
from lightning_spec.drafters import DFlashDrafter
from lightning_spec.drafters.base import DraftOutput, DraftVocab
from lightning_spec.errors import UserError
from lightning_spec.loaders import collate
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, DraftOPD, Objective, StepContext
from lightning_spec.objectives.draft_opd import k3, replay_rounds
from lightning_spec.objectives.objective import TargetInfo
from lightning_spec.sampling import SamplingConfig


def known_starts(prompt_len: int, new_tokens: int, k: int) -> list[int]:
    """Round starts of ReferenceDrafter decoding, from its rule alone: at anchor n it accepts 7n mod (K + 2) drafts
    (all K when that is >= K), then the target commits one more."""
    starts, n = [], prompt_len - 1
    while n < prompt_len - 1 + new_tokens:
        starts.append(n)
        n += min((7 * n) % (k + 2), k) + 1
    return starts


def test_replay_anchors_are_the_round_starts_of_a_known_decoding(tiny_target, make_reference_drafter):
    prompt, k, budget = [5, 17, 33, 9, 12], 4, 30
    reference = prompt + generate(tiny_target, prompt, budget + k + 2).tokens
    drafter = make_reference_drafter(tiny_target, k, reference)
    gen = generate(tiny_target, prompt, budget, drafter=drafter, trace=True)
    assert gen.tokens == reference[len(prompt): len(prompt) + budget]  # lossless
    example = replay_example(prompt, gen, k, domain="chat", domain_id=0, id="x", index=0, drawn_step=0)
    assert example["round_starts"].tolist() == known_starts(len(prompt), budget, k)
    assert example["input_ids"].tolist() == prompt + gen.tokens and prompt_of(example) == prompt

    # the rejected drafts: those past the accepted ones, each with the target's log-probability at verification
    ids = example["input_ids"][None]
    logp = tiny_target(ids).logits[0].float().log_softmax(-1)  # (S, V)
    whole = [r for r in range(gen.rounds) if r < gen.rounds - 1]  # the last round may be cut by the budget
    for r in whole:
        n, a = int(example["round_starts"][r]), gen.accept_lengths[r]
        row = example["rejected"][r]
        assert row[:a].eq(-1).all() and row[a:].tolist() == gen.drafts[r][a:]
        if a < k:  # the first rejected draft's prefix is the trajectory: its logp is the target's there
            first = int(row[a])
            assert first != int(ids[0, n + a + 1])
            assert math.isclose(float(example["rejected_logp"][r, a]), float(logp[n + a, first]), abs_tol=1e-4)

    # the objective reads them back as anchors and streams
    batch = collate([example], pad_id=0)
    vocab = DraftVocab()
    vocab.build(tiny_target.vocab_size)
    info = TargetInfo(last_hidden=torch.zeros(1), logits=None, vocab=vocab, block_size=k)
    anchors, rounds = replay_rounds(batch, info)
    assert anchors.positions[0].tolist() == known_starts(len(prompt), budget, k) and anchors.keep.all()
    for r in whole:
        a = gen.accept_lengths[r]
        assert int(rounds.segment[0, r]) == min(a + 1, k)  # the accepted drafts and the correction (not a bonus)
        has = rounds.rejected[0, r] >= 0
        assert has.tolist() == [t >= a for t in range(k)]
        assert rounds.offset[0, r][has].tolist() == list(range(1, k - a + 1))


def test_first_rejections_only_for_drafters_that_read_their_drafts():
    gen = Generation(tokens=[7, 8, 9, 10, 11, 12], accept_lengths=[1, 0, 3], rounds=3, seconds=0.0,
                     drafts=[[7, 1, 2], [3, 4, 5], [10, 11, 12]], draft_logp=[[-.1, -2., -3.], [-4., -5., -6.],
                                                                               [-.1, -.2, -.3]])
    full = replay_example([1, 2], gen, 3, index=0)
    first = replay_example([1, 2], gen, 3, all_rejected=False, index=0)
    assert full["round_starts"].tolist() == [1, 3, 4]
    assert full["rejected"].tolist() == [[-1, 1, 2], [3, 4, 5], [-1, -1, -1]]
    assert first["rejected"].tolist() == [[-1, 1, -1], [3, -1, -1], [-1, -1, -1]]
    assert full["rejected_logp"][0].tolist() == [0.0, -2.0, -3.0]
    with pytest.raises(ValueError, match="decode with a chain plan to trace"):
        generate(None, [1], 3, plan={"kind": "ngram", "nodes": 4}, trace=True)


# ---------------------------------------------------------------------------------------------- Draft-OPD
def test_draft_opd_streams_by_hand():
    torch.manual_seed(0)
    n, a, k, v = 1, 2, 3, 5
    logits = torch.randn(n, a, k, v, dtype=torch.float64, requires_grad=True)
    target = torch.randn(n, a, k, v, dtype=torch.float64)
    labels = torch.randint(0, v, (n, a, k))
    valid = torch.ones(n, a, k, dtype=torch.bool)
    from lightning_spec.objectives.draft_opd import ReplayRounds

    rounds = ReplayRounds(
        segment=torch.tensor([[2, 3]]),  # round 0: 1 accepted + correction; round 1: the last, whole block
        rejected=torch.tensor([[[-1, 4, 0], [-1, -1, -1]]]),  # round 0 rejected 4 at slot 2 and 0 at slot 3
        rejected_logp=torch.tensor([[[0.0, -1.5, -30.0], [0.0, 0.0, 0.0]]]),
        offset=torch.tensor([[[0, 1, 2], [-1, 0, 1]]]),
    )
    draft = DraftOutput(logits, labels, valid, torch.zeros(n, a, dtype=torch.long))
    ctx = StepContext(target_logits=target, extra={"rounds": rounds})
    terms = DraftOPD()(draft, ctx)
    logq, logp = logits.log_softmax(-1), target.log_softmax(-1)

    def bern(t_a, t_k):
        lp, lq = logp[0, t_a, t_k, labels[0, t_a, t_k]], logq[0, t_a, t_k, labels[0, t_a, t_k]]
        p, q = lp.exp(), lq.exp()
        return p * (lp - lq) + (1 - p) * torch.log((1 - p) / (1 - q))

    response = bern(0, 0) + bern(0, 1) + sum(bern(1, t) for t in range(3))  # 5 slots
    floor = torch.tensor(-10.0, dtype=torch.float64)
    rejected = k3(torch.tensor(-1.5, dtype=torch.float64), logq[0, 0, 1, 4].clamp_min(-10)) \
        + 0.8 * k3(floor, logq[0, 0, 2, 0].clamp_min(-10))
    want = (response + rejected) / 7
    assert torch.allclose(terms.value, want.detach())
    assert int(terms.den) == 7
    assert torch.allclose(terms.metrics["opd_rejected"], rejected.detach() / 2)
    terms.num.backward()
    assert logits.grad[0, 0, 2].abs().sum() > 0  # the rejected stream reaches slots past the correction

    # the k3 response variant and the rejected stream switched off
    k3_terms = DraftOPD(response_loss="k3", rejected_weight=0.0)(draft, ctx)
    lp = logp.gather(-1, labels[..., None])[..., 0]
    lq = logq.gather(-1, labels[..., None])[..., 0]
    mask = torch.tensor([[[1, 1, 0], [1, 1, 1]]], dtype=torch.bool)
    assert torch.allclose(k3_terms.value, k3(lp, lq)[mask].sum().detach() / 5)
    with pytest.raises(ValueError, match="response_loss"):
        DraftOPD(response_loss="kl")


def test_k3_is_an_unbiased_reverse_kl():
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    p = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    expected = (q * k3(p.log(), q.log())).sum()  # E_{y~q}[k3(y)]
    assert torch.allclose(expected, (q * (q / p).log()).sum())


# ------------------------------------------------------------------------------------- the rollout callback
def on_policy_fit(files, tmp_path, steps=4, objective=None, callbacks=(), ckpt_path=None, drafter_args=None,
                  **rollouts):
    dm = SpecDataModule(target="tiny-random", train_sources=[files["train"]], eval_sources=[files["eval"]],
                        train_limit=None, max_length=64, batch_size=2, val_fraction=0.2)
    torch.manual_seed(0)
    drafter = DFlashDrafter(block_size=3, num_layers=1, num_anchors=8, **(drafter_args or {}))
    module = DraftModule(drafter, objective or DraftOPD(), target="tiny-random", lr=1e-2)
    cb = OnPolicyRollouts(**{**dict(buffer_size=4, refresh_every=2, rollouts_per_refresh=2, max_new_tokens=12),
                             **rollouts})
    seen = []

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append({k: v.clone() for k, v in batch.items()})

    trainer = quiet_trainer(max_steps=steps, callbacks=[cb, Spy(), *callbacks], default_root_dir=tmp_path,
                            enable_checkpointing=bool(callbacks))
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module, cb, dm, seen, trainer


def test_draft_opd_trains_on_the_live_drafters_rounds(data_files, tmp_path):
    module, cb, dm, seen, trainer = on_policy_fit(data_files, tmp_path, steps=6)
    assert trainer.global_step == 6
    assert len(dm.training_set) == 4 and dm.training_set is cb.buffer and dm.training_set[0] is cb.buffer[0]
    assert len(dm.train_dataset) > 4  # the data stays the data: prompts and the draft vocabulary come from it
    assert module.feature_source.store is None  # declared on-policy (the callback list): no store for a changing set
    # an initial fill at step 0, then 2 rollouts at steps 2 and 4 (none at 6: training is over)
    assert [s for s, _ in cb.history] == [0, 2, 4] and cb.drawn == 8
    assert sorted(e["index"] for e in cb.buffer) == [4, 5, 6, 7]  # the oldest four replaced
    assert {e["drawn_step"] for e in cb.buffer} == {2, 4}
    assert all("round_starts" in b for b in seen)
    assert max(int(b["drawn_step"].max()) for b in seen) == 4  # batches after a refresh train on fresh rollouts
    assert "train/staleness" in trainer.callback_metrics and "rollout/mal" in trainer.callback_metrics
    assert module.feature_source.store is None  # a changing buffer is never feature-cached
    for e in cb.buffer:  # every example is a lossless decoding of its prompt by the target
        prompt = prompt_of(e)
        plain = generate(module.target, prompt, 12).tokens
        assert e["input_ids"][len(prompt):].tolist() == plain
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))


def test_draft_opd_refuses_a_fit_without_rollouts(data_files, tmp_path):
    dm = SpecDataModule(target="tiny-random", train_sources=[data_files["train"]], eval_sources=[data_files["eval"]],
                        train_limit=None, max_length=64, batch_size=2, val_fraction=0.2)
    module = DraftModule(DFlashDrafter(block_size=3, num_layers=1), DraftOPD(), target="tiny-random")
    with pytest.raises(ValueError, match="add lightning_spec.callbacks.OnPolicyRollouts"):
        quiet_trainer(max_steps=1).fit(module, datamodule=dm)


def test_whole_buffer_refresh_and_random_anchor_ablation(data_files, tmp_path):
    module, cb, dm, seen, trainer = on_policy_fit(
        data_files, tmp_path, steps=4, objective=DraftOPD(anchors="random"), rollouts_per_refresh=None,
        refresh_every=2)
    assert [s for s, _ in cb.history] == [0, 2] and sorted(e["index"] for e in cb.buffer) == [4, 5, 6, 7]
    assert trainer.global_step == 4


def test_adaflash_regime_runs_on_policy_with_its_length_head(data_files, tmp_path):
    """experiments/regimes/adaflash.yaml on the tiny target: whole-buffer refreshes, AdaFlash's loss and the length
    head's MSE as one mixture; the head trains, and the drafter decodes the next buffer with it."""
    from lightning_spec.objectives import AdaFlashLoss, ExpDecay, LengthMSE, Mixture, Uniform

    parts = [Objective(AdaFlashLoss(), ExpDecay(2.0)), Objective(LengthMSE(), Uniform(), normalize="anchors")]
    objective = Mixture(parts, [1.0, 1.0])
    torch.manual_seed(0)
    module, cb, _, seen, trainer = on_policy_fit(data_files, tmp_path, steps=4, objective=objective,
                                                 rollouts_per_refresh=None, drafter_args={"length_head": True})
    assert trainer.global_step == 4 and [s for s, _ in cb.history] == [0, 2]
    assert {"train/mixture/0", "train/mixture/1"} <= set(trainer.callback_metrics)
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))
    assert module.drafter.length_head and any(p.grad is not None for p in module.drafter.length.parameters())


def test_a_resumed_run_keeps_its_buffer(data_files, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def ckpt():
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)

    _, cb, _, _, _ = on_policy_fit(data_files, tmp_path, steps=3, callbacks=[ckpt()], objective=Objective(KL()))
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    (saved,) = [v for k, v in state["callbacks"].items() if k.startswith("OnPolicyRollouts")]
    assert [e["index"] for e in saved["buffer"]] == [e["index"] for e in cb.buffer] and saved["drawn"] == cb.drawn
    # resumed: no new initial fill; the buffer it trains on first is the saved one, the next refresh at step 4
    _, again, _, seen, trainer = on_policy_fit(data_files, tmp_path, steps=5, callbacks=[ckpt()],
                                               objective=Objective(KL()), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert trainer.global_step == 5
    assert [s for s, _ in again.history] == [0, 2, 4] and again.drawn == cb.drawn + 2
    first = set(seen[0]["index"].tolist())
    assert first <= {e["index"] for e in cb.buffer}


def test_without_the_callback_an_objective_on_rollouts_is_refused(data_files):
    """``OnPolicyRollouts.setup`` declares a fit on-policy (``DraftModule.train_on_policy``; Lightning runs every
    callback's ``setup`` before the module's, and the fits above train so); without it, an objective that trains on
    rollouts is refused in one sentence before anything trains."""
    dm = SpecDataModule(target="tiny-random", train_sources=[data_files["train"]], eval_sources=[data_files["eval"]],
                        train_limit=None, max_length=64, batch_size=2, val_fraction=0.2)
    module = DraftModule(DFlashDrafter(block_size=3, num_layers=1, num_anchors=8), DraftOPD(), target="tiny-random")
    with pytest.raises(UserError, match="add lightning_spec.callbacks.OnPolicyRollouts to trainer.callbacks"):
        quiet_trainer(max_steps=1).fit(module, datamodule=dm)


def test_the_replay_buffer_is_a_ring_of_fixed_size():
    buffer = ReplayBuffer(3)
    with pytest.raises(RuntimeError, match="2 examples for a buffer of 3"):
        buffer.fill([{"domain": "a"}] * 2)
    buffer.fill([{"domain": d, "index": i} for i, d in enumerate("abc")])
    assert buffer.full and len(buffer) == 3 and buffer.domains == ["a", "b", "c"]
    buffer.put([{"domain": "d", "index": 3}, {"domain": "e", "index": 4}])  # the two oldest replaced, in order
    assert [e["index"] for e in buffer] == [3, 4, 2] and buffer.cursor == 2
    buffer.put([{"domain": "f", "index": 5}, {"domain": "g", "index": 6}])  # wraps around
    assert [e["index"] for e in buffer] == [6, 4, 5]
    again = ReplayBuffer(3)
    again.load_state_dict(buffer.state_dict())  # the "buffer"/"cursor" keys checkpoints hold
    assert list(again) == list(buffer) and again.cursor == buffer.cursor


def test_rollout_settings_are_checked():
    with pytest.raises(ValueError, match="rollouts_per_refresh is 9"):
        OnPolicyRollouts(buffer_size=4, rollouts_per_refresh=9)
    with pytest.raises(ValueError, match="refresh_every is 0"):
        OnPolicyRollouts(refresh_every=0)
    assert OnPolicyRollouts(sampling={"temperature": 1.0}).sampling == SamplingConfig(temperature=1.0)
