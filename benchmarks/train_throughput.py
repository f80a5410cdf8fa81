"""Where a training step's time goes, what Lightning adds, and training tokens/s with and without stored features.

    .venv/bin/python benchmarks/train_throughput.py                      # the quickstart's setting, fp32 and bf16
    .venv/bin/python benchmarks/train_throughput.py --dtypes float32 --steps 20

One process, the quickstart's drafter and objective (``experiments/quickstart.yaml``: DFlash-style DFlashDrafter,
K = 8, 32 anchors, a 2048-token draft vocabulary, KL with the position decay; batch 8 of <= 160 tokens of ShareGPT
conversations), on the packaged SmolLM2-135M target. It prints, with the CPU's name:

1. **data**: seconds to read and tokenize the training conversations (``SpecDataModule.setup``), twice: the second
   time shows what a rerun of ``fit`` pays;
2. **the split of a step**, timed by wrapping the module's own functions (no copy of the step): the next batch,
   the target forward (context features + final hidden state), the target distribution (its LM head over the draft
   vocabulary), the drafter forward, the rest of the objective, the backward pass, the optimizer (gradient scale,
   clipping, AdamW, schedule). Median ms per step over ``--steps`` steps, per target dtype;
3. **training tokens/s** (non-padding tokens of the batches): stored features off (a target forward every step),
   the first epoch (the target forward runs and its features are written), and later epochs (features read back);
4. **Lightning's overhead**: ``Trainer.fit`` against a plain PyTorch loop doing the same work (the module's
   ``training_step``'s work: features, drafter, objective, its logged statistics, backward, the ``(num, den)``
   scale, clipping, AdamW, schedule) on stored features, where the overhead shows most; alternated run by run,
   median step times over the steady state. Lightning runs twice: bare (no logger, no progress bar) and as
   ``fit`` runs by default (MLflow logging every 5 steps into a temporary store, the rich progress bar).

Do not run it beside other work: every figure here is a wall-clock time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from objective_memory import cpu_name  # this folder is on sys.path when the script runs

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """Seconds per named phase, accumulated by wrapped functions between ``lap`` calls."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - start

        return timed

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.spent[name] += time.perf_counter() - start

    def lap(self) -> dict[str, float]:
        spent, self.spent = dict(self.spent), defaultdict(float)
        return spent


def build(args: argparse.Namespace, dtype: str, feature_cache: str):
    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.module import DraftModule
    from lightning_spec.objectives import KL, ExpDecay, Objective

    torch.manual_seed(0)
    drafter = DFlashDrafter(block_size=8, num_layers=1, num_anchors=32, draft_vocab_size=2048, context_shortcut=True)
    module = DraftModule(drafter, Objective(KL(), ExpDecay(2.0)), target=args.target, target_dtype=dtype,
                         lr=1e-3, warmup_ratio=0.03, feature_cache=feature_cache)
    return module


def data_module(args: argparse.Namespace):
    from lightning_spec.datamodule import SpecDataModule

    return SpecDataModule(target=args.target, train_sources=["sharegpt"], train_limit=args.conversations,
                          max_length=160, batch_size=8, val_fraction=0.03, seed=0)


def attach_data(module, dm) -> None:
    """What ``DraftModule.setup('fit')`` does with the data module: the draft vocabulary and the feature store."""
    if not bool(module.drafter.vocab.ready):
        module.drafter.choose_vocab(dm.token_counts(module.target.vocab_size))
    hp = module.hparams
    if hp.feature_cache != "off":
        module.feature_source = module.feature_source.for_fit(module.target_spec, dm.fingerprint, len(dm.train_dataset),
                                                              hp.feature_cache, hp.feature_store, rank=0)


def optimizer(module):
    from lightning_spec.schedule import TrainingClock

    opt = torch.optim.AdamW(module.drafter.parameters(), lr=1e-3, betas=(0.9, 0.95))
    clock = TrainingClock(500, 15)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: clock.multiplier(s, 0.1))
    return opt, sched


