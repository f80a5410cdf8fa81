"""Token trees verified in one target forward (METHODS §1.2): the tree forward, the cache after it, and the
acceptance rules.

- the forward: every node's logits equal those of running its root path as a chain (``FastForward`` on its static
  cache, and transformers' forward with eager, SDPA and our shared-KV SDPA), and after ``Target.keep`` the cache reads
  as if the committed path had been run as a chain;
- greedy: the committed path is the longest one greedy decoding would produce;
- sampling, one node exactly: for every draw of the candidates (independent, without replacement, or chosen
  deterministically) and every accept/reject branch of ``verify.candidate_rule``, enumerated in float64, the
  committed token is distributed as p; the same enumeration with the wrong rule for the draws does not hold;
- sampling, whole decoding: ``generate`` with a tree-proposing drafter against the exact distribution of a tiny
  target (χ²), for several tree shapes and each rule, and a deliberately wrong residual fails it.
"""

import itertools

import pytest
import torch
from helpers.sampling import NEW, PROMPT, assert_matches, chi_square, empirical, exact_joint

from lightning_spec import SamplingConfig, generate
from lightning_spec.cpu_kernels import SHARED_KV_SDPA, register_shared_kv_sdpa
from lightning_spec.decoding import verify
from lightning_spec.decoding.proposals import TreeProposal
from lightning_spec.drafters import Drafter
from lightning_spec.fast_forward import StaticCache

F64 = torch.float64
GREEDY, T1 = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)

# A tree after the anchor (node 0): 1 and 2 under the anchor, 3 and 4 under 1, 5 under 3, 6 under 2.
PARENTS = torch.tensor([0, 0, 1, 1, 3, 2])


def root_path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1] - 1])
    return path[::-1]


@pytest.fixture(scope="module", params=["fast", "eager", "sdpa", SHARED_KV_SDPA])
def target(request, make_random_llama):
    target = make_random_llama(seed=3)
    if request.param == "fast":
        assert target.fast_decoding is None
        return target
    if request.param == SHARED_KV_SDPA:
        assert register_shared_kv_sdpa()
    target.decode = "transformers"
    target.model.set_attn_implementation(request.param)
    return target


