"""Tree decoding with real drafters: the best-first top-k builder (``decoding/trees.py``) and ``generate(plan=...)``.

- the builder returns exactly the ``nodes`` most valuable nodes of the full top-k tree (value = product of q along
  the root path), parents before children, siblings best first;
- EAGLE-2's dynamic builder expands, depth by depth, the k most valuable nodes offered there and keeps the ``nodes``
  most valuable of all offered (against a set-based restatement, on a drafter whose q depends on the whole path);
- for every family with per-slot distributions (DFlash's block, Medusa's heads) and every autoregressive one
  (EAGLE-3, MTP),
  greedy tree decoding equals the independent argmax loop with a trained drafter, and sampled tree decoding is
  distributed as the target (χ² against the enumerated joint);
- after a tree round the drafter's state is that of a fresh prefill of the committed tokens;
- best-first trees are scored offline exactly (the rounds of every real run, sampled ones included); trees grown
  from the drafter's own drafts (dynamic, D²SD, SpecBlock) are replayed offline under greedy decoding, exactly the
  engine's rounds, and refused under sampling; the families with no builder are refused everywhere, and bad tree
  settings, each in one sentence.
"""

import itertools
import math
from pathlib import Path

import pytest
import torch
from helpers.decoding import MAX_NEW, argmax_reference, random_prompts
from helpers.families import FAMILIES, build, trained
from helpers.sampling import NEW, PROMPT, assert_matches, exact_joint
from helpers.trees import assert_greedy_tree_is_the_argmax_loop, committed_paths, off_the_first_branch, tree_empirical

from lightning_spec import SamplingConfig, TreeConfig, generate, load_drafter, offline_rounds
from lightning_spec.data.rollouts import load_rollout_set
from lightning_spec.decoding.exact import replay_tree_rounds
from lightning_spec.decoding.plans import Tree
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.decoding.trees import best_first_tree, dynamic_tree
from lightning_spec.drafters import Anchors
from lightning_spec.evaluation.offline import offline_report

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
VARIANTS = ["dflash_served", "dspark_served", "mtp_served"]  # a family below with other options: tested there


# Which tree each family grows, read from its one declaration (``Proposer.tree_growth``), not from a list kept here.
GROWTH = {name: FAMILIES[name](2).tree_growth for name in FAMILIES if name not in VARIANTS}
BEST_FIRST = [f for f, g in GROWTH.items() if g is TreeGrowth.BEST_FIRST]  # per-slot distributions: scored exactly
DYNAMIC = [f for f, g in GROWTH.items() if g is TreeGrowth.DYNAMIC]  # EAGLE-2's dynamic trees, replayed (greedy)
OWN_TREES = [f for f, g in GROWTH.items() if g is TreeGrowth.OWN]  # the family's own builder (its test file), replayed
CHAIN_ONLY = sorted(f for f, g in GROWTH.items() if g is TreeGrowth.NONE)


def test_the_declarations_give_the_known_tree_builders():
    """The declarations agree with what each family's paper builds."""
    assert (BEST_FIRST, DYNAMIC, OWN_TREES) == (["dflash", "medusa", "peagle"], ["eagle3", "eagle3_1", "mtp"],
                                              ["d2sd", "specblock"])


@pytest.mark.parametrize("depth,top_k,nodes", [(3, 3, 7), (4, 2, 30), (2, 4, 5), (5, 1, 3)])
def test_best_first_tree_is_the_most_valuable_nodes_of_the_full_tree(depth, top_k, nodes):
    g = torch.Generator().manual_seed(depth * 10 + top_k)
    q = torch.rand(depth, 12, generator=g, dtype=torch.float64).softmax(-1)
    tokens, parents = best_first_tree(q, TreeConfig(nodes=nodes, top_k=top_k))
    paths = {0: ()}
    for i, (tok, parent) in enumerate(zip(tokens.tolist(), parents.tolist()), start=1):
        assert parent < i
        paths[i] = paths[parent] + (tok,)
    top = q.topk(top_k, -1).indices.tolist()
    full = [path for d in range(1, depth + 1) for path in itertools.product(*top[:d])]  # every node of the tree

    def value(path):
        return float(torch.tensor([q[d, t] for d, t in enumerate(path)]).prod())

    best = sorted(full, key=value, reverse=True)[: min(nodes, len(full))]
    assert sorted(paths[i] for i in range(1, len(tokens) + 1)) == sorted(best)
    for node in paths:  # siblings are added best first
        kids = [i for i, parent in enumerate(parents.tolist(), start=1) if parent == node]
        vals = [value(paths[i]) for i in kids]
        assert vals == sorted(vals, reverse=True)


