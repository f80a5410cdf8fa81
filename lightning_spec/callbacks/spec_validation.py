"""SpecDecodeValidation: real speculative decoding with the current drafter at every validation.

Training losses are a poor predictor of acceptance length (the most common complaint in this field), so
validation decodes held-out prompts of every domain with the live drafter and logs what a user cares about:
``val/mal``, ``val/mal/<domain>``, ``val/accept_rate/t<k>``, ``val/tokens_per_s`` and ``val/speedup`` over plain
decoding of the same prompts, measured in the same call. Extra sampling configs log under
``val/temp<T>/...``. Prompts are split across DDP ranks and the sums are reduced before any ratio is taken.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy

from lightning_spec.callbacks.base import EvaluationCallback, full_parameters
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.decoding.plans import Auto, Chain, Plain, parse_plan
from lightning_spec.decoding.timed import DecodeReport, decode_prompts
from lightning_spec.errors import UserError
from lightning_spec.metrics import acceptance_metrics, acceptance_sums, reduce_sums
from lightning_spec.sampling import SamplingConfig
from lightning_spec.tracking import tag_runs


class SpecDecodeValidation(EvaluationCallback):
    """Decode held-out prompts speculatively at every validation and log MAL, acceptance and speed.

    Args:
        prompts_per_domain: held-out prompts decoded per domain (taken from ``data.eval_prompts()``).
        max_new_tokens: generation budget per prompt.
        sampling: one or more sampling configs; the first logs under ``val/``, the others under ``val/temp<T>/``.
        measure_speedup: also decode the same prompts without the drafter (first sampling config only) and log
            ``val/speedup`` = speculative tokens/s ÷ plain tokens/s.
        before_training: evaluate once before the first optimizer step (logged at step 0).
        offline_before: with ``before_training``, score the untrained drafter with the exact offline evaluator instead
            of decoding with it: its weights are kept when training starts and scored after the first evaluation, on
            the answers that evaluation decoded (a greedy speculative answer is the target's greedy answer, and a
            sampled one a sample of the target's: speculative decoding is lossless), one target and one drafter
            forward per answer, no decoding. Greedy MAL is exact; a sampled one is the expectation over those
            samples. Still logged at step 0; on a drafter whose start is worth minutes of decoding, it costs seconds.
        print_summary: print a per-domain table of MAL before and after training when fit ends (and the MAL
            measured by ``lightning-spec validate``).
        seed: base seed; prompt i uses ``seed + i``.
        decoding: how the drafter decodes, a plan (``decoding/plans.py``): ``chain`` (the default), a mapping such
            as ``{kind: tree, nodes: 16, top_k: 4}`` or ``{kind: chain, stop_below: 0.2}``, or ``auto``: decode with
            the chain for ``val/mal``, and also, once training has started, with the plan decoding auto picks from
            measured costs (``decoding/auto/``: plain, n-gram lookup, the drafter's chains and trees),
            calibrated on ``calibration_prompts_per_domain`` other held-out prompts of every domain and picked over
            plain only when its speedup's lower confidence bound, on calibration prompts that did not choose it,
            beats plain by the plan's ``margin`` (``decoding.auto.decide``); those prompts decode with it (first
            sampling config) and log ``val/auto/...`` and ``val/auto/speedup``.
        calibration_prompts_per_domain: held-out prompts of every domain (not among the decoded ones) that
            ``decoding: auto`` calibrates on; the data needs ``eval_prompts_per_domain`` >= ``prompts_per_domain`` +
            this. Its lower bound is over all of them, so 2 per domain and 3 domains give 6.
    """

    name = "spec-validation"

    def __init__(
        self,
        prompts_per_domain: int = 4,
        max_new_tokens: int = 64,
        sampling: list[SamplingConfig] | None = None,
        measure_speedup: bool = True,
        before_training: bool = True,
        offline_before: bool = False,
        print_summary: bool = True,
        seed: int = 0,
        decoding: dict | str = "chain",
        calibration_prompts_per_domain: int = 2,
    ) -> None:
        if prompts_per_domain < 1 or max_new_tokens < 1:
            raise UserError("SpecDecodeValidation.prompts_per_domain and max_new_tokens must be >= 1.")
        plan = parse_plan(decoding)
        if calibration_prompts_per_domain < 1:
            raise UserError(f"SpecDecodeValidation.calibration_prompts_per_domain={calibration_prompts_per_domain} "
                            "must be >= 1; decoding auto needs 2 per domain or more for a lower bound worth having.")
        super().__init__(before_training)
        self.prompts_per_domain = prompts_per_domain
        self.max_new_tokens = max_new_tokens
        self.sampling = list(sampling) if sampling else [SamplingConfig()]
        self.measure_speedup = measure_speedup
        self.print_summary = print_summary
        self.seed = seed
        self.decoding = decoding  # as given (the YAML schema); ``plan`` is what it parses to
        self.plan = plan
        self.calibration_prompts_per_domain = calibration_prompts_per_domain
        self.choice: Any = None  # decoding auto's last pick (decoding/auto.Choice)
        self._table_due = False  # a fit or validate ended with something to print
        self._train_seconds: float | None = None  # what max_time's Timer had counted when training ended
        self.offline_before = offline_before
        self._initial: dict[str, torch.Tensor] | None = None  # the untrained drafter's weights, until scored

    @staticmethod
    def prefix(i: int, sampling: SamplingConfig) -> str:
        return "val" if i == 0 else f"val/temp{sampling.temperature:g}"

    def mal_prefixes(self) -> set[str]:
        return {f"{self.prefix(i, s)}/mal" for i, s in enumerate(self.sampling)}

    # ------------------------------------------------------------------------------------------ evaluation
    def _datamodule(self, trainer: L.Trainer) -> SpecDataModule:
        dm = trainer.datamodule
        if not isinstance(dm, SpecDataModule):  # plain dataloaders or another data module: no held-out prompts
            raise UserError("SpecDecodeValidation needs a datamodule with eval_prompts() (SpecDataModule).")
        return dm

    def _prompts(self, trainer: L.Trainer, calibration: bool = False) -> list[dict[str, Any]]:
        """The decoded prompts (``prompts_per_domain`` per domain), or the next ``calibration_prompts_per_domain`` of
        every domain, held out from the decoded ones (for ``decoding: auto``). The data module's prompts carry the
        target's chat-template arguments."""
        per_domain: dict[str, list[dict[str, Any]]] = {}
        for p in self._datamodule(trainer).eval_prompts():
            per_domain.setdefault(p["domain"], []).append(p)
        if not calibration:
            return [p for domain in sorted(per_domain) for p in per_domain[domain][: self.prompts_per_domain]]
        first, last = self.prompts_per_domain, self.prompts_per_domain + self.calibration_prompts_per_domain
        short = sorted(d for d, ps in per_domain.items() if len(ps) < last)
        if short:
            raise UserError(f"SpecDecodeValidation decoding: auto calibrates on calibration_prompts_per_domain="
                            f"{self.calibration_prompts_per_domain} held-out prompts per domain after the "
                            f"prompts_per_domain={first} decoded ones, and {', '.join(short)} has fewer; raise "
                            f"data.eval_prompts_per_domain to {last} or lower those two.")
        return [p for domain in sorted(per_domain) for p in per_domain[domain][first:last]]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Refuse before training, not after it, a plan the drafter cannot run and data that holds out too few prompts
        for ``decoding: auto``."""
        if not isinstance(self.plan, Auto):
            self.plan.resolve(pl_module.drafter)
        else:
            need = self.prompts_per_domain + self.calibration_prompts_per_domain
            if self._datamodule(trainer).eval_prompts_per_domain < need:
                raise UserError(f"SpecDecodeValidation decoding: auto decodes prompts_per_domain="
                                f"{self.prompts_per_domain} prompts per domain and calibrates on "
                                f"calibration_prompts_per_domain={self.calibration_prompts_per_domain} others; raise "
                                f"data.eval_prompts_per_domain to {need} or lower those two.")
        super().on_fit_start(trainer, pl_module)

    def evaluate(
        self, trainer: L.Trainer, module: L.LightningModule, before_training: bool = False
    ) -> dict[str, float]:
        """Decode the held-out prompts; after training has started, also without the drafter for the speedup (before
        it, an untrained drafter's speedup is not news, and it costs a full pass)."""
        prompts = self._prompts(trainer)
        domains = sorted({p["domain"] for p in prompts})
        # prompt i keeps seed + i whichever rank decodes it: DDP ranks measure what one process would
        mine = [dict(p, seed=self.seed + i) for i, p in enumerate(prompts)][trainer.global_rank :: trainer.world_size]
        was_training = module.drafter.training
        module.drafter.eval()
        metrics: dict[str, float] = {}
        reports = []
        try:
            with full_parameters(trainer):
                for i, sampling in enumerate(self.sampling):
                    report = decode_prompts(
                        module.target, module.drafter, mine, sampling, self.max_new_tokens,
                        measure_plain=not before_training and self.measure_speedup and i == 0,
                        plan=Chain() if isinstance(self.plan, Auto) else self.plan,
                    )
                    reports.append(report)
                    metrics.update(self._reduce(trainer, report, domains, self.prefix(i, sampling)))
                if isinstance(self.plan, Auto) and not before_training:
                    metrics.update(self._decode_auto(trainer, module, mine, domains, metrics))
                if self._initial is not None:
                    self._score_initial(trainer, module, reports, domains)
        finally:
            module.drafter.train(was_training)
        return metrics

    # ----------------------------------------------------------------------------- the drafter before training
    def measure_before_training(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Decode now, or (``offline_before``) keep the untrained weights to score after the first evaluation."""
        if not self.offline_before:
            return super().measure_before_training(trainer, module)
        if isinstance(trainer.strategy, FSDPStrategy):
            raise UserError("SpecDecodeValidation.offline_before keeps the untrained drafter's weights, which FSDP "
                            "shards; set offline_before: false under the fsdp strategy.")
        self._initial = {k: v.detach().clone() for k, v in module.drafter.state_dict().items()}

    def _score_initial(self, trainer: L.Trainer, module: L.LightningModule, reports: list[DecodeReport],
                       domains: list[str]) -> None:
        """The untrained drafter's exact offline MAL on the answers just decoded (``offline_before``), kept and
        published at step 0 as a decoded evaluation before training would have been."""
        from lightning_spec.data.rollouts import RolloutSet
        from lightning_spec.evaluation.offline import offline_report

        start = time.perf_counter()
        trained = {k: v.detach().clone() for k, v in module.drafter.state_dict().items()}
        module.drafter.load_state_dict(self._initial)
        metrics: dict[str, float] = {}
        try:
            for i, (sampling, report) in enumerate(zip(self.sampling, reports)):
                answers = [a for a in report.answers if a[1]]  # an answer of no token takes no round
                none = torch.zeros(module.drafter.block_size, dtype=torch.float64)
                sums = acceptance_sums({}, none, none, domains)  # a rank with no answer adds nothing
                if answers:
                    rollouts = RolloutSet([a[0] for a in answers], [a[1] for a in answers], [a[2] for a in answers],
                                          [str(j) for j in range(len(answers))], [True] * len(answers))
                    scored = offline_report(module.target, module.drafter, rollouts, sampling)
                    sums = acceptance_sums(scored.domain_sums(), scored.slot_accepted, scored.slot_reached, domains)
                sums = reduce_sums(trainer, sums)
                prefix = self.prefix(i, sampling)
                metrics.update(acceptance_metrics(sums, domains, f"{prefix}/mal", f"{prefix}/accept_rate"))
        finally:
            module.drafter.load_state_dict(trained)
            self._initial = None
        self.history.insert(0, (0, metrics))
        self.publish(trainer, metrics, 0)
        if trainer.is_global_zero:
            print(f"[{self.name}] step 0 (the untrained drafter, exact offline on these answers): "
                  f"{self.headline(metrics, time.perf_counter() - start)}", file=sys.stderr)

    def _decode_auto(self, trainer: L.Trainer, module: L.LightningModule, mine: list[dict[str, Any]],
                     domains: list[str], metrics: dict[str, float]) -> dict[str, float]:
        """Pick the fastest decoding on the calibration prompts (each rank measures its own machine), decode this
        rank's prompts with it under the first sampling config, and log ``val/auto/...``."""
        from lightning_spec.decoding.auto import choose_decoding

        sampling = self.sampling[0]
        calibration = [p["prompt_ids"] for p in self._prompts(trainer, calibration=True)]
        self.choice = choose_decoding(module.target, module.drafter, calibration, sampling, self.max_new_tokens,
                                      auto=self.plan)
        if trainer.is_global_zero:  # the pick, as a column runs are compared by (rank 0's machine)
            tag_runs(trainer.loggers, "decoding_auto", self.choice.plan.label)
        report = decode_prompts(self.choice.decoding_target(module.target), module.drafter, mine, sampling,
                                self.max_new_tokens, plan=self.choice.plan)
        out = self._reduce(trainer, report, domains, "val/auto")
        plain = metrics.get("val/plain_tokens_per_s")
        if self.plan.dtypes is not None:  # the speedup is over the fastest plain decoding auto found, in its dtype;
            # decided by the configuration, not by this rank's pick: every rank joins the reduction
            fastest = decode_prompts(module.target.cast(self.choice.plain_dtype or self.choice.dtype), None, mine,
                                     sampling, self.max_new_tokens, plan=Plain())
            plain = self._reduce(trainer, fastest, domains, "val/auto/plain")["val/auto/plain/tokens_per_s"]
            out["val/auto/plain/tokens_per_s"] = plain
        if plain is not None:
            out["val/auto/speedup"] = out["val/auto/tokens_per_s"] / plain
        module.drafter.use_target(module.target)  # training goes on with the target it trains against
        return out

    @staticmethod
    def _reduce(trainer: L.Trainer, report: DecodeReport, domains: list[str], prefix: str) -> dict[str, float]:
        """This rank's sums added over the ranks, then the ratios."""
        sums = acceptance_sums(report.domain_sums(), report.slot_accepted, report.slot_reached, domains)
        sums["speed"] = torch.tensor([report.seconds, report.plain_tokens, report.plain_seconds], dtype=torch.float64)
        sums = reduce_sums(trainer, sums)
        out = acceptance_metrics(sums, domains, mal=f"{prefix}/mal", accept_rate=f"{prefix}/accept_rate")
        tokens = float(sums["tokens"].sum())
        seconds, plain_tokens, plain_seconds = sums["speed"].tolist()
        # tokens/s per rank-second: ranks decode in parallel, so divide summed tokens by summed seconds
        out[f"{prefix}/tokens_per_s"] = tokens / max(seconds, 1e-9)
        if plain_seconds > 0:  # plain decoding ran (the first sampling config, after training started)
            out[f"{prefix}/plain_tokens_per_s"] = plain_tokens / plain_seconds
            out[f"{prefix}/speedup"] = out[f"{prefix}/tokens_per_s"] / out[f"{prefix}/plain_tokens_per_s"]
        return out

    def headline(self, metrics: dict[str, float], seconds: float) -> str:
        mals = ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.count("/") == 1 and "mal" in k)
        return f"{mals} ({seconds:.0f} s of decoding)"

    # --------------------------------------------------------------------------------------- the summary
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_seconds = training_seconds(trainer)  # before the evaluation below, which the budget never counts
        super().on_train_end(trainer, pl_module)  # evaluates the last steps if no validation did
        self._table_due = self.print_summary

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":  # ``lightning-spec validate``: the loop ran without fit
            self._table_due = self.print_summary

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Print the table last. Lightning's rich progress bar stays live until its own ``teardown``, which runs
        after this one when the bar comes later in ``trainer.callbacks`` (the CLI appends it); a table printed
        while the bar is live is followed by the bar's final frame (``Epoch 4/-2 ━━ 13/96 ...``). So stop the
        bar first, with its own hook; when Lightning calls that hook again the bar is already stopped and draws
        nothing (rich only ends piped output with an empty line)."""
        if not self._table_due:
            return
        self._table_due = False
        bar = trainer.progress_bar_callback
        if bar is not None:
            bar.teardown(trainer, pl_module, stage)
        if trainer.is_global_zero and self.history:
            before = self.history[0][1] if stage == "fit" and self.before_training and self.history[0][0] == 0 else None
            print_table(self.history[-1][1], before, self.sampling, self.choice,
                        offline_before=self.offline_before and before is not None)
            if stage == "fit":
                print(training_summary(trainer, self._train_seconds))


def print_table(after: dict[str, float], before: dict[str, float] | None, samplings: list[SamplingConfig],
                choice: Any = None, offline_before: bool = False) -> None:
    """Per-domain MAL table (rich), before/after training for every sampling config, the speedup, and decoding
    auto's pick with its expected and measured speed (``choice``)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Mean accepted length (tokens per target forward, bonus included)")
    table.add_column("domain")
    cols: list[tuple[str, str]] = []
    for i, sampling in enumerate(samplings):
        prefix = SpecDecodeValidation.prefix(i, sampling)
        name = "greedy" if sampling.greedy else f"T={sampling.temperature:g}"
        if before is not None:
            cols.append((f"{name} before", prefix))
        cols.append((f"{name} after" if before is not None else name, prefix))
    for title, _ in cols:
        table.add_column(title, justify="right")
    domains = sorted({k.split("/")[-1] for k in after if "/mal/" in k})
    for row in [*domains, "all"]:
        cells = []
        for title, prefix in cols:
            src = before if title.endswith("before") else after
            key = f"{prefix}/mal" if row == "all" else f"{prefix}/mal/{row}"
            cells.append(f"{src[key]:.3f}" if src is not None and key in src else "-")
        table.add_row(row, *cells)
    Console(file=sys.stdout).print(table)
    if offline_before:
        print("before: the untrained drafter scored exactly (offline) on the answers decoded after training")
    if "val/speedup" in after:
        print(
            f"speculative {after['val/tokens_per_s']:.1f} tok/s vs plain {after['val/plain_tokens_per_s']:.1f} tok/s "
            f"-> speedup {after['val/speedup']:.2f}x (greedy, same prompts, same process)"
        )
    if choice is not None and "val/auto/speedup" in after:
        print(f"{choice.describe(after['val/auto/speedup'], after['val/auto/tokens_per_s'])}, MAL "
              f"{after['val/auto/mal']:.3f} on the same prompts")


def _timer(trainer: L.Trainer) -> Any:
    from lightning.pytorch.callbacks import Timer

    return next((c for c in trainer.callbacks if isinstance(c, Timer)), None)


def training_seconds(trainer: L.Trainer) -> float | None:
    """The training time ``trainer.max_time``'s Timer has counted so far (None without a Timer). Read it when
    training ends and before any evaluation there: the Timer stops its clock only in its own ``on_train_end``, which
    may run after a callback's, so reading it later counts that callback's decoding as training."""
    timer = _timer(trainer)
    return timer.time_elapsed("train") if timer is not None else None


def training_summary(trainer: L.Trainer, seconds: float | None = None) -> str:
    """One line: the optimizer steps the fit reached, in how much training time (``seconds``: the Timer's count when
    training ended, see ``training_seconds``), and which budget ended it (runs compare at equal steps; a time budget
    buys a machine-dependent number of them)."""
    timer = _timer(trainer)
    spent = f" in {seconds:.0f} s of training" if seconds is not None else ""
    limit = trainer.max_steps
    if limit is not None and limit > 0 and trainer.global_step >= limit:
        why = f"trainer.max_steps={limit} reached"
    elif timer is not None and timer.time_remaining("train") is not None and timer.time_remaining("train") <= 0:
        why = f"trainer.max_time ended it before max_steps={limit}" if limit and limit > 0 else "trainer.max_time"
    else:
        why = "the epochs ended" if trainer.max_epochs else "stopped"
    return f"training: {trainer.global_step} optimizer steps{spent} ({why}; decoding before and after not counted)"