def plain_step(module, batch, step: int, opt, sched, clock: Clock | None = None) -> None:
    """The work of ``DraftModule.training_step`` plus Lightning's optimizer step, in plain PyTorch."""
    from lightning_spec.metrics import global_totals

    clock = clock or Clock()
    draft, terms = module.draft_step(module.seeded(batch, step), use_cache=True)
    with clock.phase("objective"):  # the statistics training_step logs belong to the step's own work
        with torch.no_grad():
            hits = draft.slot_hits() & draft.valid
            float(global_totals(terms.num, terms.den, hits, draft.valid)[0])
    with clock.phase("backward"):
        terms.num.backward()
    with clock.phase("optimizer"):
        scale = 1.0 / max(float(terms.den), 1e-12)
        for p in module.drafter.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        torch.nn.utils.clip_grad_norm_(module.drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def instrument(module, clock: Clock) -> None:
    """Time the module's own parts in place: target forward (or stored features), drafter forward, target head."""
    module.target_features = clock.wrap("target forward", module.target_features)
    module.target_head = clock.wrap("target distribution", module.target_head)
    forward = module.drafter.forward
    module.drafter.forward = clock.wrap("drafter forward", forward)
    objective = module.objective  # draft_step calls it as a callable object: time it through its class
    original = type(objective).__call__

    class Timed(type(objective)):
        def __call__(self, *a, **k):
            with clock.phase("objective+distribution"):
                return original(self, *a, **k)

    objective.__class__ = Timed


def batches(dm):
    """Training batches epoch after epoch, as Lightning's loop draws them."""
    while True:
        yield from dm.train_dataloader()


def tokens_of(batch) -> int:
    return int(batch["attention_mask"].sum())


def step_split(args, dtype: str, steps: int) -> tuple[dict[str, float], float]:
    """Median ms per phase over ``steps`` steps without stored features, and tokens/s."""
    module, dm = build(args, dtype, "off"), data_module(args)
    dm.setup("fit")
    attach_data(module, dm)
    clock = Clock()
    instrument(module, clock)
    opt, sched = optimizer(module)
    loader = batches(dm)
    laps, tokens, seconds = [], 0, 0.0
    for step in range(steps + 2):
        start = time.perf_counter()
        with clock.phase("data"):
            batch = next(loader)
        plain_step(module, batch, step, opt, sched, clock)
        spent = clock.lap()
        if step >= 2:  # warm-up
            laps.append({**spent, "total": time.perf_counter() - start})
            tokens += tokens_of(batch)
            seconds += laps[-1]["total"]
    median = {k: statistics.median(lap.get(k, 0.0) for lap in laps) * 1e3 for k in laps[0]}
    median["objective"] = median.pop("objective+distribution") - median["target distribution"] + median["objective"]
    return median, tokens / seconds


def epochs(args, dtype: str) -> tuple[float, float, int]:
    """Tokens/s of a first epoch (target forwards written to the store) and of the next one (read back)."""
    module, dm = build(args, dtype, "disk"), data_module(args)
    dm.setup("fit")
    attach_data(module, dm)
    opt, sched = optimizer(module)
    rates, step = [], 0
    for _ in range(2):
        tokens, start = 0, time.perf_counter()
        for batch in dm.train_dataloader():
            plain_step(module, batch, step, opt, sched)
            tokens += tokens_of(batch)
            step += 1
        module.feature_source.store.flush()  # what on_train_epoch_end does
        rates.append(tokens / (time.perf_counter() - start))
    return rates[0], rates[1], step // 2


class StepTimes:
    """Lightning callback: the wall time between consecutive training batch starts."""

    def __new__(cls):
        from lightning.pytorch.callbacks import Callback

        class _StepTimes(Callback):
            def __init__(self) -> None:
                self.starts: list[float] = []

            def on_train_batch_start(self, *a) -> None:
                self.starts.append(time.perf_counter())

            def on_train_end(self, *a) -> None:
                self.starts.append(time.perf_counter())

        return _StepTimes()


def lightning_run(args, dm, module, steps: int, dressed: bool, workdir: Path) -> list[float]:
    import lightning as L
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.loggers import MLFlowLogger

    times = StepTimes()
    callbacks = [times] + ([RichProgressBar()] if dressed else [])
    logger = MLFlowLogger(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}", experiment_name="throughput") if dressed \
        else False
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=logger, callbacks=callbacks,
                        enable_checkpointing=False, enable_progress_bar=dressed, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=1.0, log_every_n_steps=5,
                        default_root_dir=str(workdir))
    trainer.fit(module, datamodule=dm)
    return [b - a for a, b in zip(times.starts, times.starts[1:])]