def path_q(path: tuple[int, ...], vocab: int = 9) -> torch.Tensor:
    """A draft distribution that depends on the whole path drafted so far (as an autoregressive drafter's)."""
    g = torch.Generator().manual_seed(hash(path) % 2**31)
    return torch.rand(vocab, generator=g, dtype=torch.float64).mul(4).softmax(-1)


@pytest.mark.parametrize("depth,top_k,nodes", [(3, 2, 5), (4, 3, 12), (2, 4, 30), (3, 1, 2)])
def test_dynamic_tree_expands_the_most_valuable_nodes_depth_by_depth(depth, top_k, nodes):
    """Restated on sets: at depth d the offered nodes are the top-k children of each expanded node (depth 1: of the
    anchor), the expanded ones the k most valuable offered; the tree is the ``nodes`` most valuable offered nodes."""
    calls = []

    def start():
        return [()], path_q(())[None]

    def step(chain, rows, tokens):
        calls.append(len(rows))
        paths = [chain[r] + (t,) for r, t in zip(rows.tolist(), tokens.tolist())]
        return paths, torch.stack([path_q(p) for p in paths])

    tokens, parents = dynamic_tree(start, step, depth, TreeConfig(nodes=nodes, top_k=top_k))

    def value(path):
        return math.prod(float(path_q(path[:i])[t]) for i, t in enumerate(path))

    offered, expanded = [], [()]
    for _ in range(depth):
        here = [p + (t,) for p in expanded for t in path_q(p).topk(top_k).indices.tolist()]
        offered += here
        expanded = sorted(here, key=value, reverse=True)[:top_k]
    want = sorted(offered, key=lambda p: (-value(p), len(p)))[:nodes]
    paths = {0: ()}
    for i, (tok, parent) in enumerate(zip(tokens.tolist(), parents.tolist()), start=1):
        assert parent < i
        paths[i] = paths[parent] + (tok,)
    assert sorted(paths[i] for i in range(1, len(tokens) + 1)) == sorted(want)
    assert calls == [top_k] * (depth - 1)  # one drafter call per depth after the first, over the k expanded


def test_tree_settings_are_checked_in_one_sentence():
    with pytest.raises(ValueError, match="tree.nodes must be an int >= 1"):
        TreeConfig(nodes=0)
    with pytest.raises(ValueError, match="tree.top_k must be an int >= 1"):
        TreeConfig(top_k=1.5)
    with pytest.raises(ValueError, match="tree has no field 'width'"):
        TreeConfig.coerce({"width": 3})
    assert TreeConfig.coerce({"nodes": 5}) == TreeConfig(nodes=5)


@pytest.fixture(scope="module", params=BEST_FIRST + DYNAMIC)
def tree_family(request):
    return request.param


@pytest.fixture(scope="module", params=BEST_FIRST)
def best_first_family(request):
    return request.param


@pytest.fixture(scope="module")
def prompts(diverse_target):
    return random_prompts(diverse_target.vocab_size)


@pytest.mark.parametrize("tree", [TreeConfig(nodes=6, top_k=2), TreeConfig(nodes=12, top_k=3, depth=2)])
def test_greedy_tree_decoding_equals_the_argmax_loop(tree_family, diverse_target, prompts, tree):
    # P-EAGLE fits these prompts so well in 40 steps that every round commits the tree's first branch: a drafter
    # trained less also commits off it, so the KV compaction runs
    steps = 15 if tree_family == "peagle" else 40
    assert_greedy_tree_is_the_argmax_loop(trained(tree_family, diverse_target, prompts, k=3, steps=steps),
                                          diverse_target, prompts, tree)


