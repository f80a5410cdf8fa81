"""The drafter contract: what every drafter family gives the rest of the framework, and nothing more.

Callers (the module, the engine, the offline evaluator, the objectives) use only what is declared here; no
caller inspects a drafter's class or signature. A family is one file under ``drafters/`` that subclasses
``Drafter`` and owns its math. A drafter owns no loss, optimizer or logging: ``objectives/`` and ``module.py``
import drafters, never the reverse, so every objective trains every drafter.

A drafter borrows the target's frozen embedding and LM head through ``bind(target)``; they are never registered
as drafter parameters, so a drafter checkpoint holds the drafter only.

Training: ``sample_anchors`` picks anchors n (the last committed token of a round), ``forward`` runs every slot
t = 1..K of every anchor teacher-forced and returns a ``DraftOutput``. Decoding: ``begin`` builds a state from
the prompt's features, ``propose`` drafts a ``Proposal`` after an anchor, ``extend`` commits the verified path.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_spec.decoding.proposals import TreeProposal
from lightning_spec.decoding.proposer import Proposer, TreeGrowth
from lightning_spec.decoding.trees import best_first_tree, dynamic_tree, tree_probs
from lightning_spec.drafts import Anchors, DraftOutput, DraftVocab, Head  # noqa: F401 (the contract's types)
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.trees import TreeConfig
    from lightning_spec.target import Target


# ---------------------------------------------------------------------------------------------------- drafter
class Drafter(nn.Module, Proposer):
    """Base class of every family, and a ``Proposer`` (``decoding/proposer.py``). A family passes the shared
    arguments to ``__init__``, stores its own, declares its capabilities (the class attributes ``family``,
    ``parallel_slots`` and the contract's ``tree_growth``) and implements ``default_target_layers``, ``build``,
    ``forward``, ``begin``, ``propose`` and ``extend``; ``config_dict`` reads the ``__init__`` arguments back from
    same-named attributes unless a family overrides it. docs/adding-a-drafter.md walks through one.

    Attributes:
        block_size: K, the most proposals per round (a chain's length, later a tree's depth).
        target_layers: 0-indexed target layers whose outputs the drafter reads (``Target.features``).
        num_anchors: anchors per training sequence for the default ``sample_anchors``.
        vocab: the draft vocabulary and its head.
    """

    #: The family's name in the registry (``drafters.FAMILIES``): YAML overlays, export codecs and the family tests
    #: find a family by it. None on the shared bodies that are no family of their own.
    family: str | None = None

    def __init__(
        self,
        block_size: int,
        target_layers: list[int] | None = None,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
    ) -> None:
        """What every family stores: K, the target layers it reads (empty = ``default_target_layers`` at ``bind``),
        the anchors per training sequence and the draft vocabulary's size. A family's constructor checks and
        stores its own arguments only; its layers are built by ``build`` once a target is bound."""
        super().__init__()
        for name, value in (("block_size", block_size), ("num_anchors", num_anchors)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"drafter.{name} must be an int >= 1, got {value!r}.")
        self.block_size = block_size
        self.target_layers = list(target_layers) if target_layers is not None else []
        self.num_anchors = num_anchors
        self.draft_vocab_size = draft_vocab_size
        self.vocab = DraftVocab(draft_vocab_size)
        self.built = False  # True once ``build`` made the target-shaped layers
        self._target: list[Any] = []  # a list so the frozen target is not registered as a submodule
        self._register_load_state_dict_pre_hook(_rename_old_vocab_keys)

    # -------------------------------------------------------------------------------------------- binding
    def bind(self, target: Target) -> None:
        """Attach the frozen target whose embedding and LM head the drafter uses. The first time, choose the default
        target layers, size the draft vocabulary and ``build`` the family's target-shaped layers; later binds (the
        same weights loaded again, ``use_target``) only check the layers."""
        self._target[:] = [target]
        if not self.target_layers:
            self.target_layers = self.default_target_layers(target.num_layers)
        target.check_layers(self.target_layers)
        if self.built:
            return
        self.vocab.build(target.vocab_size)
        self.build(target)
        self.to(target.device)
        self.built = True

    def default_target_layers(self, num_target_layers: int) -> list[int]:
        """The target layers read when ``target_layers`` is not given (``layers.spread_layers`` or
        ``layers.low_mid_high_layers``, or the last layer)."""
        raise NotImplementedError(f"{type(self).__name__} must implement default_target_layers")

    def build(self, target: Target) -> None:
        """Make the family's target-shaped layers (``layers.TargetShape.of(target)``) and initialise them; called once,
        from the first ``bind``, after ``vocab`` was sized. A family that extends another calls ``super().build``
        first, then adds its own."""
        raise NotImplementedError(f"{type(self).__name__} must implement build")

    @property
    def target(self) -> Any:
        if not self._target:
            raise RuntimeError("This drafter is not bound to a target yet; call drafter.bind(target) first.")
        return self._target[0]

    def use_target(self, target: Target) -> None:
        """Decode or score with ``target``: it must be the bound target or another copy of the same weights (equal
        fingerprints, or the same weights cast to another dtype: ``Target.converted``; ``load_drafter`` without a
        target may have bound one), which is then bound instead."""
        bound = self.target
        if bound is target or bound.model is target.model:
            return
        if not bound.same_weights(target):
            raise UserError(
                f"The drafter is bound to a different target ({bound.name!r}, weights fingerprint {bound.fingerprint})"
                f" than the one it is used with ({target.name!r}, {target.fingerprint}); load it with "
                "load_drafter(path, target=target) for the target it was trained for."
            )
        self.bind(target)

    def head(self, hidden: Tensor) -> Tensor:
        """Draft logits over the draft vocabulary through the frozen target head: (..., H) -> (..., Vd)."""
        return self.vocab.logits(hidden, self.target.lm_head)

    def choose_vocab(self, token_counts: Tensor) -> None:
        """Keep the ``Vd`` most frequent target tokens of the training data (``token_counts`` (V,)) as the draft
        vocabulary, then let the family set what depends on it (``on_vocab_chosen``)."""
        self.vocab.set_from_counts(token_counts)
        self.on_vocab_chosen()

    def on_vocab_chosen(self) -> None:
        """Called once ``fit`` chose a reduced draft vocabulary (``vocab.set_from_counts``): a family whose weights
        depend on it (an own LM head over those rows) sets them here."""

    # ------------------------------------------------------------------------------------------- training
    def sample_anchors(self, batch: dict[str, Tensor], generator: torch.Generator | None = None) -> Anchors:
        """Up to ``num_anchors`` anchors per sequence, uniformly without replacement among positions n whose next
        token is supervised (loss_mask[n + 1]); sorted, unused slots last (DFlash's anchor sampling).

        Row i draws from its own generator seeded with ``batch["anchor_seed"][i]`` when the batch has it (the
        module puts it there), so its anchors do not depend on the batch it sits in, its padding or its DDP
        rank; otherwise from ``generator`` (or the global RNG)."""
        loss_mask = batch["loss_mask"]
        n, s = loss_mask.shape
        candidate = torch.zeros_like(loss_mask, dtype=torch.bool)
        candidate[:, :-1] = loss_mask[:, 1:].bool()  # (N, S)
        a = min(self.num_anchors, s)
        seeds = batch.get("anchor_seed")
        if seeds is not None:
            scores = seeded_rand(seeds, s).to(loss_mask.device)  # (N, S)
        else:
            scores = torch.rand(n, s, generator=generator, device="cpu" if generator else loss_mask.device)
            scores = scores.to(loss_mask.device)
        scores = scores.masked_fill(~candidate, -1.0)
        top = scores.topk(a, dim=-1)
        keep = top.values >= 0  # (N, A)
        anchors = torch.where(keep, top.indices, torch.zeros_like(top.indices))
        anchors, order = anchors.masked_fill(~keep, s).sort(dim=-1)  # sorted; unused slots last
        keep = keep.gather(1, order)
        return Anchors(anchors.masked_fill(~keep, 0), keep)

    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Teacher-forced forward of every slot of every anchor. batch: ``input_ids`` (N, S), ``loss_mask``
        (N, S); features (N, S, F) of ``target_layers``; ``anchors`` None = ``sample_anchors(batch)``.

        The slot distributions must be those ``propose`` draws from when every earlier slot was accepted (the
        offline evaluator and EDR score a drafter through this forward)."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    def labels(self, batch: dict[str, Tensor], anchors: Anchors) -> tuple[Tensor, Tensor]:
        """Gold labels x_{n+t}, t = 1..K, as draft ids (N, A, K), and ``valid``: inside the sequence, supervised,
        a kept anchor, and in the draft vocabulary."""
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        n, s = ids.shape
        a = anchors.positions.shape[1]
        pos = anchors.positions[..., None] + torch.arange(1, self.block_size + 1, device=ids.device)  # (N, A, K)
        inside = pos < s
        pos = pos.clamp(max=s - 1).reshape(n, -1)
        gold = ids.gather(1, pos).view(n, a, -1)
        supervised = loss_mask.gather(1, pos).view(n, a, -1)
        labels, contained = self.vocab.to_draft(gold)
        return labels, inside & supervised & anchors.keep[..., None] & contained

    # ------------------------------------------------------------------------------------------- decoding
    # The proposal contract (``decoding/proposer.py``): ``begin``, ``propose``, ``propose_tree``, ``adopt``,
    # ``extend``, and the declarations ``tree_growth`` (NONE here: chains only) and ``drafting`` (DRAWN: every
    # trained family draws its drafts). A family sets ``tree_growth`` to BEST_FIRST (and implements
    # ``position_logits``), DYNAMIC (``tree_start`` / ``tree_step``) or OWN (overrides ``propose_tree``).
    def begin(self, features: Tensor, input_ids: Tensor) -> Any:
        """Decoding state from the prefill: the features (1, S, F) of positions 0..S-1 and their tokens (1, S)."""
        raise NotImplementedError(f"{type(self).__name__} must implement begin")

    def propose(self, state: Any, anchor: Tensor, sampling: SamplingConfig, generator=None) -> Any:
        """A ``decoding.proposals.Proposal`` after ``anchor`` (1,), the committed token at position
        ``state.length``: at most ``block_size`` tokens, drawn from the distributions it records."""
        raise NotImplementedError(f"{type(self).__name__} must implement propose")

    #: Classes (module paths) whose checkpoints this family may start from (``model.init_from``), and the fragments
    #: naming the weights those lack, which keep their fresh start (DFlash2 from DFlash). Empty by default.
    warm_start_from: tuple[str, ...] = ()
    warm_start_fresh: tuple[str, ...] = ()

    #: True when the training forward's logits are -inf outside each slot's candidates (``DraftOutput.sparse``:
    #: DFlash2 draws from its selector's top-k); only losses that declare ``reads_candidates`` train it.
    sparse_logits: bool = False

    #: True when no slot reads the tokens drafted before it (a block drafted in parallel, heads side by side):
    #: every slot's distribution then comes from one call (``position_logits``). What the slots depend on, which
    #: training reads too (on-policy rounds supervise every rejected slot, GRPO's credit); a family whose trees are
    #: best-first over those distributions declares ``tree_growth = TreeGrowth.BEST_FIRST`` as well.
    parallel_slots: bool = False

    def position_logits(self, state: Any, anchor: Tensor) -> Tensor:
        """For ``parallel_slots`` families: the draft logits (K, Vd) of every slot after ``anchor``, the ones
        ``propose`` draws from (and the training ``forward`` gives at that anchor)."""
        raise NotImplementedError(f"{type(self).__name__} sets parallel_slots but does not implement position_logits")

    def tree_start(self, state: Any, anchor: Tensor) -> tuple[Any, Tensor]:
        """For ``TreeGrowth.DYNAMIC`` families: slot 1 after ``anchor`` as a chain of one row, and its draft logits
        (1, Vd)."""
        raise NotImplementedError

    def tree_step(self, chain: Any, rows: Tensor, tokens: Tensor) -> tuple[Any, Tensor]:
        """Continue the chain's rows ``rows`` (A,) (a row may be taken several times) by one slot each on the draft
        indices ``tokens`` (A,): the new chain over A rows and their draft logits (A, Vd)."""
        raise NotImplementedError

    def adaptation_scopes(self) -> dict[str, list[str]]:
        """Deploy-time adaptation's update scopes (``adaptation.py``) as the submodules each trains:
        ``head``, the drafter's own output side after its last decoder layer (the final norm, an own LM head);
        ``last``, that layer and the final norm. ``all`` (every parameter) is implied; a scope left out does not
        apply to the family."""
        return {}

    @torch.no_grad()
    def propose_tree(
        self, state: Any, anchor: Tensor, sampling: SamplingConfig, tree: TreeConfig, generator=None
    ) -> TreeProposal:
        """A ``TreeProposal`` after ``anchor`` (``decoding/trees.py``): the best-first top-k tree over
        ``position_logits`` (``TreeGrowth.BEST_FIRST``) or EAGLE-2's dynamic tree (``DYNAMIC``), both over the draft
        distributions under ``sampling``. Its nodes are chosen, not drawn, so they are verified with the
        deterministic candidate rule (lossless under sampling as well). ``OWN`` families override this."""
        self.check_tree()

        def probs(logits: Tensor) -> Tensor:
            return tree_probs(logits, sampling)

        if self.tree_growth is TreeGrowth.BEST_FIRST:
            index, parents = best_first_tree(probs(self.position_logits(state, anchor)), tree)  # (T,), (T,)
        elif self.tree_growth is TreeGrowth.DYNAMIC:
            def start() -> tuple[Any, Tensor]:
                chain, logits = self.tree_start(state, anchor)
                return chain, probs(logits)

            def step(chain: Any, rows: Tensor, tokens: Tensor) -> tuple[Any, Tensor]:
                chain, logits = self.tree_step(chain, rows, tokens)
                return chain, probs(logits)

            depth = min(tree.depth or self.block_size, self.block_size)  # slots past K were never trained
            index, parents = dynamic_tree(start, step, depth, tree)
        else:
            raise NotImplementedError(f"{type(self).__name__} declares tree_growth={self.tree_growth.value} but does "
                                      "not override propose_tree")
        device = anchor.device
        return TreeProposal(tokens=self.vocab.to_target(index.to(device)), parents=parents.to(device))

    def adopt(self, state: Any, anchor: Tensor, proposal: Any) -> None:
        """The round verifies ``proposal`` instead of the tree this drafter proposed (n-gram nodes merged in,
        ``decoding.ngram.merge_into``: nodes dropped and renumbered). A drafter whose ``extend`` reads its own
        proposal's tokens by node index re-reads them from ``proposal`` here; the default reads none."""

    def extend(self, state: Any, features: Tensor, path: list[int]) -> None:
        """Commit a verified round: ``features`` (1, T, F) of the T verified nodes (the anchor first), ``path``
        the indices of the committed ones (the anchor and the accepted drafts, in order)."""
        raise NotImplementedError(f"{type(self).__name__} must implement extend")

    def config_dict(self) -> dict[str, Any]:
        """The init arguments that rebuild this drafter (stored in checkpoints and logged to MLflow): by default
        each one read back from the attribute of the same name (``init_arguments``)."""
        return init_arguments(self)


def _rename_old_vocab_keys(state_dict, prefix, *args) -> None:
    """Checkpoints written before ``DraftVocab`` hold ``vocab_ids``/``vocab_ready`` on the drafter itself."""
    for old, new in (("vocab_ids", "vocab.ids"), ("vocab_ready", "vocab.ready")):
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


# ------------------------------------------------------------------------------------------------- helpers
def anchor_seeds(run_seed: int, salt: int, index: Tensor) -> Tensor:
    """Per-example anchor seeds (N,) int64 from the run seed, a ``salt`` (the optimizer step in training, -1 in
    validation) and the examples' ``index`` (N,) in their split: a function of the example, never of its batch.
    Copies of one example in one optimizer step (domain-weighted sampling draws with replacement) share anchors."""
    base = ((run_seed * 1_000_003 + salt + 1) * 1_000_033) % 2**62
    return (index.to(torch.int64) + base) % 2**62


def with_anchor_seeds(batch: dict[str, Tensor], run_seed: int, salt: int) -> dict[str, Tensor]:
    """``batch`` plus ``anchor_seed`` (N,) from its examples' ``index`` (``anchor_seeds``); as it is without one."""
    return batch if "index" not in batch else {**batch, "anchor_seed": anchor_seeds(run_seed, salt, batch["index"])}


def drafter_record(drafter: Drafter, target_spec: str) -> dict[str, Any]:
    """What a checkpoint or an exported folder stores next to the drafter's weights: how to rebuild it (our class
    and its init arguments) and for which target (name, weights fingerprint, vocabulary size)."""
    return {
        "drafter_class": f"{type(drafter).__module__}.{type(drafter).__qualname__}",
        "drafter_config": drafter.config_dict(),
        "target": target_spec,
        "target_fingerprint": drafter.target.fingerprint,
        "target_vocab_size": drafter.target.vocab_size,
        "target_options": drafter.target.options.to_dict(),  # how to load it again: revision, remote code, ...
    }


def init_arguments(obj: Any) -> dict[str, Any]:
    """The arguments of ``type(obj).__init__`` read back from the object (each stored under its own name).

    Describing by the signature, not by ``vars(obj)``, is what makes ``build(describe(obj))`` rebuild ``obj``:
    attributes an object derives (a composite objective's parts) are not arguments it accepts."""
    args = {}
    for name, param in inspect.signature(type(obj).__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if not hasattr(obj, name):
            raise TypeError(
                f"{type(obj).__qualname__} does not keep its init argument {name!r} as an attribute, so it cannot be "
                "described for checkpoints and MLflow; store it as self." + name + "."
            )
        args[name] = getattr(obj, name)
    return args


def seeded_rand(seeds: Tensor, size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """(N,) int seeds -> (N, size) uniforms on the CPU, row i from its own generator seeded with ``seeds[i]``.

    CPU generators draw serially, so a row's first k values are the same whatever ``size`` is: a row draws the
    same values in a batch padded to any length, next to any neighbours, on any DDP rank.
    """
    out = torch.empty(len(seeds), size, dtype=dtype)
    for row, seed in zip(out, seeds.tolist()):
        row.uniform_(generator=torch.Generator().manual_seed(int(seed)))
    return out
