"""Offline evaluation (EDR §3.4): exact expected rounds against a brute-force enumeration and against real
speculative decoding (sampled: within noise, and the wrong acceptance rule is caught; greedy: exactly), the
rollout forms and refusals, the OfflineEvaluation callback, and the ``evaluate`` command."""

import json
import math

import lightning as L
import pytest
import torch
from helpers.offline import enumerate_rounds, saved_drafters

from lightning_spec import SamplingConfig, generate, load_drafter, offline_rounds
from lightning_spec.data import prompt_ids
from lightning_spec.data.rollout_writer import Draw, generate_rollouts
from lightning_spec.data.rollouts import load_rollout_set, spread
from lightning_spec.decoding import rounds
from lightning_spec.decoding.proposals import ChainProposal
from lightning_spec.drafters import DFlashDrafter, DraftOutput
from lightning_spec.evaluation.offline import offline_report

GREEDY = SamplingConfig()
T1 = SamplingConfig(temperature=1.0)


# ------------------------------------------------------------------------ an independent brute-force reading


def engine_acceptances(target, drafter, prompt, response, sampling):
    """A[n][h] = min(1, q_{n}(x_t) / p_t(x_t)), t = n + 1 + h, for every anchor n of the rollout, with q from the
    DECODING path (``begin`` on the committed prefix + ``propose``, as the engine) and p from a full forward."""
    x = torch.tensor(prompt + response)
    k, s = drafter.block_size, len(prompt) + len(response)
    p = sampling.probs(target(x[None]).logits[0].double()).double()  # (S, V): row t - 1 gives p_t
    feats = target(x[None], layers=drafter.target_layers, logits=False).features  # (1, S, F)
    accept = {}
    for n in range(len(prompt) - 1, s - 1):
        state = drafter.begin(feats[:, :n])
        prop = drafter.propose(state, x[n : n + 1], sampling)
        q = prop.probs if prop.probs is not None else torch.nn.functional.one_hot(prop.tokens, target.vocab_size)
        row = []
        for h in range(k):
            t = n + 1 + h
            if t >= s:
                break
            p_x, q_x = float(p[t - 1, x[t]]), float(q[h, x[t]])
            row.append(min(1.0, q_x / p_x) if p_x > 0 else 0.0)
        accept[n] = row
    return accept


def small_target(make_random_llama, eos=3):
    """Vocabulary 8: an untrained drafter's q overlaps p a lot, so acceptances of every length happen."""
    return make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0, eos=eos)


@pytest.mark.parametrize(
    "sampling,block_size,draft_vocab",
    [(T1, 2, None), (T1, 3, 6), (SamplingConfig(temperature=0.7, top_k=4), 3, None), (GREEDY, 2, None)],
    ids=["T1-K2", "T1-K3-reduced-vocab", "T0.7-topk4-K3", "greedy-K2"],
)
def test_offline_rounds_equal_brute_force_enumeration(make_random_llama, make_block_drafter, sampling, block_size,
                                                      draft_vocab):
    target = small_target(make_random_llama, eos=None)
    torch.manual_seed(1)
    drafter = make_block_drafter(target, block_size=block_size, seed=2, draft_vocab_size=draft_vocab)
    if draft_vocab:  # a draft vocabulary without some tokens: their slots can never be accepted
        drafter.vocab.set_from_counts(torch.arange(target.vocab_size, 0, -1).float())
    pairs = [([1, 5, 3, 0], None), ([6], None), ([2, 2, 7], None)]
    pairs = [(p, generate(target, p, 7 + i, sampling, seed=i).tokens) for i, (p, _) in enumerate(pairs)]
    report = offline_report(target, drafter, pairs, sampling, batch_size=2)
    reached, accepted = [0.0] * block_size, [0.0] * block_size
    for (prompt, response), got in zip(pairs, report.rounds.tolist()):
        accept = engine_acceptances(target, drafter, prompt, response, sampling)
        want, re, ac = enumerate_rounds(accept, len(prompt) - 1, len(prompt) + len(response) - 1, block_size)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        reached = [a + b for a, b in zip(reached, re)]
        accepted = [a + b for a, b in zip(accepted, ac)]
    assert report.slot_reached.tolist() == pytest.approx(reached, rel=1e-5, abs=1e-6)
    assert report.slot_accepted.tolist() == pytest.approx(accepted, rel=1e-5, abs=1e-6)
    # not a degenerate case: the rounds are strictly between "all accepted" and "none accepted"
    tokens = report.tokens.double()
    assert bool((report.rounds < tokens).any()) and bool((report.rounds > tokens / (block_size + 1)).all())
    assert report.mal == pytest.approx(float(tokens.sum() / report.rounds.sum()))
    # the public function is the same numbers
    assert torch.equal(offline_rounds(target, drafter, pairs, sampling, batch_size=2), report.rounds)