def test_sampled_tree_decoding_is_lossless(tree_family, make_random_llama):
    target = make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)
    drafter = build(tree_family, target, k=2)
    with committed_paths() as paths:
        counts, first = tree_empirical(target, drafter)
    assert_matches(counts, exact_joint(target, PROMPT, T1), target.vocab_size, NEW, tree_family)
    assert any(a == 0 for a in first) and any(a > 0 for a in first), first[:50]
    assert off_the_first_branch(paths) > 0  # sampled rounds committed through later children too


@pytest.mark.parametrize("family", CHAIN_ONLY)
def test_left_to_right_families_refuse_a_tree_in_one_sentence(family, diverse_target):
    drafter = build(family, diverse_target, k=3)
    with pytest.raises(ValueError, match="decode it as a chain"):
        generate(diverse_target, [1, 2, 3], 4, drafter=drafter, plan=TreeConfig())


def test_a_tree_without_a_drafter_is_one_sentence(diverse_target):
    with pytest.raises(ValueError, match="decoding 'tree' drafts with a drafter, and none was given"):
        generate(diverse_target, [1, 2, 3], 4, plan=TreeConfig())


def test_after_a_tree_round_the_drafter_sees_what_a_fresh_prefill_of_the_committed_tokens_gives(
    tree_family, diverse_target, prompts
):
    """``extend`` gets the features of the committed path (not a prefix of the nodes): every round's first draft
    distributions (all slots for a best-first tree, slot 1 for a dynamic one) equal those of a drafter started
    afresh on the committed sequence so far."""
    drafter = trained(tree_family, diverse_target, prompts, k=3)
    best_first = drafter.tree_growth is TreeGrowth.BEST_FIRST
    hook = "position_logits" if best_first else "tree_start"
    original = getattr(drafter, hook)
    seen = []

    def first(state, anchor):
        out = original(state, anchor)
        return out if best_first else out[1]

    def recording(state, anchor):
        out = original(state, anchor)
        seen.append((anchor.clone(), out if best_first else out[1]))
        return out

    setattr(drafter, hook, recording)
    prompt = max(prompts, key=len)
    out = generate(diverse_target, prompt, MAX_NEW, drafter=drafter, plan=TreeConfig(nodes=6, top_k=3))
    delattr(drafter, hook)
    assert any(a > 0 for a in out.accept_lengths)
    committed = prompt + out.tokens
    done = len(prompt) - 1  # the committed tokens before the first round's anchor
    for (anchor, logits), accepted in zip(seen, out.accept_lengths):
        assert int(anchor) == committed[done]
        ids = torch.tensor([committed[:done]], dtype=torch.long)
        features = diverse_target(ids, layers=drafter.target_layers, logits=False).features
        fresh = drafter.begin(features, ids)
        # the features come from verify forwards here and from one prefill there: other matmul shapes, other
        # rounding (1.3e-5 seen on an AVX2-only CPU); features of a wrong path move the logits by ~0.1 and more
        torch.testing.assert_close(logits, first(fresh, anchor), atol=1e-4, rtol=1e-4)
        done += accepted + 1


@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "T1"])
def test_offline_tree_rounds_equal_the_engines_on_every_output(best_first_family, diverse_target, prompts, sampling):
    """A best-first tree's children are chosen, not drawn: given the output, a round accepts the longest root path
    the output follows, so the offline rounds equal each real run's rounds exactly, sampled runs included."""
    drafter = trained(best_first_family, diverse_target, prompts, k=3)
    tree = TreeConfig(nodes=12, top_k=4)
    pairs, real = [], []
    for i, prompt in enumerate(prompts * (1 if sampling.greedy else 4)):
        out = generate(diverse_target, prompt, MAX_NEW, sampling, drafter=drafter, seed=i, plan=tree)
        pairs.append((prompt, out.tokens))
        real.append(float(out.rounds))
    assert sum(real) < sum(len(tokens) for _, tokens in pairs)  # drafts were accepted
    assert offline_rounds(diverse_target, drafter, pairs, sampling, tree=tree).tolist() == real
    chain = offline_rounds(diverse_target, drafter, pairs, sampling)
    assert chain.tolist() != real  # the tree is scored, not the chain


