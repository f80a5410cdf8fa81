"""Every drafter family's test configurations on tiny targets (``FAMILIES``: name -> a constructor taking K), and
a drafter of one built or trained until it is accepted. tests/drafters/test_families.py holds each to the
guarantees; the tree, DDP, export, architecture and per-family tests reuse them."""

import weakref

import torch

from helpers.decoding import MAX_NEW, argmax_reference
from lightning_spec.drafters import (
    D2SDDrafter,
    DFlash2Drafter,
    DFlashDrafter,
    DFlyDrafter,
    DominoDrafter,
    DSparkDrafter,
    Eagle3Drafter,
    MedusaDrafter,
    MTPDrafter,
    PEagleDrafter,
    SpecBlockDrafter,
)
from lightning_spec.objectives import CE, Objective, SelectorCE

FAMILIES = {
    "dflash": lambda k: DFlashDrafter(block_size=k, num_layers=1, num_anchors=64),
    # DFlash as served (qk norms, one shared mask token: what `lightning-spec export` writes for vLLM)
    "dflash_served": lambda k: DFlashDrafter(block_size=k, num_layers=1, num_anchors=64, qk_norm=True, mask_token_id=1),
    # DFlash2: the convolutions and the selector (a rank-8 selector over each slot's 4 best tokens)
    "dflash2": lambda k: DFlash2Drafter(block_size=k, num_layers=1, num_anchors=64, conv_group_size=8, selector_rank=8,
                                        selector_top_k=4),
    # DFlash2 as the speculators format holds it (DFlash's served layout, the full vocabulary)
    "dflash2_served": lambda k: DFlash2Drafter(block_size=k, num_layers=1, num_anchors=64, qk_norm=True,
                                               mask_token_id=1, conv_group_size=8, selector_rank=8, selector_top_k=4),
    "dfly": lambda k: DFlyDrafter(block_size=k, num_layers=1, num_anchors=64, hidden_correction=True),
    "dspark": lambda k: DSparkDrafter(block_size=k, num_layers=1, num_anchors=64, markov_rank=16),
    "dspark_rnn": lambda k: DSparkDrafter(block_size=k, num_layers=1, num_anchors=64, markov="rnn", markov_rank=16),
    # DSpark and MTP as the speculators format holds them (what `lightning-spec export` writes)
    "dspark_served": lambda k: DSparkDrafter(block_size=k, num_layers=1, num_anchors=64, markov_rank=16, qk_norm=True,
                                             mask_token_id=1),
    "domino": lambda k: DominoDrafter(block_size=k, num_layers=1, num_anchors=64, gru_size=16, correction_rank=32),
    "eagle3": lambda k: Eagle3Drafter(block_size=k, num_anchors=64),
    # EAGLE-3.1: a norm per feature layer before fc and the normed state passed on from slot to slot
    "eagle3_1": lambda k: Eagle3Drafter(block_size=k, num_anchors=64, fc_norm=True, norm_output=True),
    "medusa": lambda k: MedusaDrafter(block_size=k, num_anchors=64),
    "peagle": lambda k: PEagleDrafter(block_size=k, num_anchors=64, mask_token_id=1),
    "mtp": lambda k: MTPDrafter(block_size=k, num_modules=2, num_anchors=64),
    "mtp_served": lambda k: MTPDrafter(block_size=k, num_anchors=64, qk_norm=True, normed_chain=True),
    "d2sd": lambda k: D2SDDrafter(block_size=k, num_layers=1, num_anchors=64),
    "specblock": lambda k: SpecBlockDrafter(block_size=2 * k, blocks=2, num_layers=2, num_anchors=64, rank_width=32),
}


def own_objective(drafter) -> Objective:
    """CE, or for a drafter that draws from a candidate set (DFlash2's selector) SelectorCE with CE as its base."""
    return Objective(SelectorCE() if drafter.sparse_logits else CE())


def build(family: str, target, k: int, seed: int = 0):
    torch.manual_seed(seed)
    drafter = FAMILIES[family](k)
    drafter.bind(target)
    return drafter.eval()


# (family, its constructor, the target, prompts, K, steps) -> (the target, weakly, and the trained weights)
_TRAINED: dict[tuple, tuple[weakref.ref, dict[str, torch.Tensor]]] = {}


def trained(family: str, target, prompts, k: int, steps: int = 40):
    """The family's drafter trained with CE on the target's own greedy continuations of ``prompts`` until it is
    accepted in a good share of rounds (every supervised position is an anchor: deterministic).

    Trained once per test process: a later call with the same family, target object, prompts, K and steps builds a
    new drafter (its own weights, which the caller may change; the same random draws as a first call) and loads the
    weights the first call trained, which training again would reproduce bit for bit."""
    make = FAMILIES[family]
    key = (family, id(make), id(target), tuple(tuple(int(t) for t in p) for p in prompts), k, steps)
    drafter = build(family, target, k)
    hit = _TRAINED.get(key)
    if hit is not None and hit[0]() is target:  # the same target object, not a new one at a reused id
        drafter.load_state_dict(hit[1])
        return drafter.eval()
    drafter = fit_to_greedy_continuations(target, drafter, prompts, steps)
    _TRAINED[key] = (weakref.ref(target), {name: v.detach().clone() for name, v in drafter.state_dict().items()})
    return drafter


def fit_to_greedy_continuations(target, drafter, prompts, steps: int = 40):
    """``drafter`` (any family, bound) trained with CE on the target's own greedy continuations of ``prompts``,
    every supervised position an anchor; returned in eval mode."""
    drafter.train()
    rows = [prompt + argmax_reference(target, prompt, MAX_NEW) for prompt in prompts]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)  # (N, S)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(prompt) : len(row)] = True
    batch = {"input_ids": ids, "loss_mask": mask}
    features = target(ids, layers=drafter.target_layers, logits=False).features  # (N, S, F)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    objective = own_objective(drafter)
    for _ in range(steps):
        terms = objective(drafter(batch, features))
        opt.zero_grad()
        (terms.num / terms.den).backward()
        opt.step()
    return drafter.eval()
