"""DraftModule: target + drafter + objective, one ``training_step`` for every method: a batch's target features,
the anchors, the drafter's forward over them, the objective's ``(num, den)``, one reduction.

Reduction. The objective returns ``LossTerms(num, den)``: we back-propagate each micro-batch's *numerator* and,
before the optimizer step, divide the gradients by the global Σ den (over the accumulation window and the DDP ranks),
so batch 8 x accumulation 1, batch 1 x accumulation 8 and 2 ranks x batch 4 give the same gradient.

Determinism across batch layouts. Anchors are drawn per example from a seed of (run seed, optimizer step, example
index) (``anchor_seeds``), never the global RNG: an example gets the same anchors in whichever batch, DDP rank or
resumed process it lands (tests/integration/test_ddp.py, test_resume.py). Logged metrics are the global batch's.

Checkpoints hold the drafter only, with what a resumed fit needs (``checkpoint/fit.py``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor

from lightning_spec.checkpoint import build, describe, init_weights
from lightning_spec.checkpoint.fit import read_fit_state, write_fit_state
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.drafters.base import Drafter, DraftOutput, with_anchor_seeds
from lightning_spec.errors import DivergedLoss
from lightning_spec.features.source import FeatureSource, check_feature_options
from lightning_spec.metrics import RatioOfSums, global_totals, sum_over_ranks
from lightning_spec.objectives.context import ReferenceDrafter, StepContext, slot_hidden
from lightning_spec.objectives.objective import Objective, TargetInfo, check_loss_chunk
from lightning_spec.optimizers import build_optimizer, check_optimizer_settings, scale_gradients
from lightning_spec.schedule import TrainingClock, lr_schedule
from lightning_spec.target import TargetOptions
from lightning_spec.target_loading import load_target, resolve_dtype
from lightning_spec.tracking import checkpoint_record, comparison_of, log_comparison, mlflow_loggers


class DraftModule(L.LightningModule):
    """Trains ``drafter`` against the frozen ``target`` with ``objective``.

    Args:
        drafter: the draft model (e.g. ``lightning_spec.drafters.DFlashDrafter``).
        objective: the training objective (``lightning_spec.objectives.Objective`` and its parts).
        target: packaged name (``smollm2-135m-instruct``, ``tiny-random``), HF hub id or local folder.
        target_options: how the target is loaded and prompted (``TargetOptions``: revision, trust_remote_code (off),
            attn_implementation, chat_template_kwargs); ``data.target_options`` is linked to it.
        target_dtype: ``float32`` (CPU), ``bfloat16`` (GPUs) or ``auto``: bf16 where the device has it natively.
        lr: peak learning rate (AdamW's; Muon's too unless ``muon_lr``).
        weight_decay: weight decay of the matrices (AdamW's decoupled decay; Muon's).
        betas: AdamW betas.
        optimizer: ``adamw``, or ``muon`` on the hidden matrices with AdamW on the rest (``optimizers.py``).
        muon_lr: Muon's peak learning rate (None: ``lr``; its update is scaled to AdamW's RMS).
        warmup_ratio: fraction of the optimizer steps with a linear warm-up.
        min_lr_ratio: the cosine schedule decays to ``lr * min_lr_ratio``.
        feature_cache: ``disk``: each example's target features stored once (``features/``) for later epochs and
            runs of the same target, layers, data and dtype; ``memory``: this run only; ``off``: the target every step.
        feature_store: the store's folder (null: ``$LIGHTNING_SPEC_CACHE/features/<key>``).
        feature_dtype: the dtype of training features: ``target``, ``auto`` (bf16 where native, while decoding keeps
            ``target_dtype``: a second copy of the weights) or ``float32``/``bfloat16``/``float16``.
        loss_chunk: the objective this many anchors at a time, recomputed in backward: memory ~ loss_chunk x K x Vd
            instead of anchors x K x Vd (``benchmarks/objective_memory.py``). None: all anchors at once.
        shard_target: under DDP, shard the target's decoder layers over the ranks (FSDP2 per layer): a target larger
            than one device; needs ``feature_cache: off`` (docs/scaling.md).
        init_from: start from a trained drafter (.ckpt or folder): its weights only, recorded as the ``parent``; an
            objective with a reference drafter (GRPO's KL) gets a frozen copy of them.
    """

    def __init__(
        self,
        drafter: Drafter,
        objective: Objective | None = None,
        target: str = "smollm2-135m-instruct",
        target_options: TargetOptions | None = None,
        target_dtype: str = "float32",
        lr: float = 6e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        optimizer: Literal["adamw", "muon"] = "adamw",
        muon_lr: float | None = None,
        warmup_ratio: float = 0.04,
        min_lr_ratio: float = 0.1,
        feature_cache: Literal["memory", "disk", "off"] = "memory",
        feature_store: str | None = None,
        feature_dtype: str = "target",
        loss_chunk: int | None = None,
        init_from: str | None = None,
        shard_target: bool = False,
    ) -> None:
        super().__init__()
        ignore = ["drafter", "objective", "target_options"] + ([] if isinstance(target, str) else ["target"])
        self.save_hyperparameters(ignore=ignore)  # drafter and objective are recorded below via describe()
        options = TargetOptions.of(target_options)
        self.hparams["target_options"] = options.to_dict()  # plain values: checkpoints are read weights_only
        check_feature_options(feature_cache, feature_dtype, target_dtype, shard_target)
        check_optimizer_settings(lr, weight_decay, betas, warmup_ratio, min_lr_ratio, optimizer, muon_lr)
        check_loss_chunk(loss_chunk)
        self.target = load_target(target, dtype=target_dtype, options=options)  # (a built model keeps its dtype)
        self.target_spec = target if isinstance(target, str) else self.target.name
        wanted = self.target.dtype if feature_dtype == "target" else resolve_dtype(feature_dtype, self.target.device)
        self.drafter, objective = build(drafter), build(objective)  # dicts when reloaded from hparams
        self.drafter.bind(self.target)  # sets the drafter's target layers when it names none
        # training features: the target's (or its copy's in feature_dtype), through the store setup opens
        self.feature_source = FeatureSource(self.target, self.drafter.target_layers, dtype=wanted)
        self.objective = objective if objective is not None else Objective()
        self._parent = None if init_from is None else init_weights(self.drafter, init_from, self.target.fingerprints)
        self.provenance: dict[str, Any] | None = None  # the fit's command and resolved config (record_fit)
        self._reference = ReferenceDrafter(self.drafter) if self.objective.needs_reference else None  # GRPO's KL
        # what was trained, as plain values MLflow compares runs by (block size, loss, gamma...)
        described = {"drafter": describe(self.drafter), "objective": describe(self.objective)}
        self.save_hyperparameters({**self.hparams, **described})
        self.val_loss = RatioOfSums()
        self._den_accum = torch.zeros((), dtype=torch.float64)
        self._anchor_seed: int | None = None  # run seed of anchor_seeds; set in setup, restored from checkpoints
        self._clock: TrainingClock | None = None  # the LR schedule's clock, built in configure_optimizers
        self._clock_state: dict[str, Any] | None = None  # a checkpoint's clock, restored when the clock is built
        self._quiet: Any = None  # the warnings filter of a running fit (on_fit_start .. teardown)
        self._on_policy = False  # this fit trains on a replay buffer (``train_on_policy``)

    # --------------------------------------------------------------------------------------------- set-up
    def setup(self, stage: str) -> None:
        if self._anchor_seed is None:  # seed_everything's seed (LightningCLI: `seed_everything:`), else 0
            self._anchor_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        dm = self.trainer.datamodule if self._trainer is not None else None
        if not isinstance(dm, SpecDataModule):  # plain dataloaders (Python use): nothing of the data to check
            return
        dm.check_trained_for(self.target.fingerprints, self.target_spec, self.drafter.block_size)
        if stage != "fit":
            return
        if not bool(self.drafter.vocab.ready):  # a reduced draft vocabulary: the data's top tokens
            self.drafter.choose_vocab(dm.token_counts(self.target.vocab_size))
        self.objective.check_fit(self._on_policy)
        hp, rank = self.hparams, self.trainer.global_rank if self._trainer is not None else 0
        if hp.feature_cache != "off" and not self._on_policy:  # no store for a changing set
            self.feature_source = self.feature_source.for_fit(self.target_spec, dm.fingerprint, len(dm.train_dataset),
                                                              hp.feature_cache, hp.feature_store, rank)

    def train_on_policy(self) -> None:
        """Declared by ``OnPolicyRollouts.setup`` (run before ours): a replay buffer's rows change, so no store."""
        self._on_policy = True

    def configure_model(self) -> None:
        """The frozen target placed for the strategy: sharded with ``shard_target`` (``Target.place_for``)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is None:
            return
        ignored = self.target.place_for(strategy, self._trainer.world_size if self.hparams.shard_target else 1)
        if ignored:  # DDP would broadcast every parameter from rank 0 when it wraps the module: the shards differ
            self._ddp_params_and_buffers_to_ignore = [f"target.{name}" for name in ignored]
        if isinstance(strategy, FSDPStrategy):  # FSDP loads a checkpoint before on_load_checkpoint puts the target back
            self.strict_loading = False

    # ------------------------------------------------------------------------------------------- features
    def target_features(self, batch: dict[str, Tensor], use_cache: bool) -> tuple[Tensor, Tensor]:
        """Context features (N, S, F) and final normed hidden states (N, S, H) of the frozen target: through the
        feature store when ``use_cache`` (training steps), else the target's forward (``FeatureSource``)."""
        return self.feature_source(batch, use_store=use_cache)

    @torch.no_grad()
    def target_head(self, hidden: Tensor) -> Tensor:
        return self.drafter.head(hidden)  # (..., Vd) target logits over the draft vocabulary, no gradient

    def draft_step(self, batch: dict[str, Tensor], use_cache: bool) -> tuple[DraftOutput, Any]:
        draft, ctx = self.draft_and_context(batch, use_cache)
        return draft, self.objective(draft, ctx, chunk=self.hparams.loss_chunk)

    def draft_and_context(self, batch: dict[str, Tensor], use_cache: bool) -> tuple[DraftOutput, StepContext]:
        """The drafter's forward over the batch, and what the objective reads next to it, each written once here."""
        features, last = self.target_features(batch, use_cache)
        draft_fn = lambda anchors: self.drafter(batch, features, anchors)  # noqa: E731
        info = TargetInfo.of(self.target, self.drafter, last)
        chosen = self.objective.select_anchors(batch, draft_fn, info)  # EDR chooses; else None
        anchors, extra = (None, None) if chosen is None else chosen
        draft = self.drafter(batch, features, anchors)
        needs_target = self.objective.needs_target
        ctx = StepContext(
            target_hidden=slot_hidden(draft.anchors, draft.block_size, last) if needs_target else None,  # (N,A,K,H)
            target_head=self.target_head if needs_target else None,
            reference_logits=None if self._reference is None else
            self._reference.logits(draft, batch, features, anchors, self.target),
            extra=extra,
            progress=self.training_progress(),
            seeds=batch.get("anchor_seed"),  # (N,) per-example seeds for parts that draw (GRPO)
        )
        return draft, ctx

    def training_progress(self) -> float:
        """The share 0..1 of training done: by the LR schedule's clock (steps, or time when ``max_time`` binds)."""
        return 0.0 if self._clock is None else self._clock.run_progress(self.global_step)

    # ------------------------------------------------------------------------------------------- training
    def seeded(self, batch: dict[str, Tensor], salt: int) -> dict[str, Tensor]:
        """The batch plus ``anchor_seed`` (N,) for per-example anchor sampling (``with_anchor_seeds``)."""
        return with_anchor_seeds(batch, self._anchor_seed or 0, salt)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        draft, terms = self.draft_step(self.seeded(batch, self.global_step), use_cache=True)
        self._den_accum = self._den_accum.to(terms.den.device) + terms.den.detach().double()
        n, hits = batch["input_ids"].shape[0], draft.slot_hits(self.hparams.loss_chunk) & draft.valid  # (N, A, K)
        num, den, acc = global_totals(terms.num, terms.den, hits, draft.valid, sum_over_ranks(self.trainer))  # acc (K,)
        if not torch.isfinite(num):  # the global value: every rank raises together
            lr = self.trainer.optimizers[0].param_groups[0]["lr"] if self.trainer.optimizers else self.hparams.lr
            raise DivergedLoss.at(float(num), self.global_step, lr)
        self.log("train/loss", (num / den.clamp_min(1e-12)).float(), prog_bar=True, batch_size=n)
        for name, value in terms.metrics.items():  # objective-specific scalars, e.g. train/edr_expected_rounds
            self.log(f"train/{name}", value, batch_size=n, sync_dist=True)  # DDP: the mean over ranks
        if "drawn_step" in batch:  # on-policy data: optimizer steps since the drafter that decoded it
            staleness = (self.global_step - batch["drawn_step"]).float().mean()
            self.log("train/staleness", staleness, batch_size=n, sync_dist=True)
        self.log("train/acc/t1", acc[0].float(), batch_size=n)
        self.log(f"train/acc/t{acc.numel()}", acc[-1].float(), batch_size=n)
        return terms.num  # divided by the global Σ den in on_before_optimizer_step

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        seconds, examples = self.feature_source.take_work()  # the clock: this step's time and its target forwards
        if self._clock is not None:
            dm = self.trainer.datamodule  # (a store opens only for a SpecDataModule)
            uncached = self.feature_source.uncached(len(dm.train_dataset)) if isinstance(dm, SpecDataModule) else 0
            self._clock.tick(self.global_step + 1, seconds, examples, uncached)
        reduce, den = sum_over_ranks(self.trainer), self._den_accum.clone()
        den = den if reduce is None else reduce(den)
        # Lightning divided each micro-batch loss by accumulate_grad_batches and DDP averaged over ranks (under FSDP
        # each rank scales its shard of the averaged gradient by the same scalar: the same)
        trainer = self.trainer
        scale_gradients(self.drafter, trainer.accumulate_grad_batches * trainer.world_size / max(float(den), 1e-12))
        self._den_accum = torch.zeros_like(self._den_accum)

    def on_fit_start(self) -> None:
        # the frozen target stays in eval mode (Target.train): Lightning's warning about it, for this fit only
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
        if self.trainer.is_global_zero and mlflow_loggers(self.trainer.loggers):  # what runs are compared by
            dm = self.trainer.datamodule if isinstance(self.trainer.datamodule, SpecDataModule) else None
            log_comparison(self.trainer.loggers, *comparison_of(self.drafter, self.objective.label, self.target_spec,
                                                                self.target.fingerprint, dm))

    def on_train_end(self) -> None:
        """The optimizer steps reached, as the run's ``steps`` (a time budget may stop a fit before max_steps)."""
        for logger in self.trainer.loggers:
            logger.log_metrics({"steps": float(self.global_step)}, step=self.global_step)

    def teardown(self, stage: str) -> None:
        quiet, self._quiet, self._on_policy = self._quiet, None, False
        if quiet is not None:
            quiet.__exit__(None, None, None)

    def on_train_epoch_start(self) -> None:
        self.feature_source.refresh()  # what the other DDP ranks (or processes) stored since

    def on_train_epoch_end(self) -> None:
        if self.feature_source.flush() and self.trainer.world_size > 1:  # every rank's shards on disk first
            self.trainer.strategy.barrier("feature-store")

    # ----------------------------------------------------------------------------------------- validation
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        _, terms = self.draft_step(self.seeded(batch, -1), use_cache=False)  # the same anchors at every validation
        self.val_loss.update(terms.num.detach(), terms.den)

    def on_validation_epoch_end(self, name: str = "val/loss") -> None:
        if self.val_loss.update_count:
            self.log(name, self.val_loss.compute())
        self.val_loss.reset()

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self.on_validation_epoch_end("test/loss")

    # ------------------------------------------------------------------------------------------ optimizer
    def configure_optimizers(self):
        hp = self.hparams
        opt = build_optimizer(self.drafter, hp.get("optimizer", "adamw"), hp.lr, hp.weight_decay, tuple(hp.betas),
                              hp.get("muon_lr"))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        self._clock = TrainingClock.for_fit(total, hp.warmup_ratio, self.trainer.callbacks, self._clock_state)
        return {"optimizer": opt, "lr_scheduler": lr_schedule(opt, self._clock, hp.min_lr_ratio)}

    # ---------------------------------------------------------------------------------------- checkpoints
    def record_fit(self, record: dict[str, Any]) -> None:
        """The fit's command and resolved config (``provenance.run_record``, from the CLI), kept in every checkpoint."""
        self.provenance = record

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The drafter without the target, and what a resumed fit needs (``checkpoint/fit.py``)."""
        self.feature_source.flush()  # a run killed after this checkpoint resumes with these features stored
        run = checkpoint_record(self.trainer.loggers) if self._trainer is not None and self.trainer.is_global_zero \
            else None  # rank 0 writes the file and owns the MLflow run
        write_fit_state(checkpoint, self.drafter, self.target_spec, self._parent, self.provenance, self._anchor_seed,
                        None if self._clock is None else self._clock.state_dict(), run)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = read_fit_state(checkpoint, self.state_dict())  # the anchors and clock of the run it resumes
        self._clock_state = state.clock
        self._anchor_seed = self._anchor_seed if state.anchor_seed is None else state.anchor_seed