# steps at which each family's tree and chain need different rounds on these prompts (fully trained, both accept
# every slot), so the test also tells a scored tree from a scored chain
PARTLY_TRAINED = {"eagle3": 10, "eagle3_1": 10, "mtp": 5, "d2sd": 20, "specblock": 10}


@pytest.mark.parametrize("family", DYNAMIC + OWN_TREES)
def test_offline_greedy_tree_rounds_replay_the_engines(family, diverse_target, prompts):
    """Trees grown from the drafter's own drafts: the offline replay (``replay_tree_rounds``) gives every greedy
    run's rounds exactly, and the tree is scored, not the chain."""
    drafter = trained(family, diverse_target, prompts, k=3, steps=PARTLY_TRAINED[family])
    tree = TreeConfig(nodes=8, top_k=3)
    pairs, real = [], []
    for prompt in prompts:
        out = generate(diverse_target, prompt, MAX_NEW, drafter=drafter, plan=tree)
        pairs.append((prompt, out.tokens))
        real.append(float(out.rounds))
    assert sum(real) < sum(len(tokens) for _, tokens in pairs)  # drafts were accepted
    assert offline_rounds(diverse_target, drafter, pairs, GREEDY, tree=tree).tolist() == real
    chain = [float(generate(diverse_target, p, MAX_NEW, drafter=drafter).rounds) for p in prompts]
    assert offline_rounds(diverse_target, drafter, pairs, GREEDY).tolist() == chain != real


def test_the_replay_scores_best_first_trees_as_the_exact_evaluator_does(diverse_target, prompts):
    """Replaying a best-first tree's rounds gives the exact evaluator's rounds and per-depth acceptance: two
    independent routes to the same figures (the replay is what dynamic trees are scored with)."""
    drafter = trained("dflash", diverse_target, prompts, k=3)
    tree = TreeConfig(nodes=6, top_k=2)
    responses = [argmax_reference(diverse_target, p, MAX_NEW) for p in prompts]
    exact = offline_report(diverse_target, drafter, list(zip(prompts, responses)), GREEDY, tree=tree, batch_size=1)
    rounds, reached, accepted = [], 0, 0
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([prompt + response])
        features = diverse_target(ids, layers=drafter.target_layers, logits=False).features
        r, re, ac = replay_tree_rounds(drafter, ids, features, [prompt], [response], tree)
        rounds.append(float(r[0]))
        reached, accepted = reached + re, accepted + ac
    assert rounds == exact.rounds.tolist()
    torch.testing.assert_close(reached, exact.slot_reached)
    torch.testing.assert_close(accepted, exact.slot_accepted)
    assert float(accepted[0]) > 0


@pytest.mark.parametrize("family,sampling,says", [("eagle3", T1, "greedy decoding only"),
                                                  ("dspark", GREEDY, "decode it as a chain")])
def test_offline_trees_are_refused_where_they_cannot_be_scored_exactly(diverse_target, family, sampling, says):
    drafter = build(family, diverse_target, k=3)
    with pytest.raises(ValueError, match=says):
        offline_rounds(diverse_target, drafter, [([1, 2], [3, 4])], sampling, tree={"nodes": 4})


