"""SpecDecodeValidation: real speculative decoding with the current drafter at every validation.

Training losses are a poor predictor of acceptance length (the most common complaint in this field), so
validation decodes held-out prompts of every domain with the live drafter and logs what a user cares about:
``val/mal``, ``val/mal/<domain>``, ``val/accept_rate/t<k>``, ``val/tokens_per_s`` and ``val/speedup`` over plain
decoding of the same prompts, measured in the same call. Extra sampling configs log under
``val/temp<T>/...``. Prompts are split across DDP ranks and the sums are reduced before any ratio is taken.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy

from lightning_spec.evaluation.benchmark import DecodeReport, decode_prompts
from lightning_spec.metrics import MeanAcceptedLength
from lightning_spec.sampling import SamplingConfig


class SpecDecodeValidation(Callback):
    """Decode held-out prompts speculatively at every validation and log MAL, acceptance and speed.

    Args:
        prompts_per_domain: held-out prompts decoded per domain (taken from ``data.eval_prompts()``).
        max_new_tokens: generation budget per prompt.
        sampling: one or more sampling configs; the first logs under ``val/``, the others under ``val/temp<T>/``.
        measure_speedup: also decode the same prompts without the drafter (first sampling config only) and log
            ``val/speedup`` = speculative tokens/s ÷ plain tokens/s.
        before_training: evaluate once before the first optimizer step (logged at step 0).
        print_summary: print a per-domain table of MAL before and after training when fit ends.
        seed: base seed; prompt i uses ``seed + i``.
    """

    def __init__(
        self,
        prompts_per_domain: int = 4,
        max_new_tokens: int = 64,
        sampling: list[SamplingConfig] | None = None,
        measure_speedup: bool = True,
        before_training: bool = True,
        print_summary: bool = True,
        seed: int = 0,
    ) -> None:
        if prompts_per_domain < 1 or max_new_tokens < 1:
            raise ValueError("SpecDecodeValidation.prompts_per_domain and max_new_tokens must be >= 1.")
        self.prompts_per_domain = prompts_per_domain
        self.max_new_tokens = max_new_tokens
        self.sampling = list(sampling) if sampling else [SamplingConfig()]
        self.measure_speedup = measure_speedup
        self.before_training = before_training
        self.print_summary = print_summary
        self.seed = seed
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, metrics) of every evaluation

    # ------------------------------------------------------------------------------------------- helpers
    def _prompts(self, trainer: L.Trainer) -> list[dict[str, Any]]:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "eval_prompts"):
            raise ValueError("SpecDecodeValidation needs a datamodule with eval_prompts() (SpecDataModule).")
        per_domain: dict[str, list[dict[str, Any]]] = {}
        for p in dm.eval_prompts():
            bucket = per_domain.setdefault(p["domain"], [])
            if len(bucket) < self.prompts_per_domain:
                bucket.append(p)
        return [p for domain in sorted(per_domain) for p in per_domain[domain]]

    @staticmethod
    def prefix(i: int, sampling: SamplingConfig) -> str:
        return "val" if i == 0 else f"val/temp{sampling.temperature:g}"

    def evaluate(self, trainer: L.Trainer, module: L.LightningModule, plain: bool = True) -> dict[str, float]:
        """Decode the held-out prompts; ``plain`` also decodes them without the drafter for the speedup."""
        start = time.perf_counter()
        prompts = self._prompts(trainer)
        domains = sorted({p["domain"] for p in prompts})
        # prompt i keeps seed + i whichever rank decodes it: DDP ranks measure what one process would
        mine = [dict(p, seed=self.seed + i) for i, p in enumerate(prompts)][trainer.global_rank :: trainer.world_size]
        was_training = module.drafter.training
        module.drafter.eval()
        metrics: dict[str, float] = {}
        try:
            with full_parameters(trainer):
                for i, sampling in enumerate(self.sampling):
                    report = decode_prompts(
                        module.target, module.drafter, mine, sampling, self.max_new_tokens,
                        measure_plain=plain and self.measure_speedup and i == 0,
                    )
                    metrics.update(self._reduce(trainer, module, report, domains, self.prefix(i, sampling)))
        finally:
            module.drafter.train(was_training)
        self._seconds = time.perf_counter() - start
        return metrics

    def _reduce(self, trainer, module, report: DecodeReport, domains: list[str], prefix: str) -> dict[str, float]:
        device = module.device
        out: dict[str, float] = {}
        report.mal.to(device)
        report.slots.to(device)
        out[f"{prefix}/mal"] = float(report.mal.compute())
        for domain in domains:  # every rank builds every domain's metric so the all-reduce lines up
            metric = report.mal_by_domain.get(domain)
            if metric is None:
                metric = MeanAcceptedLength()
            out[f"{prefix}/mal/{domain}"] = float(metric.to(device).compute())
        for k, rate in enumerate(report.slots.compute().tolist(), start=1):
            out[f"{prefix}/accept_rate/t{k}"] = rate
        sums = torch.tensor(
            [report.tokens, report.seconds, report.plain_tokens, report.plain_seconds], dtype=torch.float64,
            device=device,
        )
        if trainer.world_size > 1:
            sums = trainer.strategy.reduce(sums, reduce_op="sum")
        tokens, seconds, plain_tokens, plain_seconds = sums.tolist()
        # tokens/s per rank-second: ranks decode in parallel, so divide summed tokens by summed seconds
        out[f"{prefix}/tokens_per_s"] = tokens / max(seconds, 1e-9)
        if plain_seconds > 0:
            out[f"{prefix}/plain_tokens_per_s"] = plain_tokens / plain_seconds
            out[f"{prefix}/speedup"] = (tokens / max(seconds, 1e-9)) / (plain_tokens / plain_seconds)
        return out

    def _log(self, trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
        self.history.append((step, metrics))
        publish(trainer, metrics, step)
        if trainer.is_global_zero:
            head = ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.count("/") == 1 and "mal" in k)
            took = getattr(self, "_seconds", 0.0)
            print(f"[spec-validation] step {step}: {head} ({took:.0f} s of decoding)", file=sys.stderr)

    # --------------------------------------------------------------------------------------------- hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.before_training and trainer.global_step == 0:
            # no plain decoding here: an untrained drafter's speedup is not news, and it costs a full pass
            self._log(trainer, self.evaluate(trainer, pl_module, plain=False), step=0)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._log(trainer, self.evaluate(trainer, pl_module), step=trainer.global_step)

    def on_validate_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """``lightning-spec validate``: the validation loop ran without fit, so print what it measured."""
        if trainer.state.fn == "validate" and self.print_summary and trainer.is_global_zero and self.history:
            print_table(self.history[-1][1], None, self.sampling)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if last_step(self.history) != trainer.global_step:  # the last steps were never validated
            self._log(trainer, self.evaluate(trainer, pl_module), step=trainer.global_step)
        if self.print_summary and trainer.is_global_zero and self.history:
            before = self.history[0][1] if self.before_training and self.history[0][0] == 0 else None
            print_table(self.history[-1][1], before, self.sampling)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))


def last_step(history: list[tuple[int, dict[str, float]]]) -> int | None:
    """The step of a validation callback's last evaluation (None before the first)."""
    return history[-1][0] if history else None


