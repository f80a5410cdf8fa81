"""DraftModule: target + drafter + objective, one ``training_step`` for every method: a batch's target features,
the anchors, the drafter's forward over them, the objective's ``(num, den)``, one reduction.

Reduction. The objective returns ``LossTerms(num, den)``. We back-propagate the *numerator* of each micro-batch
and, just before the optimizer step, divide the accumulated gradients by the global Σ den (summed over the
accumulation window and all DDP ranks). So batch 8 x accumulation 1 and batch 1 x accumulation 8 give the same
gradient, and 2 ranks give the same gradient as 1 rank with the doubled batch.

Determinism across batch layouts. Anchors are drawn per example from a seed of (run seed, optimizer step,
example index) (``anchor_seeds``), not from the global RNG, so an example gets the same anchors whichever batch,
DDP rank or resumed process it lands in: 2 DDP ranks train like 1 process with the doubled batch, and a run
killed mid-epoch and resumed from ``last.ckpt`` trains like the uninterrupted one (tests/integration/test_ddp.py,
tests/integration/test_resume.py). Logged training metrics are those of the global batch (sums all-reduced over ranks).

Checkpoints hold the drafter only: the frozen target's weights are stripped on save and re-attached on load;
``load_drafter`` rebuilds a drafter from a checkpoint (see ``checkpoint/``). They also carry the MLflow run id
(``tracking.MLFLOW_RUN_KEY``), so ``fit --ckpt_path`` continues the same run (``tracking.prepare_loggers``).
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor

from lightning_spec.checkpoint import CKPT_KEY, build, describe, init_weights
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.drafters.base import Drafter, DraftOutput, anchor_seeds, drafter_record
from lightning_spec.errors import DivergedLoss, UserError
from lightning_spec.features.source import FeatureSource
from lightning_spec.features.store import StoreSpec, open_training_store, store_folder
from lightning_spec.metrics import RatioOfSums, slot_hits
from lightning_spec.objectives.context import ReferenceDrafter, StepContext, slot_hidden
from lightning_spec.objectives.objective import Objective, TargetInfo
from lightning_spec.optimizers import build_optimizer, check_optimizer_settings
from lightning_spec.provenance import PROVENANCE_KEY, run_record
from lightning_spec.schedule import TrainingClock, time_budget
from lightning_spec.target import TargetOptions
from lightning_spec.target_loading import load_target, resolve_dtype
from lightning_spec.tracking import checkpoint_record, log_comparison, mlflow_loggers


class DraftModule(L.LightningModule):
    """Trains ``drafter`` against the frozen ``target`` with ``objective``.

    Args:
        drafter: the draft model (e.g. ``lightning_spec.drafters.DFlashDrafter``).
        objective: the training objective (``lightning_spec.objectives.Objective`` and its parts).
        target: packaged name (``smollm2-135m-instruct``, ``tiny-random``), HF hub id or local folder.
        target_options: how that target is loaded and prompted (``TargetOptions``): ``revision``,
            ``trust_remote_code`` (off), ``attn_implementation``, ``chat_template_kwargs``; the data module gets the
            same options (``data.target_options`` is linked to this field).
        target_dtype: dtype of the frozen target: ``float32`` on CPU, ``bfloat16`` on GPUs, ``auto``: bf16 where the
            device multiplies it natively (``target.resolve_dtype``).
        lr: peak learning rate (AdamW's; Muon's too unless ``muon_lr``).
        weight_decay: weight decay of the matrices (AdamW's decoupled decay; Muon's).
        betas: AdamW betas.
        optimizer: ``adamw`` or ``muon``: Muon on the hidden matrices, AdamW on norms, tables and heads
            (``optimizers.py``; the speculators trainer's default since its RFC #979).
        muon_lr: Muon's peak learning rate (None: ``lr``; Muon's update is scaled to AdamW's RMS).
        warmup_ratio: fraction of the optimizer steps with a linear warm-up.
        min_lr_ratio: the cosine schedule decays to ``lr * min_lr_ratio``.
        feature_cache: ``disk`` writes the target's features of each training example to a feature store the first
            time they are computed (``features/store.py``: sharded safetensors, read back lazily), so later epochs
            and later runs with the same target, layers, data and dtype never run the target; ``memory`` keeps them
            in RAM for this run only; ``off`` runs the target forward every step.
        feature_store: the folder of the feature store (``lightning-spec features --out`` writes one ahead of
            training); null: ``$LIGHTNING_SPEC_CACHE/features/<key>``, the key naming target, layers, data and dtype.
        feature_dtype: the dtype the target computes training features in: ``target`` (``target_dtype``), ``auto``
            (bf16 where the device multiplies it natively: the fast path on such CPUs, while decoding keeps
            ``target_dtype``), or ``float32``/``bfloat16``/``float16``. A dtype other than the target's keeps a
            second copy of the target's weights in that dtype.
        loss_chunk: compute the objective this many anchors at a time, each chunk's draft and target logits
            recomputed in the backward pass: memory grows with loss_chunk x K x Vd instead of anchors x K x Vd,
            for one more head forward per step (``benchmarks/objective_memory.py``). None: all anchors at once.
        shard_target: under DDP over several ranks, shard the frozen target's decoder layers across them (FSDP2
            ``fully_shard`` per layer, ``Target.shard_layers``): a target larger than one device trains a drafter,
            each rank gathering one layer at a time for its own batch. Every rank then runs the target in step, so it
            needs ``feature_cache: off``, and callbacks that decode or roll out on one rank's prompts refuse it
            (evaluate the checkpoint with ``lightning-spec evaluate`` instead). docs/scaling.md has the memory.
        init_from: start from a trained drafter, a ``fit`` checkpoint or an exported folder: its weights only (this
            fit has its own optimizer, schedule and steps), so "SFT, then X" is two YAMLs. Checkpoints of this fit
            record it as their ``parent``. An objective that regularises towards a reference drafter (GRPO's KL)
            gets a frozen copy of these starting weights.
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
        if feature_cache not in ("memory", "disk", "off"):
            raise UserError(f"model.feature_cache must be 'memory', 'disk' or 'off', got {feature_cache!r}.")
        check_optimizer_settings(lr, weight_decay, betas, warmup_ratio, min_lr_ratio, optimizer, muon_lr)
        if shard_target and (feature_cache != "off" or feature_dtype not in ("target", target_dtype)):
            raise UserError(
                "model.shard_target runs the target's forward on every rank in step, so each rank must compute the "
                "features of every batch: set model.feature_cache: off and model.feature_dtype: target (or write the "
                "features ahead with `lightning-spec features` and train without shard_target)."
            )
        if loss_chunk is not None and loss_chunk < 1:
            raise UserError(f"model.loss_chunk is {loss_chunk}; it must be >= 1 anchors, or null for no chunks.")
        self.target = load_target(target, dtype=target_dtype, options=options) if isinstance(target, str) else \
            load_target(target, options=options)
        self.target_spec = target if isinstance(target, str) else self.target.name
        wanted = self.target.dtype if feature_dtype == "target" else resolve_dtype(feature_dtype, self.target.device)
        drafter, objective = build(drafter), build(objective)  # dicts when reloaded from hparams
        self.drafter = drafter
        self.drafter.bind(self.target)  # sets the drafter's target layers when it names none
        # training features: the target's (or its copy's in the feature dtype), through the feature store once setup
        # opens one (model.feature_cache)
        self.feature_source = FeatureSource(self.target, self.drafter.target_layers, dtype=wanted)
        self.objective = objective if objective is not None else Objective()
        self._parent = None if init_from is None else init_weights(self.drafter, init_from, self.target.fingerprint)
        self.provenance: dict[str, Any] | None = None  # the fit's command and resolved config (the CLI's), if any
        # the starting drafter, frozen, where the objective declares it needs one (GRPO's KL to the reference)
        self._reference = ReferenceDrafter(self.drafter) if self.objective.needs_reference else None
        # Record what was trained, so MLflow can compare runs by block size, loss, gamma... (the objects
        # themselves are not hyperparameters: the drafter is a module, the objective a tree of parts).
        self.save_hyperparameters(
            {**self.hparams, "drafter": describe(self.drafter), "objective": describe(self.objective)}
        )
        self.val_loss = RatioOfSums()
        self._den_accum = torch.zeros((), dtype=torch.float64)
        self._anchor_seed: int | None = None  # run seed of anchor_seeds; set in setup, restored from checkpoints
        self._last_step_time: float | None = None
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
        for meta in dm.rollout_meta:  # target-regenerated SFT: the same weights only
            if meta.get("target_fingerprint") != self.target.fingerprint:
                raise UserError(
                    f"data.train_sources '{meta['folder']}' holds rollouts of target '{meta.get('target')}' with "
                    f"weight fingerprint {meta.get('target_fingerprint')}, but model.target has fingerprint "
                    f"{self.target.fingerprint}; regenerate them with `lightning-spec rollouts --target "
                    f"{self.target_spec} ...`."
                )
        dm.check_block_size(self.drafter.block_size)
        if stage == "fit" and not bool(self.drafter.vocab.ready):  # a reduced draft vocabulary: the data's top tokens
            self.drafter.vocab.set_from_counts(dm.token_counts(self.target.vocab_size))
            self.drafter.on_vocab_chosen()
        on_policy = self._on_policy
        if stage == "fit" and self.objective.needs_rollouts and not on_policy:
            raise UserError(
                f"model.objective {type(self.objective).__name__} trains on the rounds of on-policy rollouts; add "
                "lightning_spec.callbacks.OnPolicyRollouts to trainer.callbacks (see experiments/regimes/)."
            )
        if stage == "fit" and self.hparams.feature_cache != "off" and not on_policy:  # no store for a changing set
            spec = self.store_spec(dm.fingerprint, len(dm.train_dataset))
            directory = self.store_directory(spec) if self.hparams.feature_cache == "disk" else None
            rank = self.trainer.global_rank if self._trainer is not None else 0
            self.feature_source = self.feature_source.with_store(open_training_store(directory, spec, rank))

    def train_on_policy(self) -> None:
        """Declared by ``OnPolicyRollouts.setup``, which Lightning runs before this module's: the fit trains on a
        replay buffer of rollouts, so no feature store is opened for it (its rows change)."""
        self._on_policy = True

    def store_spec(self, data_fingerprint: str, examples: int) -> StoreSpec:
        """What this fit's feature store holds: its target, layers, data and feature dtype."""
        return self.feature_source.store_spec(self.target_spec, data_fingerprint, examples)

    def store_directory(self, spec: StoreSpec) -> Path:
        """``model.feature_store``, else the store's folder in the cache, named by its key."""
        return store_folder(spec, self.hparams.feature_store)

    def configure_model(self) -> None:
        """The frozen target placed for the strategy (``Target.place_for``): its decoder layers sharded over the
        ranks with ``shard_target`` under DDP, whole and ignored by FSDP, which shards the drafter only."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is None:
            return
        ignored = self.target.place_for(strategy, self._trainer.world_size if self.hparams.shard_target else 1)
        if ignored:  # DDP would broadcast every parameter from rank 0 when it wraps the module: the shards differ
            self._ddp_params_and_buffers_to_ignore = [f"target.{name}" for name in ignored]
        if isinstance(strategy, FSDPStrategy):
            # FSDP loads a checkpoint's weights itself, before on_load_checkpoint could put back the target's
            # (stripped on save): the target's keys are missing by design
            self.strict_loading = False

    # ------------------------------------------------------------------------------------------- features
    def target_features(self, batch: dict[str, Tensor], use_cache: bool) -> tuple[Tensor, Tensor]:
        """Context features (N, S, F) and final normed hidden states (N, S, H) of the frozen target: through the
        feature store when ``use_cache`` (training steps), else the target's forward (``FeatureSource``)."""
        return self.feature_source(batch, use_store=use_cache)

    @torch.no_grad()
    def target_head(self, hidden: Tensor) -> Tensor:
        return self.drafter.head(hidden)  # (..., Vd) target logits over the draft vocabulary, no gradient

    def target_info(self, last_hidden: Tensor) -> TargetInfo:
        """What an objective that picks its own anchors may read (EDR: p_t at every position)."""
        head = self.target.lm_head
        return TargetInfo(
            last_hidden=last_hidden,
            logits=lambda h: head(h.to(head.weight.dtype)).float(),
            vocab=self.drafter.vocab,
            block_size=self.drafter.block_size,
            eos_ids=self.target.eos_token_ids,
        )

    def draft_step(self, batch: dict[str, Tensor], use_cache: bool) -> tuple[DraftOutput, Any]:
        draft, ctx = self.draft_and_context(batch, use_cache)
        return draft, self.objective(draft, ctx, chunk=self.hparams.loss_chunk)

    def draft_and_context(self, batch: dict[str, Tensor], use_cache: bool) -> tuple[DraftOutput, StepContext]:
        """The drafter's forward over the batch, and what the objective reads next to it, each written once here."""
        features, last = self.target_features(batch, use_cache)
        draft_fn = lambda anchors: self.drafter(batch, features, anchors)  # noqa: E731
        chosen = self.objective.select_anchors(batch, draft_fn, self.target_info(last))  # EDR chooses; else None
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
        if self._clock is None or self._trainer is None:
            return 0.0
        return self._clock.run_progress(self.global_step)

    # ------------------------------------------------------------------------------------------- training
    def seeded(self, batch: dict[str, Tensor], salt: int) -> dict[str, Tensor]:
        """The batch plus ``anchor_seed`` (N,) for per-example anchor sampling (needs the examples' ``index``)."""
        if "index" not in batch:
            return batch
        run_seed = self._anchor_seed if self._anchor_seed is not None else 0
        return {**batch, "anchor_seed": anchor_seeds(run_seed, salt, batch["index"])}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        draft, terms = self.draft_step(self.seeded(batch, self.global_step), use_cache=True)
        self._den_accum = self._den_accum.to(terms.den.device) + terms.den.detach().double()
        n = batch["input_ids"].shape[0]
        with torch.no_grad():
            valid = draft.valid
            hits = slot_hits(draft, self.hparams.loss_chunk) & valid  # (N, A, K)
            k = valid.shape[-1]
            # [num, den, hits (K), labels (K)], summed over the DDP ranks in one all-reduce: logged values are
            # those of the global batch (ratios of sums), the same as one process with the whole batch
            sums = torch.cat([terms.num.detach().double().view(1), terms.den.detach().double().view(1),
                              hits.sum((0, 1)).double(), valid.sum((0, 1)).double()])
            if self.trainer.world_size > 1:
                sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        num, den, acc = sums[0], sums[1], sums[2 : 2 + k] / sums[2 + k :].clamp_min(1)  # acc (K,)
        if not torch.isfinite(num):  # the global value: every rank raises together
            lr = self.trainer.optimizers[0].param_groups[0]["lr"] if self.trainer.optimizers else self.hparams.lr
            raise DivergedLoss(
                f"train/loss is not finite ({float(num)}) at step {self.global_step}: training diverged; lower "
                f"model.lr (the learning rate is {lr:g}) or check the data for broken examples."
            )
        self.log("train/loss", (num / den.clamp_min(1e-12)).float(), prog_bar=True, batch_size=n)
        for name, value in terms.metrics.items():  # objective-specific scalars, e.g. train/edr_expected_rounds
            self.log(f"train/{name}", value, batch_size=n, sync_dist=True)  # DDP: the mean over ranks
        if "drawn_step" in batch:  # on-policy data: optimizer steps since the drafter that decoded it
            staleness = (self.global_step - batch["drawn_step"]).float().mean()
            self.log("train/staleness", staleness, batch_size=n, sync_dist=True)
        self.log("train/acc/t1", acc[0].float(), batch_size=n)
        self.log(f"train/acc/t{k}", acc[-1].float(), batch_size=n)
        return terms.num  # divided by the global Σ den in on_before_optimizer_step

    def _tick(self) -> None:
        """Feed the training clock one optimizer step: its wall time and the target forwards inside it."""
        now = time.perf_counter()
        last, self._last_step_time = self._last_step_time, now
        seconds, examples = self.feature_source.take_work()
        if last is None or self._clock is None:
            return
        uncached = 0
        dm, store = self.trainer.datamodule, self.feature_source.store
        if store is not None and isinstance(dm, SpecDataModule):  # a store opens only for a SpecDataModule
            uncached = max(len(dm.train_dataset) - len(store), 0)  # len: a count, not a pass over the store
        self._clock.record(self.global_step + 1, now - last, seconds, examples, uncached)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._tick()
        den = self._den_accum.clone()
        if self.trainer.world_size > 1:
            den = self.trainer.strategy.reduce(den, reduce_op="sum")
        # Lightning divided each micro-batch loss by accumulate_grad_batches and DDP averaged over ranks. Under
        # FSDP each rank holds a shard of every reduced (averaged) gradient: scaling each shard by the same
        # scalar scales the whole gradient, so this is right there too.
        scale = self.trainer.accumulate_grad_batches * self.trainer.world_size / max(float(den), 1e-12)
        for p in self.drafter.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        self._den_accum = torch.zeros_like(self._den_accum)

    def on_fit_start(self) -> None:
        # The frozen target stays in eval mode on purpose (Target.train), and Lightning's fit loop warns about
        # every module in eval mode when training starts: silence that one warning for this fit only.
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
        if self.trainer.is_global_zero and mlflow_loggers(self.trainer.loggers):
            log_comparison(self.trainer.loggers, *self.comparison())

    def comparison(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """What this fit's run is compared by in MLflow (``tracking.COMPARISON_COLUMNS``): the drafter's family,
        objective, K and draft vocabulary, the target and its weights' fingerprint, the size of the training
        data; and that data as the run's dataset input (None outside a ``SpecDataModule``)."""
        vocab = self.drafter.draft_vocab_size
        params = {"family": self.drafter.family or type(self.drafter).__name__, "objective": self.objective.label,
                  "K": self.drafter.block_size, "draft_vocab": vocab if vocab is not None else "full",
                  "target": self.target_spec, "target_fingerprint": self.target.fingerprint}
        dm = self.trainer.datamodule
        if not isinstance(dm, SpecDataModule):
            return params, None
        sources, rows = ", ".join(s.name for s in dm.train_sources), len(dm.train_dataset)
        params["train_examples"] = rows
        return params, {"name": sources[:200], "digest": dm.fingerprint, "source": sources, "rows": rows}

    def on_train_end(self) -> None:
        """The optimizer steps reached, as the run's ``steps`` (a time budget may stop a fit before max_steps)."""
        for logger in self.trainer.loggers:
            logger.log_metrics({"steps": float(self.global_step)}, step=self.global_step)

    def teardown(self, stage: str) -> None:
        self._on_policy = False
        quiet, self._quiet = self._quiet, None
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

    def on_validation_epoch_end(self) -> None:
        if self.val_loss.update_count:
            self.log("val/loss", self.val_loss.compute())
        self.val_loss.reset()

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        if self.val_loss.update_count:
            self.log("test/loss", self.val_loss.compute())
        self.val_loss.reset()

    # ------------------------------------------------------------------------------------------ optimizer
    def configure_optimizers(self):
        hp = self.hparams
        opt = build_optimizer(self.drafter, hp.get("optimizer", "adamw"), hp.lr, hp.weight_decay, tuple(hp.betas),
                              hp.get("muon_lr"))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(hp.warmup_ratio * total)
        self._clock = TrainingClock(total, warmup, time_budget(self.trainer.callbacks))
        if self._clock_state:  # a resumed run keeps a switch to the time schedule
            self._clock.load_state_dict(self._clock_state)

        def schedule(step: int) -> float:  # linear warm-up, then cosine to min_lr_ratio; ends on time (schedule.py)
            return self._clock.multiplier(step, hp.min_lr_ratio)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---------------------------------------------------------------------------------------- checkpoints
    def record_fit(self, record: dict[str, Any]) -> None:
        """The fit's command and resolved config (``provenance.run_record``, from the CLI), kept in every checkpoint."""
        self.provenance = record

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.feature_source.flush()  # a run killed after this checkpoint resumes with these features stored
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("target.")}
        checkpoint[CKPT_KEY] = {**drafter_record(self.drafter, self.target_spec), "parent": self._parent}
        checkpoint[PROVENANCE_KEY] = self.provenance or run_record()  # a fit from Python: its command, no config
        checkpoint["anchor_seed"] = self._anchor_seed
        if self._clock is not None:
            checkpoint["training_clock"] = self._clock.state_dict()
        if self._trainer is not None and self.trainer.is_global_zero:  # rank 0 writes the file and owns the run
            checkpoint.update(checkpoint_record(self.trainer.loggers))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        own = self.state_dict()
        checkpoint["state_dict"].update({k: v for k, v in own.items() if k.startswith("target.")})
        self._clock_state = checkpoint.get("training_clock")  # restored once configure_optimizers built the clock
        if checkpoint.get("anchor_seed") is not None:  # a resumed run draws the anchors the original would have
            self._anchor_seed = int(checkpoint["anchor_seed"])