def test_evaluate_takes_a_tree_offline_and_online(tmp_path, monkeypatch, tiny_target, capsys):
    """``lightning-spec evaluate --decoding '{kind: tree, ...}'``: offline it scores the tree exactly (the rounds
    ``offline_rounds(tree=)`` gives), online it decodes with it; both record the plan in the JSON and say so in the
    table's title."""
    import json
    import sys

    from helpers.offline import saved_drafters

    from lightning_spec.cli import main
    from lightning_spec.data import prompt_ids
    from lightning_spec.data.rollout_writer import Draw, generate_rollouts

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    (path,) = saved_drafters(tiny_target, tmp_path, seeds=(0,))
    prompts = [{"id": f"p{i}", "domain": "chat", "subdomain": "",
                "prompt_ids": prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": text}])}
               for i, text in enumerate(["hello", "2+2?"])]
    generate_rollouts(tiny_target, prompts, Draw(T1, 2, 10, seed=0), tmp_path / "t1", batch_size=4, progress=False)
    tree = "{kind: tree, nodes: 4, top_k: 2}"
    main(["evaluate", "--mode", "offline", "--rollouts", "t1", "--drafters", f"[{path}]", "--decoding", tree,
          "--n_resamples", "50", "--output", "off.json", "--progress", "false"])
    assert "decoding tree 4/top 2" in capsys.readouterr().out
    result = json.loads((tmp_path / "off.json").read_text())
    assert result["decoding"] == {"kind": "tree", "nodes": 4, "top_k": 2}
    drafter, rollouts = load_drafter(path, target=tiny_target), load_rollout_set(tmp_path / "t1")
    want = offline_rounds(tiny_target, drafter, rollouts, tree=TreeConfig(nodes=4, top_k=2))
    assert result["arms"]["drafter0"]["rounds"] == pytest.approx(want.tolist())
    main(["evaluate", "--mode", "online", "--drafters", f"[{path}]", "--decoding", tree, "--sources", "[mt-bench]",
          "--prompts_per_source", "2", "--max_new_tokens", "6", "--n_resamples", "50", "--output", "on.json",
          "--progress", "false"])
    result = json.loads((tmp_path / "on.json").read_text())
    assert result["decoding"]["nodes"] == 4 and result["arms"]["drafter0"]["tokens"] > 0


def test_evaluate_compares_a_chain_with_a_tree_of_the_same_drafter(tmp_path, monkeypatch, tiny_target, capsys):
    """``--decodings``: one plan per drafter, so one checkpoint scored as a chain and as a tree is a paired comparison;
    each arm's rounds are those of its own plan, and online each arm decodes with its own (its speedup has a paired
    interval). Both ``--decoding`` and ``--decodings``, a count that does not match, or a plan offline cannot score
    are one sentence."""
    import json
    import sys

    from helpers.offline import saved_drafters

    from lightning_spec.cli import main
    from lightning_spec.data import prompt_ids
    from lightning_spec.data.rollout_writer import Draw, generate_rollouts

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    (path,) = saved_drafters(tiny_target, tmp_path, seeds=(0,))
    prompts = [{"id": f"p{i}", "domain": "chat", "subdomain": "",
                "prompt_ids": prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": text}])}
               for i, text in enumerate(["hello", "2+2?", "a poem"])]
    generate_rollouts(tiny_target, prompts, Draw(GREEDY, 1, 10, seed=0), tmp_path / "g", batch_size=4, progress=False)
    arms = ["--drafters", f"[{path}, {path}]", "--names", "[chain, tree]",
            "--decodings", "[null, {kind: tree, nodes: 6, top_k: 3}]",
            "--n_resamples", "50", "--progress", "false"]
    main(["evaluate", "--mode", "offline", "--rollouts", "g", "--output", "off.json", *arms])
    out = capsys.readouterr().out
    assert "tree 6/top 3" in out and "chain" in out
    result = json.loads((tmp_path / "off.json").read_text())
    assert result["decoding"] is None
    assert result["arms"]["tree"]["decoding"] == {"kind": "tree", "nodes": 6, "top_k": 3}
    drafter, rollouts = load_drafter(path, target=tiny_target), load_rollout_set(tmp_path / "g")
    tree = offline_rounds(tiny_target, drafter, rollouts, tree=TreeConfig(nodes=6, top_k=3)).tolist()
    chain = offline_rounds(tiny_target, drafter, rollouts).tolist()
    assert result["arms"]["tree"]["rounds"] == pytest.approx(tree)
    assert result["arms"]["chain"]["rounds"] == pytest.approx(chain)
    main(["evaluate", "--mode", "online", "--sources", "[mt-bench]", "--prompts_per_source", "2",
          "--max_new_tokens", "6", "--output", "on.json", "--mlflow", "true", *arms])
    result = json.loads((tmp_path / "on.json").read_text())
    for name in ("chain", "tree"):
        lo, hi = result["arms"][name]["speedup_ci"]
        assert lo <= result["arms"][name]["speedup"] <= hi
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(f"lightning_spec: {result['target']}, evaluate")  # one per target
    runs = client.search_runs([experiment.experiment_id])
    decoding = {r.data.tags["lightning_spec.arm"]: r.data.params["decoding"] for r in runs}
    assert decoding == {"chain": "chain", "tree": "tree 6/top 3"}
    assert all(r.data.metrics["online/speedup_lo"] <= r.data.metrics["online/speedup"] for r in runs)
    with pytest.raises(SystemExit):
        main(["evaluate", "--mode", "offline", "--rollouts", "g", "--decoding", "{kind: tree, nodes: 4}", *arms])
    assert "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["evaluate", "--mode", "offline", "--rollouts", "g", "--drafters", f"[{path}]", "--decodings",
              "[null, null]"])
    assert "one per drafter" in capsys.readouterr().err
    for plan, words in [("plain", "measured by real decoding"), ("{kind: chain, length: 1}", "whole chain")]:
        with pytest.raises(SystemExit):
            main(["evaluate", "--mode", "offline", "--rollouts", "g", "--drafters", f"[{path}]", "--decoding", plan])
        assert words in capsys.readouterr().err