def layers_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's cached keys and values (1, Hkv, S, D), from a ``StaticCache`` or transformers' ``DynamicCache``."""
    if isinstance(cache, StaticCache):
        return [(kv[0, None, :, : cache.length], kv[1, None, :, : cache.length]) for kv in cache.kv]
    return [(layer.keys, layer.values) for layer in cache.layers]


def cached(target, prefix):
    cache = target.new_cache()
    target(prefix, cache=cache, logits=False)
    return cache


def test_every_root_path_of_a_tree_gets_its_chain_logits(target):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (1, 9), generator=g)
    anchor = torch.randint(0, target.vocab_size, (1,), generator=g)
    tree = TreeProposal(tokens=torch.randint(0, target.vocab_size, (6,), generator=g), parents=PARENTS)
    ids, depth, mask = tree.verify_inputs(anchor)
    assert depth.tolist() == [0, 1, 1, 2, 2, 3, 2]
    out = target(ids[None], layers=[0, 1], cache=cached(target, prefix), positions=depth, tree_mask=mask)
    for node in range(7):
        path = root_path(PARENTS.tolist(), node)
        chain = target(ids[path][None], layers=[0, 1], cache=cached(target, prefix))
        torch.testing.assert_close(out.logits[0, node], chain.logits[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.features[0, node], chain.features[0, -1], atol=1e-5, rtol=1e-5)


def test_the_cache_keeps_the_committed_path_as_if_it_ran_as_a_chain(target):
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, target.vocab_size, (1, 6), generator=g)
    anchor = torch.randint(0, target.vocab_size, (1,), generator=g)
    tree = TreeProposal(tokens=torch.randint(0, target.vocab_size, (6,), generator=g), parents=PARENTS)
    ids, depth, mask = tree.verify_inputs(anchor)
    cache = cached(target, prefix)
    target(ids[None], cache=cache, positions=depth, tree_mask=mask)
    path = [0, 1, 3, 5]  # not a prefix of the nodes: the cache is compacted, not cropped
    target.keep(cache, 6, path)
    chain = cached(target, torch.cat([prefix, ids[path][None]], 1))
    assert cache.get_seq_length() == chain.get_seq_length() == 10
    for mine, theirs in zip(layers_kv(cache), layers_kv(chain), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    nxt = torch.tensor([[5]])
    torch.testing.assert_close(target(nxt, cache=cache).logits, target(nxt, cache=chain).logits, atol=1e-5, rtol=1e-5)


def test_bad_trees_are_one_sentence(diverse_target):
    with pytest.raises(ValueError, match="parents must name an earlier node"):
        TreeProposal(tokens=torch.tensor([1, 2]), parents=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="one row per draft node"):
        TreeProposal(tokens=torch.tensor([1, 2]), parents=torch.tensor([0, 0]), probs=torch.ones(3, 4))
    with pytest.raises(ValueError, match="over a KV cache"):
        diverse_target(torch.tensor([[1, 2]]), tree_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="sees itself"):
        diverse_target(torch.tensor([[1, 2]]), cache=diverse_target.new_cache(), tree_mask=torch.zeros(2, 2).bool())


def test_greedy_follows_the_longest_path_of_target_argmaxes():
    tree = TreeProposal(tokens=torch.tensor([4, 7, 2, 9, 3, 7]), parents=PARENTS)  # node i holds tokens[i - 1]
    logits = torch.zeros(7, 10)
    for node, best in {0: 4, 1: 9, 4: 6, 2: 1, 3: 3}.items():
        logits[node, best] = 1.0
    # anchor -> node 1 (4) -> node 4 (9) -> no child of node 4: commit the argmax there, 6
    assert tree.accept(logits, GREEDY, None) == ([0, 1, 4], 6)
    logits[0] = 0.0
    logits[0, 7] = 1.0  # the anchor's argmax is node 2's token; node 2's argmax (1) is not its child's (7)
    assert tree.accept(logits, GREEDY, None) == ([0, 2], 1)


# ----------------------------------------------------------------------------- one node, exactly, by enumeration
def draws(q: torch.Tensor | None, m: int, replacement: bool):
    """Every ordered draw of m candidates with its probability: independent from q, without replacement from q
    (each next one from q with the earlier ones removed, renormalised), or, for q None, one deterministic set."""
    vocab = 5
    if q is None:
        yield torch.tensor([3, 0, 4][:m]), 1.0
        return
    for cands in itertools.product(range(vocab), repeat=m):
        if not replacement and len(set(cands)) < m:
            continue
        prob, left = 1.0, q.clone()
        for c in cands:
            prob *= float(left[c] / left.sum())
            if not replacement:
                left[c] = 0.0
        yield torch.tensor(cands), prob


def committed(p, q, m, replacement, rule_replacement):
    """The exact distribution of the token one node commits, over every draw and every branch of the rule."""
    out = torch.zeros_like(p)
    for cands, prob in draws(q, m, replacement):
        accept, rest = verify.candidate_rule(p, cands, q, rule_replacement)
        reach = 1.0
        for c, a in zip(cands.tolist(), accept.tolist()):
            out[c] += prob * reach * a
            reach *= 1 - a
        out += prob * reach * rest
    return out


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("kind", ["independent", "without replacement", "deterministic"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_node_commits_a_token_distributed_as_p(m, kind, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(5, generator=g, dtype=F64).mul(2).softmax(-1)
    q = None if kind == "deterministic" else torch.randn(5, generator=g, dtype=F64).mul(2).softmax(-1)
    replacement = kind == "independent"
    torch.testing.assert_close(committed(p, q, m, replacement, replacement), p, atol=1e-12, rtol=0)


@pytest.mark.parametrize("drawn,rule", [(True, False), (False, True)])
def test_the_enumeration_tells_the_two_sampled_rules_apart(drawn, rule):
    """Candidates drawn one way and verified with the other rule's residual commit a token not distributed as p."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(5, generator=g, dtype=F64).mul(2).softmax(-1)
    q = torch.randn(5, generator=g, dtype=F64).mul(2).softmax(-1)
    assert (committed(p, q, 3, drawn, rule) - p).abs().max() > 1e-3