def overhead(args, workdir: Path) -> dict[str, float]:
    """Median step time (ms) on stored features: plain loop, Lightning bare, Lightning with logger and bar."""
    results: dict[str, list[float]] = defaultdict(list)
    skip = 3  # the first steps warm caches and allocators up
    for _ in range(args.rounds):
        for side in ("plain", "lightning", "lightning+logger+bar"):
            module, dm = build(args, "float32", "disk"), data_module(args)
            if side == "plain":
                dm.setup("fit")
                attach_data(module, dm)
                opt, sched = optimizer(module)
                loader, times = batches(dm), []
                for step in range(args.overhead_steps):
                    start = time.perf_counter()
                    plain_step(module, next(loader), step, opt, sched)
                    times.append(time.perf_counter() - start)
            else:
                times = lightning_run(args, dm, module, args.overhead_steps, side != "lightning", workdir)
            results[side].extend(times[skip:])
    return {side: statistics.median(t) * 1e3 for side, t in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--conversations", type=int, default=300, help="ShareGPT conversations (an epoch's size)")
    parser.add_argument("--steps", type=int, default=12, help="steps timed for the split of a step")
    parser.add_argument("--emulated-steps", type=int, default=3,
                        help="steps timed for a bf16 target where the CPU emulates bf16 (slow)")
    parser.add_argument("--overhead-steps", type=int, default=25, help="steps per run in the overhead comparison")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of plain and Lightning runs")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")

    from lightning_spec.assets import cache_dir

    features = cache_dir() / "features"
    existing = set(features.glob("*")) if features.exists() else set()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            data_module(args).setup("fit")
            times.append(time.perf_counter() - start)
        print(f"\ndata: read and tokenize {args.conversations} conversations: {times[0]:.1f} s first, "
              f"{times[1]:.1f} s again", flush=True)

        from lightning_spec.target_loading import native_bf16

        phases = ["data", "target forward", "target distribution", "drafter forward", "objective", "backward",
                  "optimizer", "total"]
        for dtype in args.dtypes:
            emulated = dtype == "bfloat16" and not native_bf16("cpu")
            steps = min(args.steps, args.emulated_steps) if emulated else args.steps
            split, off = step_split(args, dtype, steps)
            print(f"\nsplit of a training step, {dtype} target, features not stored (median ms of {steps} steps)"
                  + (" [bf16 is emulated on this CPU: no AVX512-BF16 or AMX]" if emulated else ""))
            for phase in phases:
                print(f"  {phase:<22}{split.get(phase, 0.0):10.1f}  {split.get(phase, 0.0) / split['total']:5.1%}")
            if emulated:
                print(f"  training tokens/s: {off:.0f} (features not stored); epochs not timed in emulated bf16")
                continue
            first, cached, epoch = epochs(args, dtype)
            print(f"  training tokens/s (non-padding tokens): not stored {off:.0f}, first epoch (stored as computed) "
                  f"{first:.0f}, later epochs (read back) {cached:.0f}; {epoch} steps per epoch", flush=True)

        result = overhead(args, tmp)
        plain = result["plain"]
        print(f"\nLightning's overhead on stored features (fp32, median ms per step, {args.rounds} x "
              f"{args.overhead_steps} steps each)")
        for side, ms in result.items():
            print(f"  {side:<24}{ms:8.1f}   {ms / plain - 1:+.1%} vs plain PyTorch")
    for path in set(features.glob("*")) - existing:  # the stored features this run wrote
        shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    main()