def test_decode_validation_takes_a_tree_from_yaml(tmp_path, monkeypatch):
    """``SpecDecodeValidation(decoding={kind: tree, ...})`` from a YAML overlay: every speculative decode of the fit is
    a tree decode."""
    import sys

    import lightning_spec.decoding.timed as benchmark
    from lightning_spec.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    seen = []
    real = benchmark.generate

    def recording(*args, **kwargs):
        seen.append((kwargs.get("drafter") is not None, kwargs.get("plan")))
        return real(*args, **kwargs)

    monkeypatch.setattr(benchmark, "generate", recording)
    overlay = tmp_path / "tree.yaml"
    overlay.write_text("trainer:\n  callbacks:\n    - init_args:\n        decoding: {kind: tree, nodes: 4, top_k: 2}\n")
    tiny = Path(__file__).resolve().parents[2] / "experiments" / "tiny.yaml"
    main(["fit", "-c", str(tiny), "-c", str(overlay), "--trainer.logger=false", "--trainer.max_steps=3"])
    speculative = [plan for drafted, plan in seen if drafted]
    assert speculative and all(plan == Tree(nodes=4, top_k=2) for plan in speculative)
    assert all(plan is None for drafted, plan in seen if not drafted)  # plain decoding has no plan


@pytest.mark.parametrize("family", DYNAMIC)
def test_tree_steps_draft_what_the_chain_drafts_along_each_path(family, diverse_target):
    """``tree_start`` and ``tree_step`` (rows taken out of order and twice) give each row the distribution the
    teacher-forced forward gives along that row's path: the branching keeps every row's own entries."""
    drafter = build(family, diverse_target, k=3, seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, diverse_target.vocab_size, (1, 9), generator=g)
    n = 6  # the anchor
    feats = diverse_target(ids[:, :n], layers=drafter.target_layers, logits=False).features
    state = drafter.begin(feats, ids[:, :n])
    chain, first = drafter.tree_start(state, ids[0, n : n + 1])
    a, b, c, d = (int(drafter.vocab.to_draft(torch.tensor([t]))[0]) for t in (11, 23, 35, 47))
    chain, second = drafter.tree_step(chain, torch.tensor([0, 0]), torch.tensor([a, b]))  # rows: (a), (b)
    chain, third = drafter.tree_step(chain, torch.tensor([1, 0, 1]), torch.tensor([c, d, d]))  # (b,c) (a,d) (b,d)
    rows = {(): first[0], (a,): second[0], (b,): second[1], (b, c): third[0], (a, d): third[1], (b, d): third[2]}
    for path, got in rows.items():
        tokens = [int(drafter.vocab.to_target(torch.tensor([t]))[0]) for t in path]
        seq = torch.cat([ids[0, : n + 1], torch.tensor(tokens + [0] * (3 - len(tokens)))])[None]  # (1, n + 4)
        features = diverse_target(seq, layers=drafter.target_layers, logits=False).features
        batch = {"input_ids": seq, "loss_mask": torch.ones_like(seq, dtype=torch.bool)}
        want = drafter(batch, features, Anchors(torch.tensor([[n]]), torch.tensor([[True]]))).logits[0, 0, len(path)]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=str(path))
