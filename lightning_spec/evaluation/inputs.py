"""What an evaluation reads, opened once at the edge: the target, the drafters, the rollouts, the prompts.

The evaluators (``offline_report``, ``OnlineRun``) take loaded objects: a ``Target``, a drafter bound to it, a
``RolloutSet`` (or rollouts already in memory). The places that start from paths (``lightning-spec evaluate``, the
``OfflineEvaluation`` callback, the benchmarks) open them here, with the same checks everywhere: rollouts are
refused when they were drawn from another target or under another sampling config, and cut to ``max_rollouts``
by ``spread`` (round-robin over domains).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import datasets

from lightning_spec.data.rollouts import RolloutSet, check_rollouts, load_rollout_set, rollout_sampling, spread
from lightning_spec.decoding.ngram import from_name
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig
from lightning_spec.target import TargetOptions

if TYPE_CHECKING:
    from lightning_spec.target import Target

#: rollouts in memory: a ``RolloutSet`` (``load_rollout_set`` of a folder), a ``datasets.Dataset`` with the rollouts
#: columns, or a list of ``(prompt_ids, response_ids)`` pairs (or dicts with those keys)
Rollouts = RolloutSet | datasets.Dataset | Sequence[Any]

# what an evaluator takes for each input, and how a path is loaded into it (the refusal's sentence)
_LOADED = {
    "target": ("a loaded Target", "load_target({path!r})"),
    "drafter": ("a loaded drafter", "load_drafter({path!r}, target=target)"),
    "rollouts": ("loaded rollouts", "load_rollout_set({path!r}) (lightning_spec.data.rollouts)"),
}


def refuse_paths(caller: str, **inputs: Any) -> None:
    """Refuse, in one sentence, an input given as a path where ``caller`` takes a loaded object."""
    for name, value in inputs.items():
        if isinstance(value, (str, os.PathLike)):
            what, loader = _LOADED.get(name, (f"a loaded {name}", "the loaded object"))
            raise UserError(f"{caller} takes {what}, not the path {str(value)!r}; pass "
                            f"{loader.format(path=str(value))} instead.")


def open_rollouts(
    rollouts: str | os.PathLike | Rollouts,
    target: Target,
    sampling: SamplingConfig | None = None,
    max_rollouts: int | None = None,
    sampling_name: str = "sampling",
) -> tuple[RolloutSet, SamplingConfig]:
    """The rollouts checked against ``target`` and their sampling config, cut to ``max_rollouts``.

    ``rollouts`` is a rollouts folder or rollouts in memory (``Rollouts``); token ids beyond the target's vocabulary
    are refused for rollouts without metadata. ``sampling`` is the config they were drawn under, None for the one
    the folder records (rollouts recording none need it: ``sampling_name`` is how the caller's user passes it). A
    folder drawn from another target or under another config is refused (``check_rollouts``)."""
    data = load_rollout_set(rollouts, vocab_size=target.vocab_size)
    sampling = sampling or rollout_sampling(data.meta)
    if sampling is None:
        where = f"the rollouts in {data.source}" if data.source else "the rollouts"
        raise UserError(f"offline evaluation needs sampling: {where} record no sampling config; pass "
                        f"{sampling_name}, the config they were drawn under.")
    check_rollouts(data.meta, target, sampling, data.source)
    return spread(data, max_rollouts), sampling


# -------------------------------------------------------------------------------------------------- target
@dataclass(frozen=True)
class TargetLoad:
    """How the edge loads the target (``load_target``): dtype, device, and the options to load and prompt it with
    (None: those the first drafter's target was trained with)."""

    dtype: str = "float32"
    device: str = "cpu"
    options: TargetOptions | None = None


def recorded_target(checkpoint: str) -> tuple[str, TargetOptions]:
    """The target a checkpoint or exported drafter folder was trained for, and its options (read as data)."""
    from lightning_spec.checkpoint import recorded_target as read

    return read(checkpoint, what="--drafters entry")


def open_target(spec: str | None, checkpoint: str | None, how: TargetLoad) -> tuple[str, Target]:
    """(spec, the loaded target): ``spec``, else the target ``checkpoint`` was trained for, loaded with ``how``'s
    options, else the options recorded with ``checkpoint`` (None: no trained drafter, n-gram lookup alone)."""
    from lightning_spec.target_loading import load_target

    options = how.options
    if checkpoint is None and spec is None:
        raise UserError("--target is needed: n-gram lookup ('ngram') records no target; name it, e.g. "
                        "--target smollm2-135m-instruct.")
    if checkpoint is not None and (spec is None or options is None):
        recorded, recorded_options = recorded_target(checkpoint)
        spec, options = spec or recorded, options or recorded_options
    return spec, load_target(spec, dtype=how.dtype, device=how.device, options=options)


def open_drafter(entry: str, target: Target) -> Any:
    """One ``--drafters`` entry loaded for ``target``: n-gram lookup (``ngram``, ``ngram:K``; ``decoding/ngram.py``),
    else a fit checkpoint or exported folder (``load_drafter``)."""
    from lightning_spec.checkpoint import load_drafter

    ngram = from_name(entry)
    return ngram if ngram is not None else load_drafter(entry, target=target)


def trained_checkpoint(entries: Sequence[str]) -> str | None:
    """The first entry that is a checkpoint, whose target and options are the defaults (None: n-gram lookup only)."""
    return next((e for e in entries if from_name(e) is None), None)


# ------------------------------------------------------------------------------------------------- prompts
def open_prompts(target: Target, spec: str, sources: list[str], per_source: int, seed: int) -> list[dict[str, Any]]:
    """The chat prompts of online evaluation: ``per_source`` from every source (as ``lightning-spec rollouts``
    selects them), templated with the target's tokenizer and chat-template arguments."""
    from lightning_spec.data.prompts import select_prompts
    from lightning_spec.data.sources import as_source

    if target.tokenizer is None:
        raise UserError(f"--target {spec} has no tokenizer; online evaluation builds chat prompts with it.")
    return select_prompts(target.tokenizer, [as_source(s) for s in sources], per_source, seed,
                          chat_template_kwargs=target.chat_template_kwargs)


def calibration_prompts(target: Target, sources: list[str], per_source: int, seed: int,
                        used: list[dict[str, Any]], per_domain: int = 2) -> list[list[int]]:
    """Held-out prompts for decoding auto, ``per_domain`` of every domain: the prompts after the first ``per_source``
    of every source, selected and templated as ``open_prompts`` does (the target's chat-template arguments
    included), none of ``used``. A domain whose source has none left is refused in one sentence."""
    from lightning_spec.data.prompts import select_prompts
    from lightning_spec.data.sources import as_source

    taken = {p["id"] for p in used}
    more = select_prompts(target.tokenizer, [as_source(s) for s in sources], per_source + per_domain, seed,
                          chat_template_kwargs=target.chat_template_kwargs)
    held_out: dict[str, list[list[int]]] = {}
    for p in more:
        if p["id"] not in taken:
            held_out.setdefault(p["domain"], []).append(p["prompt_ids"])
    empty = sorted({p["domain"] for p in more} - set(held_out))
    if empty:
        raise UserError(f"decoding auto calibrates on prompts beyond --prompts_per_source and the {', '.join(empty)} "
                        "prompts have none left; lower --prompts_per_source.")
    return [ids for domain in sorted(held_out) for ids in held_out[domain][:per_domain]]