def publish(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
    """Metrics measured outside Lightning's logging (decoding, offline scoring): into ``trainer.callback_metrics``
    on every rank (what checkpoints, other callbacks and a sweep's reporter read), and into every logger at
    ``step`` on rank 0 (the values are already reduced over ranks)."""
    for key, value in metrics.items():
        trainer.callback_metrics[key] = torch.tensor(value)
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def full_parameters(trainer: L.Trainer) -> contextlib.AbstractContextManager:
    """Decoding needs whole weights: under FSDP each rank holds a shard of the drafter between steps, so gather
    them for the duration (every rank enters together; decoding then runs on plain modules, never inside an FSDP
    forward, which is why the FSDP example wraps no drafter layer on its own). Elsewhere: nothing to do."""
    if not isinstance(trainer.strategy, FSDPStrategy):
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False)


def print_table(after: dict[str, float], before: dict[str, float] | None, samplings: list[SamplingConfig]) -> None:
    """Per-domain MAL table (rich), before/after training for every sampling config."""
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
    if "val/speedup" in after:
        print(
            f"speculative {after['val/tokens_per_s']:.1f} tok/s vs plain {after['val/plain_tokens_per_s']:.1f} tok/s "
            f"-> speedup {after['val/speedup']:.2f}x (greedy, same prompts, same process)"
        )