# ------------------------------------------------------------------- against real sampled decoding


def swapped_rule(q_x, p_x):
    """The wrong acceptance: the engine's min(1, p/q) for a draft drawn from q, not the Bayes min(1, q/p)."""
    return torch.where(q_x > 0, (p_x / q_x.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(q_x))


RUNS = 600
PROMPT = [1, 5, 3, 0]
MAX_NEW = 10
Z = 4.5  # the bound: |difference| < 4.5 standard errors (a correct evaluator fails it ~1e-5 of the time)


@pytest.fixture(scope="module")
def sampled_case(make_random_llama, make_block_drafter):
    """Real T=1 speculative decoding (EOS-aware: token 3 ends generation) and independent target rollouts."""
    target = small_target(make_random_llama, eos=3)
    drafter = make_block_drafter(target, block_size=3, seed=2)
    spec = [generate(target, PROMPT, MAX_NEW, T1, drafter=drafter, seed=i) for i in range(RUNS)]
    plain = [generate(target, PROMPT, MAX_NEW, T1, seed=10**6 + i).tokens for i in range(RUNS)]
    return target, drafter, spec, plain


def mean_and_se(x: torch.Tensor) -> tuple[float, float]:
    return float(x.mean()), float(x.std() / math.sqrt(x.numel()))


def test_mean_offline_rounds_match_real_sampled_decoding(sampled_case, monkeypatch):
    target, drafter, spec, plain = sampled_case
    real = torch.tensor([g.rounds for g in spec], dtype=torch.float64)
    assert any(g.tokens[-1] == 3 for g in spec) and any(len(g.tokens) == MAX_NEW for g in spec)  # EOS and budget
    assert {a for g in spec for a in g.accept_lengths} == {0, 1, 2, 3}
    m_real, se_real = mean_and_se(real)

    def gap(rounds):  # (difference of the means, its standard error): two independent samples
        m_off, se_off = mean_and_se(rounds)
        return abs(m_off - m_real), math.sqrt(se_real**2 + se_off**2)

    rollouts = [(PROMPT, r) for r in plain]
    diff, se = gap(offline_rounds(target, drafter, rollouts, T1, batch_size=64))
    assert diff < Z * se, (diff, se)
    # conditionally exact: on the speculative outputs themselves, E[real rounds | x] = τ(x) (paired, tighter)
    tau = offline_rounds(target, drafter, [(PROMPT, g.tokens) for g in spec], T1, batch_size=64)
    m_d, se_d = mean_and_se(real - tau)
    assert abs(m_d) < Z * se_d, (m_d, se_d)

    # the same checks fail when the acceptance of the realised token is min(1, p/q) instead of min(1, q/p)
    monkeypatch.setattr(rounds, "bayes_acceptance", swapped_rule)
    diff_bad, se_bad = gap(offline_rounds(target, drafter, rollouts, T1, batch_size=64))
    assert diff_bad > Z * se_bad, (diff_bad, se_bad)
    tau_bad = offline_rounds(target, drafter, [(PROMPT, g.tokens) for g in spec], T1, batch_size=64)
    m_bad, se_bad = mean_and_se(real - tau_bad)
    assert abs(m_bad) > Z * se_bad, (m_bad, se_bad)


# ------------------------------------------------------------------------- greedy: exactly the engine


class ScriptedDrafter(DFlashDrafter):
    """Partly right, the same in decoding and in the training forward: the round anchored at n proposes the
    reference x_{n+1..n+K} (the rollout itself: prompt + greedy output) with slot j = 7n mod (K + 2) shifted
    by one token, so the engine accepts exactly j drafts (all K and the bonus when j ≥ K)."""

    reference: list[int] = []

    def script(self, ref: list[int], n: int) -> list[int]:
        k, v, bad = self.block_size, self.target.vocab_size, (7 * n) % (self.block_size + 2)
        out = []
        for j in range(k):
            tok = ref[n + 1 + j] if n + 1 + j < len(ref) else 0
            out.append((tok + 1) % v if j == bad else tok)
        return out

    def propose(self, state, anchor, sampling, generator=None) -> ChainProposal:
        return ChainProposal(tokens=torch.tensor(self.script(self.reference, state.length)))

    def forward(self, batch, features, chosen=None) -> DraftOutput:
        ids = batch["input_ids"]
        anchors, keep = chosen.positions, chosen.keep
        lengths = (batch["loss_mask"].cumsum(1) * batch["loss_mask"]).argmax(1) + 1  # end of each rollout
        n, a = anchors.shape
        tokens = torch.tensor(
            [[self.script(ids[i, : lengths[i]].tolist(), int(anchors[i, j])) for j in range(a)] for i in range(n)]
        )  # (N, A, K)
        logits = torch.nn.functional.one_hot(tokens, self.target.vocab_size).float() * 10.0
        return DraftOutput(logits=logits, labels=tokens, valid=keep[..., None].expand_as(tokens), anchors=anchors)


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_greedy_offline_rounds_equal_real_rounds_scripted(diverse_target, tiny_target, block_size):
    torch.manual_seed(0)
    seen = set()
    for target, prompts in [
        (diverse_target, [[3, 17, 40, 8, 2], [5], [60, 61, 62]]),
        (tiny_target, [prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": "Hi there"}])]),
    ]:
        drafter = ScriptedDrafter(block_size=block_size)
        drafter.bind(target)
        rollouts, real = [], []
        for prompt in prompts:
            plain = generate(target, prompt, 20, GREEDY)
            drafter.reference = prompt + plain.tokens
            spec = generate(target, prompt, 20, GREEDY, drafter=drafter)
            assert spec.tokens == plain.tokens
            rollouts.append((prompt, plain.tokens))
            real.append(spec.rounds)
            seen.update(spec.accept_lengths)
        got = offline_rounds(target, drafter, rollouts, GREEDY, batch_size=2)
        assert got.tolist() == pytest.approx(real, abs=1e-9)
    assert 0 in seen and block_size in seen  # rejections and full acceptances both ran


def test_greedy_offline_rounds_equal_real_rounds_untrained_block_drafter(make_random_llama, make_block_drafter):
    target = small_target(make_random_llama, eos=3)
    rollouts, real, accepted = [], [], 0
    for seed, k in [(0, 2), (1, 3), (2, 4)]:
        drafter = make_block_drafter(target, block_size=k, seed=seed)
        rollouts, real = [], []
        for i, prompt in enumerate([[1, 5, 3, 0], [6], [2, 2, 7, 1, 4, 4], [0, 1]]):
            prompt = prompt + [seed + i]
            spec = generate(target, prompt, 16, GREEDY, drafter=drafter)
            assert spec.tokens == generate(target, prompt, 16, GREEDY).tokens
            rollouts.append((prompt, spec.tokens))
            real.append(spec.rounds)
            accepted += sum(spec.accept_lengths)
        got = offline_rounds(target, drafter, rollouts, GREEDY, batch_size=3)
        assert got.tolist() == pytest.approx(real, abs=1e-9)
    assert accepted > 0  # the untrained drafter got some drafts accepted: not the trivial rounds = tokens


# ------------------------------------------------------------------------------ rollout forms, refusals


@pytest.fixture(scope="module")
def rollout_folder(tiny_target, tmp_path_factory):
    prompts = [
        {"id": f"p{i}", "domain": ["chat", "code"][i % 2], "subdomain": "",
         "prompt_ids": prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": text}])}
        for i, text in enumerate(["hello", "def f(x):", "2+2?", "print('a')"])
    ]
    folder = tmp_path_factory.mktemp("rollouts") / "t1"
    generate_rollouts(tiny_target, prompts, Draw(T1, 2, 12, seed=0), folder, batch_size=4, progress=False)
    return folder


def test_rollout_forms_agree_and_mismatches_are_refused(tiny_target, make_block_drafter, make_random_llama,
                                                         rollout_folder):
    import datasets

    drafter = make_block_drafter(tiny_target, block_size=3)
    folder = offline_report(tiny_target, drafter, load_rollout_set(rollout_folder))  # sampling: the folder's
    ds = datasets.load_from_disk(str(rollout_folder))
    from_ds = offline_rounds(tiny_target, drafter, ds, T1)
    pairs = [(r["prompt_ids"], r["response_ids"]) for r in ds]
    assert torch.allclose(folder.rounds, from_ds) and torch.allclose(folder.rounds, offline_rounds(
        tiny_target, drafter, pairs, T1, batch_size=1))
    assert folder.domains == ds["domain"] and set(folder.mal_by_domain) == {"chat", "code"}
    assert folder.prompt_keys == ds["prompt_id"]
    assert int(folder.tokens.sum()) == sum(len(r) for r in ds["response_ids"])
    with pytest.raises(ValueError, match="sampling"):
        offline_rounds(tiny_target, drafter, load_rollout_set(rollout_folder), GREEDY)
    other = make_random_llama(vocab_size=tiny_target.vocab_size, hidden_size=32, seed=5)
    with pytest.raises(ValueError, match="fingerprint"):
        offline_rounds(other, make_block_drafter(other, block_size=3), load_rollout_set(rollout_folder))
    with pytest.raises(ValueError, match="different target"):
        offline_rounds(other, drafter, pairs, T1)
    with pytest.raises(ValueError, match="needs sampling"):
        offline_rounds(tiny_target, drafter, pairs)


def test_spread_takes_domains_round_robin_and_first_samples_first():
    data = load_rollout_set([
        {"prompt_ids": [1], "response_ids": [2], "domain": d, "prompt_id": p}
        for d, p in [("a", "x"), ("a", "x"), ("a", "y"), ("b", "z"), ("b", "z"), ("a", "w")]
    ])
    picked = spread(data, 3)
    assert sorted(zip(picked.domains, picked.prompt_keys)) == [("a", "x"), ("a", "y"), ("b", "z")]
    assert len(spread(data, None)) == 6


def test_empty_responses_take_no_rounds(diverse_target, make_block_drafter):
    drafter = make_block_drafter(diverse_target, block_size=2)
    got = offline_rounds(diverse_target, drafter, [([1, 2], []), ([3], [4, 5])], GREEDY)
    assert got[0] == 0 and got[1] > 0


# ---------------------------------------------------------------------------------- callback and CLI


@pytest.mark.parametrize(("max_steps", "every", "scored"), [(2, 1, [1, 2]), (3, 2, [2, 3])])
def test_offline_evaluation_callback_logs_during_fit(tmp_path, rollout_folder, max_steps, every, scored):
    """Every validation (not the sanity check) is scored, and the end of training when its last steps were not."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_spec.callbacks import OfflineEvaluation
    from lightning_spec.datamodule import SpecDataModule
    from lightning_spec.module import DraftModule
    from lightning_spec.objectives import KL, Objective

    rows = [{"messages": [{"role": "user", "content": f"q{i}?"}, {"role": "assistant", "content": f"a{i}."}]}
            for i in range(8)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "domain": "chat"}) + "\n")
    dm = SpecDataModule(target="tiny-random", train_sources=[str(train)], eval_sources=[str(evals)],
                        train_limit=None, max_length=48, batch_size=4, val_fraction=0.25)
    torch.manual_seed(0)
    module = DraftModule(DFlashDrafter(block_size=3, num_anchors=4), Objective(KL()), target="tiny-random")
    callback = OfflineEvaluation(str(rollout_folder), max_rollouts=3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, val_check_interval=every,
                        limit_val_batches=1, logger=CSVLogger(tmp_path), enable_checkpointing=False,
                        enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=1, callbacks=[callback])
    trainer.fit(module, datamodule=dm)
    assert [step for step, _ in callback.history] == scored
    metrics = callback.history[-1][1]
    assert {"val/offline_mal", "val/offline_mal/chat", "val/offline_mal/code", "val/offline_accept_rate/t1"} <= set(
        metrics)
    assert 1.0 <= metrics["val/offline_mal"] <= 4.0
    assert float(trainer.callback_metrics["val/offline_mal"]) == pytest.approx(metrics["val/offline_mal"])
    # the same number as offline_report on the same 3 rollouts
    want = offline_report(module.target, module.drafter, load_rollout_set(rollout_folder), max_rollouts=3).mal
    assert metrics["val/offline_mal"] == pytest.approx(want, rel=1e-9)
    logged = (tmp_path / "lightning_logs").rglob("metrics.csv")
    assert any("val/offline_mal" in p.read_text() for p in logged)


def test_offline_evaluation_refuses_another_targets_rollouts(rollout_folder, make_random_llama):
    from types import SimpleNamespace

    from lightning_spec.callbacks import OfflineEvaluation

    other = make_random_llama(vocab_size=320, hidden_size=32, seed=3)
    callback = OfflineEvaluation(str(rollout_folder))
    with pytest.raises(ValueError, match="fingerprint"):
        callback.setup(None, SimpleNamespace(target=other), "fit")


def test_evaluate_offline_cli_writes_json_and_mlflow(in_tmp, tiny_target, rollout_folder, capsys):
    import mlflow

    from lightning_spec.cli import main

    a, b, c = saved_drafters(tiny_target, in_tmp, seeds=(0, 1, 2))
    main(["evaluate", "--mode", "offline", "--rollouts", str(rollout_folder), "--drafters", f"[{a}, {b}, {c}]",
          "--names", "[base, other, other]", "--n_resamples", "200", "--output", "out.json", "--mlflow", "true",
          "--progress", "false"])
    out = capsys.readouterr().out
    assert "ΔMAL" in out and "base" in out and "other" in out and "chat" in out
    result = json.loads((in_tmp / "out.json").read_text())
    assert result["mode"] == "offline" and result["sampling"]["temperature"] == 1.0
    recorded = result["provenance"]  # its own command and the checksums of what it read
    assert recorded["command"].startswith("lightning-spec evaluate --mode offline --rollouts ")
    assert set(recorded["inputs"]) == {a, b, c, str(rollout_folder)} and all(recorded["inputs"][p] for p in (a, b, c))
    assert set(result["arms"]) == {"base", "other"} and result["arms"]["other"]["checkpoints"] == [b, c]
    cmp = result["comparison"]
    assert cmp["baseline"] == "base" and cmp["rows"] == 8 and cmp["prompts"] == 4
    other = cmp["arms"]["other"]
    assert other["mal_ci"][0] <= other["mal"] <= other["mal_ci"][1] and len(other["checkpoint_mal"]) == 2
    assert other["delta_mal"] == pytest.approx(other["mal"] - cmp["arms"]["base"]["mal"])
    # the arm's rounds are the mean over its two checkpoints, per rollout
    rollouts = load_rollout_set(rollout_folder)
    ra = offline_rounds(tiny_target, load_drafter(b, target=tiny_target), rollouts)
    rc = offline_rounds(tiny_target, load_drafter(c, target=tiny_target), rollouts)
    assert result["arms"]["other"]["rounds"] == pytest.approx(((ra + rc) / 2).tolist(), rel=1e-6)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{in_tmp / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(f"lightning_spec: {result['target']}, evaluate")  # one per target
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.tags["lightning_spec.arm"] for r in runs) == ["base", "other"]
    assert all(r.data.params["decoding"] == "chain" for r in runs)  # a tree arm says "tree N/K"
    assert all("offline/mal" in r.data.metrics for r in runs)
    assert any("offline/delta_mal" in r.data.metrics for r in runs)


def test_evaluate_online_cli_writes_json(in_tmp, tiny_target, capsys):
    from lightning_spec.cli import main

    (a,) = saved_drafters(tiny_target, in_tmp, seeds=(0,))
    main(["evaluate", "--mode", "online", "--drafters", f"[{a}]", "--sources", "[mt-bench, humaneval]",
          "--prompts_per_source", "2", "--max_new_tokens", "6", "--temperature", "1.0", "--n_resamples", "100",
          "--output", "online.json", "--progress", "false"])
    result = json.loads((in_tmp / "online.json").read_text())
    assert result["mode"] == "online" and result["prompts"] == 4 and result["target"] == "tiny-random"
    arm = result["arms"]["drafter0"]
    assert arm["tokens"] > 0 and arm["speedup"] > 0 and arm["tokens_per_s"] > 0
    assert set(arm["mal_by_domain"]) == {"chat", "code"} and 1.0 <= arm["mal"] <= 4.0
    assert result["plain"]["tokens_per_s"] > 0
    assert "speedup" in capsys.readouterr().out


def test_evaluate_scores_ngram_lookup_beside_the_checkpoints(in_tmp, tiny_target, rollout_folder, capsys):
    """``ngram`` and ``ngram:K`` in --drafters are n-gram lookup arms: offline, exactly the rounds offline_rounds gives
    NgramDrafter on the same rollouts (sampled ones: its drafts are chosen); online, decoded beside the checkpoint
    with no weights; alone, it needs --target."""
    from lightning_spec.cli import main
    from lightning_spec.decoding.ngram import NgramDrafter

    (a,) = saved_drafters(tiny_target, in_tmp, seeds=(0,))
    main(["evaluate", "--rollouts", str(rollout_folder), "--drafters", f"[{a}, ngram, ngram:2]", "--n_resamples",
          "50", "--output", "offline.json", "--progress", "false"])
    result = json.loads((in_tmp / "offline.json").read_text())
    assert list(result["arms"]) == ["drafter0", "ngram", "ngram:2"]
    rollouts = load_rollout_set(rollout_folder)
    for name, k in (("ngram", 10), ("ngram:2", 2)):
        expected = offline_rounds(tiny_target, NgramDrafter(block_size=k), rollouts)
        assert result["arms"][name]["rounds"] == pytest.approx(expected.tolist()), name
        assert len(result["arms"][name]["accept_rate"]) == k
    assert "ngram:2" in capsys.readouterr().out

    main(["evaluate", "--mode", "online", "--drafters", f"[{a}, ngram:3]", "--sources", "[mt-bench]",
          "--prompts_per_source", "2", "--max_new_tokens", "6", "--n_resamples", "50", "--output", "online.json",
          "--progress", "false"])
    arm = json.loads((in_tmp / "online.json").read_text())["arms"]["ngram:3"]
    assert arm["parameters"] == 0 and arm["tokens"] > 0 and 1.0 <= arm["mal"] <= 4.0 and len(arm["accept_rate"]) == 3
    for argv, words in [
        (["--mode", "online", "--drafters", "[ngram]"], "--target is needed"),
        (["--mode", "online", "--drafters", f"[{a}, ngram]", "--decoding", "adapt"], "no weights to adapt"),
        (["--mode", "online", "--drafters", f"[{a}, ngram]", "--decodings", "[null, auto]"], "decoding auto weighs"),
        (["--drafters", "[ngram:0]", "--rollouts", str(rollout_folder)], "ngram:K with K >= 1"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["evaluate", *argv, "--progress", "false"])
        assert exit_.value.code == 2 and words in capsys.readouterr().err, argv


def test_evaluate_errors_are_one_sentence(in_tmp, tiny_target, capsys):
    from lightning_spec.cli import main

    (a,) = saved_drafters(tiny_target, in_tmp, seeds=(0,))
    for argv, words in [
        (["evaluate", "--drafters", f"[{a}]"], "--rollouts"),
        (["evaluate", "--drafters", f"[{a}]", "--names", "[x, y]", "--rollouts", "r"], "--names"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert words in capsys.readouterr().err


def test_a_drafter_without_a_training_forward_is_named(diverse_target, make_fixed_drafter):
    """The offline evaluator uses the drafter contract's forward only (no signature probing): a drafter that
    decodes but lacks it fails naming the method."""
    drafter = make_fixed_drafter(diverse_target, block_size=2)  # decodes, but has no training forward
    with pytest.raises(NotImplementedError, match="FixedDrafter must implement forward"):
        offline_rounds(diverse_target, drafter, [([1, 2], [3, 4])], T1)