# --------------------------------------------------------------------------------- whole decoding, statistically
class FixedTreeDrafter(Drafter):
    """Ignores its context and proposes a fixed tree shape: node i's children come from a fixed random q_d at its
    depth d (drawn independently or without replacement, or the top-m of q_d when ``kind`` is deterministic)."""

    def __init__(self, target, parents: list[int], kind: str, seed: int = 1) -> None:
        depth = TreeProposal(tokens=torch.zeros(len(parents), dtype=torch.long),
                             parents=torch.tensor(parents)).verify_inputs(torch.zeros(1, dtype=torch.long))[1]
        super().__init__(int(depth.max()), target_layers=[0])
        self.parents, self.kind = parents, kind
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(self.block_size, target.vocab_size, generator=g).softmax(-1)  # (D, V)
        self.bind(target)

    def build(self, target) -> None:
        pass  # nothing target-shaped: the tree is fixed

    def begin(self, features, input_ids=None):
        return None

    def extend(self, state, features, path) -> None:
        pass

    def propose(self, state, anchor, sampling, generator=None) -> TreeProposal:
        kids: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents, start=1):
            kids.setdefault(parent, []).append(i)
        tokens = [0] * len(self.parents)
        depth = {0: 0}
        probs = torch.zeros(len(self.parents), self.q.shape[1])
        for node in sorted(kids):
            children = kids[node]
            d = depth[node]
            q = self.q[d]
            if sampling.greedy or self.kind == "deterministic":
                picks = q.topk(len(children)).indices
            else:
                picks = torch.multinomial(q, len(children), replacement=self.kind == "independent", generator=generator)
            for child, tok in zip(children, picks.tolist()):
                tokens[child - 1], depth[child] = tok, d + 1
                probs[child - 1] = q
        sampled = not sampling.greedy and self.kind != "deterministic"
        return TreeProposal(tokens=torch.tensor(tokens), parents=torch.tensor(self.parents),
                            probs=probs if sampled else None, replacement=self.kind != "without replacement")

    def config_dict(self) -> dict:
        return {}


SHAPES = {"two children": [0, 0], "a fork then a chain": [0, 0, 1, 3], "three wide, two deep": [0, 0, 0, 1, 2]}
KINDS = ["independent", "without replacement", "deterministic"]


@pytest.fixture(scope="module")
def small_target(make_random_llama):
    return make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
def test_sampled_tree_decoding_is_lossless(small_target, shape, kind):
    drafter = FixedTreeDrafter(small_target, SHAPES[shape], kind)
    counts, first = empirical(small_target, T1, drafter, runs=800)
    assert_matches(counts, exact_joint(small_target, PROMPT, T1), small_target.vocab_size, NEW, (shape, kind))
    assert any(a == 0 for a in first) and any(a > 0 for a in first), first[:50]  # both branches ran


def test_a_wrong_residual_fails_the_tree_check(small_target, monkeypatch):
    """Verification that keeps p after a rejection (no residual) over-commits the drafted tokens: χ² sees it."""
    rule = verify.candidate_rule

    def no_residual(p, candidates, q, replacement):
        accept, _ = rule(p, candidates, q, replacement)
        return accept, p.double()

    monkeypatch.setattr(verify, "candidate_rule", no_residual)
    drafter = FixedTreeDrafter(small_target, SHAPES["three wide, two deep"], "independent")
    counts, _ = empirical(small_target, T1, drafter, runs=600)
    stat, bound = chi_square(counts, exact_joint(small_target, PROMPT, T1))
    assert stat > bound, (stat, bound)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_tree_decoding_equals_plain_greedy(diverse_target, shape):
    drafter = FixedTreeDrafter(diverse_target, SHAPES[shape], "deterministic")
    prompt = [3, 17, 42, 8]
    plain = generate(diverse_target, prompt, 24)
    out = generate(diverse_target, prompt, 24, drafter=drafter)
    assert out.tokens == plain.tokens
    assert out.rounds == len(out.accept_lengths) and out.draft_lengths == [len(SHAPES[shape])] * out.rounds
