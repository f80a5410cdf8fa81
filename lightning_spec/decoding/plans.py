"""How to decode, as one value: a plan.

Every way a prompt can be decoded is a small frozen dataclass registered here under its ``kind``: plain decoding, the
drafter's chain (all K slots, fewer, or stopping where the drafter's confidence falls), one of its token trees (with
n-gram nodes or not, stopping at a path value or not), n-gram lookup, ``auto`` (decoding auto's choice among the
others, ``decoding/auto/``) and ``adapt`` (a drafter that updates itself while it decodes, ``adaptation.py``).
``generate(..., plan=...)`` runs one; ``parse_plan`` reads one from YAML or a command line (``decoding: {kind: tree,
nodes: 16, top_k: 4, ngram: 2}``, or just ``decoding: chain``) and refuses a bad one in one sentence. A plan says
what to run; the drafter is given beside it, and ``resolve`` turns the two into what the engine runs: the proposer,
the tree (None: a chain) and the chain's length.

Adding a mode is one class here (or in a file of its own that registers it), its tests, and nothing else:
docs/trees.md, "Adding a decoding mode".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from lightning_spec.decoding.ngram import NgramDrafter
from lightning_spec.decoding.proposer import Proposer, TreeGrowth
from lightning_spec.decoding.trees import TreeConfig
from lightning_spec.errors import UserError

PLANS: dict[str, type[Plan]] = {}  # kind -> class, in registration order


def register(cls: type[Plan]) -> type[Plan]:
    """Register a plan class under its ``kind`` (a class decorator)."""
    if cls.kind in PLANS:
        raise ValueError(f"decoding plan kind {cls.kind!r} is registered twice.")
    PLANS[cls.kind] = cls
    return cls


@dataclass(frozen=True)
class Run:
    """What the engine runs for a plan and a drafter: the proposer (None: plain), the tree (None: a chain), and the
    most draft tokens of a chain (None: the proposer's own K)."""

    proposer: Proposer | None
    tree: TreeConfig | None = None
    length: int | None = None


@dataclass(frozen=True)
class Plan:
    """A way to decode. Subclasses are frozen dataclasses whose fields are the mode's options."""

    kind: ClassVar[str] = ""

    @property
    def verifies_tree(self) -> bool:
        """Whether its rounds verify under a tree mask (what a verify forward costs depends on it)."""
        return False

    @property
    def label(self) -> str:
        """A short human name (tables, MLflow tags)."""
        return self.kind

    def resolve(self, drafter: Proposer | None) -> Run:
        """What the engine runs for this plan with ``drafter``; a plan the drafter cannot run is refused here, in
        one sentence."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """The plan as YAML writes it: its kind and the fields that differ from the defaults."""
        mine, default = dataclasses.asdict(self), dataclasses.asdict(type(self)())
        return {"kind": self.kind, **{name: value for name, value in mine.items() if value != default[name]}}


def _needs(plan: Plan, drafter: Proposer | None) -> Proposer:
    if drafter is None:
        raise UserError(f"decoding {plan.kind!r} drafts with a drafter, and none was given; pass drafter=..., or "
                        "decode with kind plain or ngram.")
    return drafter


def _positive(plan: Plan, name: str, value: Any, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"decoding.{name} must be an int >= 1{' or null' if allow_none else ''} for kind "
                        f"{plan.kind!r}, got {value!r}.")


@register
@dataclass(frozen=True)
class Plain(Plan):
    """One token per target forward, no drafter (the baseline every speedup is measured against)."""

    kind: ClassVar[str] = "plain"

    def resolve(self, drafter: Proposer | None) -> Run:
        return Run(None)


@register
@dataclass(frozen=True)
class Chain(Plan):
    """The drafter's chain.

    Args:
        length: the most draft tokens a round verifies (<= the drafter's K); null: all K.
        stop_below: stop the chain at the first slot where the drafter's running confidence (the product of its
            draft probabilities along the chain) falls below this; 0: never. Needs a family that grows trees
            best-first or dynamically: the chain is then their tree with one child per node
            (``TreeConfig(top_k=1, stop_below=...)``), and a dynamic drafter (EAGLE-3, MTP) runs no slot past the
            stop.
    """

    kind: ClassVar[str] = "chain"
    length: int | None = None
    stop_below: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "length", self.length, allow_none=True)
        TreeConfig(nodes=1, top_k=1, stop_below=self.stop_below)  # the same check, named tree.stop_below

    @property
    def verifies_tree(self) -> bool:
        return bool(self.stop_below)

    @property
    def label(self) -> str:
        parts = [f"K={self.length}" if self.length else "", f"stop<{self.stop_below:g}" if self.stop_below else ""]
        return " ".join(["chain", *filter(None, parts)])

    def resolve(self, drafter: Proposer | None) -> Run:
        drafter = _needs(self, drafter)
        k = min(self.length or drafter.block_size, drafter.block_size)
        if not self.stop_below:
            return Run(drafter, None, k if k < drafter.block_size else None)  # None: the whole chain, uncut
        if drafter.tree_growth not in (TreeGrowth.BEST_FIRST, TreeGrowth.DYNAMIC):
            raise UserError(f"decoding.stop_below needs a drafter whose chain is its one-child tree (tree growth "
                            f"best_first or dynamic); {type(drafter).__name__} grows "
                            f"{drafter.tree_growth.value}: decode it with stop_below 0.")
        return Run(drafter, TreeConfig(nodes=k, top_k=1, depth=k, stop_below=self.stop_below))


@register
@dataclass(frozen=True)
class Tree(TreeConfig, Plan):
    """One of the drafter's token trees per round, verified in one forward (``decoding/trees.py``): its fields and
    their checks are ``TreeConfig``'s."""

    kind: ClassVar[str] = "tree"

    @property
    def verifies_tree(self) -> bool:
        return True

    @property
    def config(self) -> TreeConfig:
        """The plain ``TreeConfig`` the engine and the tree builders take."""
        return TreeConfig(**dataclasses.asdict(self))

    @classmethod
    def of(cls, config: TreeConfig) -> Tree:
        return cls(**dataclasses.asdict(config))

    @property
    def label(self) -> str:
        extra = f" + {self.ngram} n-gram" if self.ngram else ""
        stop = f" stop<{self.stop_below:g}" if self.stop_below else ""
        return f"tree {self.nodes}/top {self.top_k}{extra}{stop}"

    def resolve(self, drafter: Proposer | None) -> Run:
        drafter = _needs(self, drafter)
        if self.stop_below and drafter.tree_growth not in (TreeGrowth.BEST_FIRST, TreeGrowth.DYNAMIC):
            raise UserError(f"decoding.stop_below applies to trees grown best-first or dynamically; "
                            f"{type(drafter).__name__} grows {drafter.tree_growth.value}: decode it with stop_below 0.")
        return Run(drafter, self.config)


@register
@dataclass(frozen=True)
class Ngram(Plan):
    """Prompt-and-output lookup (``decoding/ngram.py``), no drafter: a chain of up to ``length`` tokens, or with
    ``nodes`` a trie of up to ``top_k`` continuations."""

    kind: ClassVar[str] = "ngram"
    length: int = 10
    nodes: int | None = None
    top_k: int = 4

    def __post_init__(self) -> None:
        _positive(self, "length", self.length)
        _positive(self, "nodes", self.nodes, allow_none=True)
        _positive(self, "top_k", self.top_k)

    @property
    def verifies_tree(self) -> bool:
        return self.nodes is not None

    @property
    def label(self) -> str:
        if self.nodes is None:
            return f"n-gram (K={self.length}) chain"
        return f"n-gram (K={self.length}) tree {self.nodes}/top {self.top_k}"

    def resolve(self, drafter: Proposer | None) -> Run:
        tree = None if self.nodes is None else TreeConfig(nodes=self.nodes, top_k=self.top_k)
        return Run(NgramDrafter(block_size=self.length), tree)


DTYPES = ("float32", "bfloat16", "float16")  # what decoding auto may cast the target to (``Auto.dtypes``)


def check_dtypes(dtypes: Any) -> None:
    """Refuse ``decoding.dtypes`` other than None, ``"native"`` or a non-empty list of ``DTYPES``."""
    if dtypes is None or dtypes == "native":
        return
    names = (dtypes,) if isinstance(dtypes, str) else dtypes
    if not isinstance(names, (tuple, list)) or not names or any(n not in DTYPES for n in names):
        raise UserError(f"decoding.dtypes must be 'native' (the dtypes this device multiplies natively) or a list of "
                        f"{', '.join(DTYPES)}, got {dtypes!r}.")


@register
@dataclass(frozen=True)
class Auto(Plan):
    """Decoding auto: the plan, among plain, n-gram lookup and the drafter's chains and trees, that is expected
    fastest on this machine and sure enough to beat plain decoding by ``margin`` (``decoding/auto/``). It is
    resolved on calibration prompts (``choose_decoding``), never run directly."""

    kind: ClassVar[str] = "auto"
    margin: float = 0.05
    dtypes: str | tuple[str, ...] | None = None  # the target's dtypes searched: None its own, "native", or names

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or self.margin < 0:
            raise UserError(f"decoding.margin must be a number >= 0 (how far decoding auto's lower bound must beat "
                            f"plain decoding), got {self.margin!r}.")
        if isinstance(self.dtypes, list):  # from YAML: a tuple keeps the plan hashable
            object.__setattr__(self, "dtypes", tuple(self.dtypes))
        check_dtypes(self.dtypes)

    def resolve(self, drafter: Proposer | None) -> Run:
        raise UserError("decoding 'auto' is chosen on calibration prompts first: call "
                        "lightning_spec.decoding.auto.choose_decoding(target, drafter, prompts) and decode with "
                        "its .plan.")


SCOPES = ("head", "last", "all")  # what an adapting drafter may update (adaptation.py, scope_parameters)


@register
@dataclass(frozen=True)
class Adapt(Plan):
    """A drafter that adapts while it decodes (``adaptation.py``; SpecBlock, arXiv 2605.07243): after each
    prompt it may update itself on the tokens the target verified, when a bandit over update scopes expects the
    time saved to beat the update's measured cost; its update time counts in its tokens/s. It decodes with its own
    copy of the drafter (``CostAwareAdapter``), never through ``generate`` alone.

    Args:
        decoding: how it decodes between updates: ``chain`` (all K slots) or a ``tree`` plan.
        scopes: the update scopes it chooses among: ``head`` (the drafter's output norm and heads), ``last`` (its last
            decoder layer and final norm), ``all``; a scope the family has no parameters for is skipped.
        lr: the update's learning rate.
        steps: optimizer steps per update.
        horizon_tokens: H, the tokens over which an update's MAL gain is expected to pay.
        exploration: the UCB constant c, in MAL units.
        force: apply this scope after every prompt whatever the rule (``none``: never update); still measured.
        optimizer: ``adamw`` or ``sgd``; one per scope, its state kept across prompts.
        weight_decay: the optimizer's weight decay.
        max_grad_norm: clip the update's gradient norm (null: no clipping).
        ema: the weight of the newest observation in the running estimates (gain, cost, MAL, seconds per round).
        score_chunk: anchors per drafter forward when it scores a window (memory, not results).
    """

    kind: ClassVar[str] = "adapt"
    decoding: Plan = Chain()
    scopes: tuple[str, ...] = SCOPES
    lr: float = 1e-4
    steps: int = 2
    horizon_tokens: float = 4096
    exploration: float = 0.1
    force: str | None = None
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    ema: float = 0.3
    score_chunk: int = 64

    def __post_init__(self) -> None:
        inner = parse_plan(self.decoding)
        if not (inner == Chain() or (isinstance(inner, Tree) and not inner.stop_below)):
            raise UserError(f"decoding.decoding of kind 'adapt' must be a full chain (kind chain) or a tree without "
                            f"stop_below, the rounds the adapter scores exactly; got {inner.to_dict()}.")
        object.__setattr__(self, "decoding", inner)
        if isinstance(self.scopes, list):
            object.__setattr__(self, "scopes", tuple(self.scopes))
        checks = [  # (holds, field, its value, what it must be)
            (_is_number(self.lr) and math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "a number > 0"),
            (_is_int(self.steps) and self.steps >= 1, "steps", self.steps, "an int >= 1"),
            (self.optimizer in ("adamw", "sgd"), "optimizer", self.optimizer, "adamw or sgd"),
            (_is_number(self.horizon_tokens) and self.horizon_tokens > 0, "horizon_tokens", self.horizon_tokens,
             "a number > 0"),
            (_is_number(self.exploration) and self.exploration >= 0, "exploration", self.exploration, "a number >= 0"),
            (_is_number(self.ema) and 0 < self.ema <= 1, "ema", self.ema, "a weight in (0, 1]"),
            (_is_int(self.score_chunk) and self.score_chunk >= 1, "score_chunk", self.score_chunk, "an int >= 1"),
            (isinstance(self.scopes, tuple) and bool(self.scopes) and set(self.scopes) <= set(SCOPES), "scopes",
             self.scopes, f"a non-empty list from {', '.join(SCOPES)}"),
            (self.force in (None, "none", *SCOPES), "force", self.force, f"null, none or one of {', '.join(SCOPES)}"),
        ]
        for ok, name, value, wanted in checks:
            if not ok:
                raise UserError(f"decoding.{name} of kind 'adapt' must be {wanted}, got {value!r}.")

    @property
    def verifies_tree(self) -> bool:
        return self.decoding.verifies_tree

    @property
    def label(self) -> str:
        return f"adapt ({self.decoding.label})"

    def to_dict(self) -> dict[str, Any]:
        mine, default = dataclasses.asdict(self), dataclasses.asdict(Adapt())
        changed = {name: list(v) if isinstance(v, tuple) else v for name, v in mine.items()
                   if name != "decoding" and v != default[name]}
        return {"kind": self.kind, "decoding": self.decoding.to_dict(), **changed}

    def resolve(self, drafter: Proposer | None) -> Run:
        raise UserError("decoding 'adapt' changes its drafter as it decodes: decode with "
                        "lightning_spec.adaptation.CostAwareAdapter(drafter, target, plan), or give the plan "
                        "to lightning-spec evaluate --mode online.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_plan(value: Plan | TreeConfig | dict | str | None, default: str = "chain") -> Plan:
    """A plan from a ``Plan``, a ``TreeConfig`` (that tree of the drafter's), a dict (``{kind: tree, nodes: 16}``), a
    kind's name (``"chain"``) or None (the ``default`` kind). Anything else, an unknown kind or an unknown field is
    one sentence naming the fix."""
    if isinstance(value, Plan):
        return value
    if isinstance(value, TreeConfig):
        return Tree.of(value)
    if value is None:
        value = default
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict):
        raise UserError(f"decoding must be a kind ({', '.join(PLANS)}) or a mapping with a kind, got {value!r}.")
    fields = dict(value)
    kind = fields.pop("kind", None)
    if kind not in PLANS:
        raise UserError(f"decoding.kind must be one of {', '.join(PLANS)}, got {kind!r}.")
    cls = PLANS[kind]
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        has = f"its fields are {', '.join(known)}" if known else "it has no fields"
        raise UserError(f"decoding kind {kind!r} has no field {unknown[0]!r}; {has}.")
    return cls(**fields)
