"""DomainReweighting: the rule by hand, the sampler following validation MAL in a real fit, resume, bad args."""

import json
import math
from collections import Counter
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger

from lightning_spec.callbacks import DomainReweighting, EvaluationCallback, SpecDecodeValidation
from lightning_spec.callbacks.domain_weighting import _apply_floor
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.drafters import DFlashDrafter
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, ExpDecay, Objective


def shares(dm: SpecDataModule, per_example: dict[str, float]) -> dict[str, float]:
    """The share of the draws each domain gets when the sampler weighs every example by its domain's weight."""
    mass = Counter()
    for e in dm.train_dataset:
        mass[e["domain"]] += per_example[e["domain"]]
    return {d: m / sum(mass.values()) for d, m in mass.items()}


def close(got: dict | None, want: dict) -> bool:
    if got is None or got.keys() != want.keys():
        return False
    return all(math.isclose(got[k], want[k], abs_tol=1e-12) for k in want)


# ------------------------------------------------------------------------------------------- the rule


def test_weights_follow_inverse_mal_to_the_beta():
    mals = {"chat": 2.0, "code": 4.0, "math": 1.0}  # math has a MAL but no training data: ignored
    rule = DomainReweighting(beta=1.0, floor=0.0)
    domains = ["chat", "code"]
    assert close(rule.next_weights(mals, domains), {"chat": 2 / 3, "code": 1 / 3})
    assert close(DomainReweighting(beta=2.0, floor=0.0).next_weights(mals, domains), {"chat": 0.8, "code": 0.2})
    assert close(DomainReweighting(beta=0.0, floor=0.0).next_weights(mals, domains), {"chat": 0.5, "code": 0.5})
    # no training domain measured (or only non-finite / zero MALs): no update
    assert rule.next_weights({"math": 1.0, "chat": math.nan, "code": 0.0}, ["chat", "code"]) is None


def test_floor_keeps_ratios_and_cascades():
    # raw 1 : 1 : 1/8 -> c below 0.1 is raised to it, a and b share the remaining 0.9 equally
    rule = DomainReweighting(beta=1.0, floor=0.1)
    assert close(rule.next_weights({"a": 1.0, "b": 1.0, "c": 8.0}, ["a", "b", "c"]), {"a": 0.45, "b": 0.45, "c": 0.1})
    # clipping c scales b (0.151 * 0.85/0.86 = 0.1492) below the floor too: a second pass clips it
    assert close(_apply_floor({"a": 0.709, "b": 0.151, "c": 0.14}, 0.15), {"a": 0.7, "b": 0.15, "c": 0.15})
    assert close(_apply_floor({"a": 1.0, "b": 0.0}, 0.05), {"a": 0.95, "b": 0.05})
    with pytest.raises(ValueError, match=r"floor=0\.4 times 3 training domains exceeds 1; lower floor"):
        DomainReweighting(floor=0.4).next_weights({"a": 1.0}, ["a", "b", "c"])


def test_smoothing_is_an_ema_after_the_floor():
    rule = DomainReweighting(beta=1.0, floor=0.0, smoothing=0.5)
    previous = {"chat": 0.5, "code": 0.5}
    assert close(rule.next_weights({"chat": 2.0, "code": 4.0}, ["chat", "code"], previous),
                 {"chat": 7 / 12, "code": 5 / 12})  # 0.5·1/2 + 0.5·(2/3, 1/3)
    # rule -> floor -> smoothing: target (0.9, 0.1) floored to (0.8, 0.2), then 0.25·previous + 0.75·that
    rule = DomainReweighting(beta=1.0, floor=0.2, smoothing=0.25)
    assert close(rule.next_weights({"a": 1.0, "b": 9.0}, ["a", "b"], {"a": 0.5, "b": 0.5}), {"a": 0.725, "b": 0.275})
    # previous weights over other domains (the training data changed): start afresh, no smoothing
    assert close(rule.next_weights({"a": 1.0, "b": 9.0}, ["a", "b"], {"a": 1.0}), {"a": 0.8, "b": 0.2})


def test_a_training_domain_without_mal_keeps_its_weight():
    rule = DomainReweighting(beta=1.0, floor=0.0, smoothing=0.5)
    mals = {"chat": 2.0, "code": 4.0, "math": 1.0}
    domains = ["chat", "code", "legal"]
    # first time: legal scores the mean of the measured scores (1/2, 1/4 -> 3/8), then all are normalised
    assert close(rule.next_weights(mals, domains), {"chat": 4 / 9, "code": 2 / 9, "legal": 3 / 9})
    # later: legal keeps 0.6, chat and code split 0.4 as 2:1, then the EMA with the previous weights
    previous = {"chat": 0.2, "code": 0.2, "legal": 0.6}
    assert close(rule.next_weights(mals, domains, previous), {"chat": 7 / 30, "code": 5 / 30, "legal": 18 / 30})


def test_reads_only_its_own_metric_prefix():
    metrics = {"val/mal": 2.0, "val/mal/chat": 1.5, "val/mal/code": torch.tensor(2.5), "val/temp1/mal/chat": 9.0,
               "val/offline_mal/chat": 3.0, "val/accept_rate/t1": 0.4}
    assert DomainReweighting().read_mals(metrics) == {"chat": 1.5, "code": 2.5}
    assert DomainReweighting(metric="val/temp1/mal").read_mals(metrics) == {"chat": 9.0}
    assert DomainReweighting(metric="val/offline_mal").read_mals(metrics) == {"chat": 3.0}


def test_every_rank_uses_the_weights_broadcast_from_rank_zero():
    """A rank whose metrics differ (it should not happen: they are all-reduced) still applies rank 0's weights."""
    applied, broadcast = [], []
    rank0 = {"chat": 0.25, "code": 0.75}

    def from_rank_zero(obj, src):
        broadcast.append((obj, src))
        return dict(rank0)

    trainer = SimpleNamespace(
        callback_metrics={"val/mal/chat": 1.0, "val/mal/code": 4.0}, global_step=7, is_global_zero=False, loggers=[],
        strategy=SimpleNamespace(broadcast=from_rank_zero),
        datamodule=SimpleNamespace(set_domain_weights=applied.append),
    )
    rank1 = DomainReweighting(floor=0.0)
    rank1._domains, rank1._sizes = ["chat", "code"], {"chat": 10, "code": 30}
    rank1._update(trainer)
    assert broadcast == [({"chat": 0.8, "code": 0.2}, 0)]  # its own weights go in, rank 0's come out
    assert rank1.weights == rank0 and rank1.history == [(7, rank0)]
    assert applied == [{"chat": 0.025, "code": 0.025}]  # per example: share / domain size


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beta": -1.0}, r"DomainReweighting\.beta=-1\.0 must be >= 0"),
        ({"beta": math.inf}, r"DomainReweighting\.beta=inf must be >= 0"),
        ({"floor": 1.0}, r"DomainReweighting\.floor=1\.0 must be in \[0, 1\)"),
        ({"floor": -0.1}, r"DomainReweighting\.floor=-0\.1 must be in \[0, 1\)"),
        ({"smoothing": 1.0}, r"DomainReweighting\.smoothing=1\.0 must be in \[0, 1\)"),
        ({"metric": "val/mal/"}, r"DomainReweighting\.metric='val/mal/' must be a metric prefix"),
        ({"metric": ""}, r"DomainReweighting\.metric='' must be a metric prefix"),
    ],
)
def test_bad_arguments_are_one_clear_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        DomainReweighting(**kwargs)
    text = str(error.value)
    assert "\n" not in text and text.endswith(".")


# ---------------------------------------------------------------------------------------- real fits


class ScriptedValidation(SpecDecodeValidation):
    """SpecDecodeValidation whose decoding is replaced by a script of per-domain MALs, one entry per evaluation
    (the last entry repeats): the real logging path, a controlled metric."""

    def __init__(self, script: list[dict[str, float]]) -> None:
        super().__init__(print_summary=False)
        self.script = script
        self.calls = 0

    def evaluate(self, trainer, module, before_training=False):
        mals = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return {"val/mal": sum(mals.values()) / len(mals), **{f"val/mal/{d}": v for d, v in mals.items()}}


class OwnEvaluation(EvaluationCallback):
    """A user's evaluation, none of ours: it declares the per-domain MAL it logs, under a prefix of its own."""

    name = "own-evaluation"

    def __init__(self, mals: dict[str, float]) -> None:
        super().__init__(before_training=True)
        self.mals = mals

    def mal_prefixes(self) -> set[str]:
        return {"own/mal"}

    def evaluate(self, trainer, module, before_training=False):
        return {f"own/mal/{d}": v for d, v in self.mals.items()}


class RecordingDataModule(SpecDataModule):
    """Records the domain weights the sampler reads at the start of every epoch."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.drawn: list[tuple[int, dict | None]] = []

    def sample_weights(self):
        self.drawn.append((self.trainer.current_epoch, self.domain_weights))
        return super().sample_weights()


class DomainCounter(Callback):
    """The domain of every training example drawn, per epoch."""

    def __init__(self) -> None:
        self.seen: dict[int, Counter] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        names = trainer.datamodule.domains
        self.seen.setdefault(trainer.current_epoch, Counter()).update(names[i] for i in batch["domain_id"].tolist())

    def code_share(self, epoch: int) -> float:
        return self.seen[epoch]["code"] / sum(self.seen[epoch].values())


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chats(n: int, domain: str) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"{domain} {i}+{i + 2}?"},
                {"role": "assistant", "content": f"It is {2 * i + 2}."},
            ],
            "domain": domain,
        }
        for i in range(n)
    ]


@pytest.fixture
def data_args(tmp_path):
    """Training data in chat and code (twice as much chat); eval prompts also in math, which has no training data."""
    evals = [{"messages": [{"role": "user", "content": f"{d} prompt"}], "domain": d} for d in ("chat", "code", "math")]
    train = write_jsonl(tmp_path / "train.jsonl", chats(32, "chat") + chats(16, "code"))
    return dict(
        target="tiny-random", train_sources=[train],
        eval_sources=[write_jsonl(tmp_path / "eval.jsonl", evals)], train_limit=None, max_length=64, batch_size=8,
        val_fraction=0.2, eval_prompts_per_domain=1, seed=0,
    )


def module(target) -> DraftModule:
    torch.manual_seed(0)
    drafter = DFlashDrafter(block_size=2, num_layers=1, num_anchors=4)
    return DraftModule(drafter, Objective(KL(), ExpDecay(4.0)), target=target, lr=1e-3)


def trainer(callbacks, **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1)
    return L.Trainer(callbacks=callbacks, **{**defaults, **kwargs})


# before training chat accepts well and code badly; after epoch 0 the other way round
SCRIPT = [{"chat": 3.0, "code": 1.0, "math": 1.0}, {"chat": 1.0, "code": 3.0, "math": 5.0}]


def test_low_mal_domain_is_sampled_more_from_the_next_epoch(data_args, tiny_target):
    dm = RecordingDataModule(**data_args)
    reweight = DomainReweighting(beta=2.0, floor=0.05, smoothing=0.5)
    counter, memory = DomainCounter(), MemoryLogger()
    # DomainReweighting listed before the validation callback: the order must not matter
    fit = trainer([reweight, ScriptedValidation(SCRIPT), counter], max_epochs=2, logger=memory)
    fit.fit(module(tiny_target), datamodule=dm)

    # before training: code (MAL 1) gets (1/1)^2 : (1/3)^2 -> 0.9, chat 0.1 (math has no training data)
    # after epoch 0 (code 3, chat 1): target (0.9, 0.1), smoothed with (0.1, 0.9) -> (0.5, 0.5)
    # after epoch 1: the same target, smoothed with (0.5, 0.5) -> (0.7, 0.3)
    expected = [{"chat": 0.1, "code": 0.9}, {"chat": 0.5, "code": 0.5}, {"chat": 0.7, "code": 0.3}]
    assert [step for step, _ in reweight.history] == [0, fit.global_step // 2, fit.global_step]
    assert all(close(got, want) for (_, got), want in zip(reweight.history, expected, strict=True))
    # the sampler reads them at each epoch start: epoch 0 the pre-training weights, epoch 1 epoch 0's validation
    # ones; they are shares of the draws although there is twice as much chat as code
    assert [epoch for epoch, _ in dm.drawn] == [0, 1]
    assert close(shares(dm, dm.drawn[0][1]), expected[0]) and close(shares(dm, dm.drawn[1][1]), expected[1])
    assert close(shares(dm, dm.domain_weights), expected[2])
    # what was drawn: code dominates epoch 0 (a plain shuffle gives a third), then falls back
    n = len(dm.train_dataset)
    assert sum(counter.seen[0].values()) == sum(counter.seen[1].values()) == n  # epoch size = dataset size
    assert counter.code_share(0) > 0.75 and counter.code_share(1) < counter.code_share(0) - 0.2
    # logged at the step of each update, through the trainer's loggers
    logged = [(step, row) for step, row in memory.rows if "train/domain_weight/code" in row]
    assert [step for step, _ in logged] == [0, fit.global_step // 2, fit.global_step]
    assert all(set(row) == {"train/domain_weight/chat", "train/domain_weight/code"} for _, row in logged)
    assert math.isclose(logged[0][1]["train/domain_weight/code"], 0.9)


def test_weights_survive_resume(data_args, tiny_target, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    first = DomainReweighting(beta=2.0, floor=0.05, smoothing=0.5)
    dm = RecordingDataModule(**data_args)
    fit = trainer([first, ScriptedValidation(SCRIPT), ModelCheckpoint(dirpath=ckpt_dir, save_last=True)],
                  max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path)
    fit.fit(module(tiny_target), datamodule=dm)
    saved = {"chat": 0.7, "code": 0.3}  # as in the test above
    assert close(first.weights, saved)
    ckpt = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=False)
    assert close(ckpt["callbacks"]["DomainReweighting"]["weights"], saved)
    assert close(shares(dm, ckpt["RecordingDataModule"]["domain_weights"]), saved)

    # a fresh process: new callback, data module and module, one more epoch from the checkpoint
    resumed = DomainReweighting(beta=2.0, floor=0.05, smoothing=0.5)
    dm2 = RecordingDataModule(**data_args)
    validation = ScriptedValidation([{"chat": 1.0, "code": 3.0}])
    fit2 = trainer([resumed, validation], max_epochs=3, default_root_dir=tmp_path)
    fit2.fit(module(tiny_target), datamodule=dm2, ckpt_path=ckpt_dir / "last.ckpt")
    # the first resumed epoch (2) draws with the saved weights; no pre-training evaluation on resume
    assert dm2.drawn[0][0] == 2 and close(shares(dm2, dm2.drawn[0][1]), saved)
    assert validation.calls == 1 and len(resumed.history) == 4
    # the restored smoothing state: target (0.9, 0.1) averaged with the saved (0.7, 0.3), not applied afresh
    assert close(resumed.weights, {"chat": 0.8, "code": 0.2})
    assert close(shares(dm2, dm2.domain_weights), resumed.weights)


def test_single_training_domain_and_a_missing_metric(data_args, tiny_target, tmp_path):
    # sharegpt-style: chat-only training, eval prompts in chat, code and math -> nothing to re-weight, no crash
    data_args["train_sources"] = [write_jsonl(tmp_path / "chat.jsonl", chats(24, "chat"))]
    dm = RecordingDataModule(**data_args)
    reweight = DomainReweighting()
    with pytest.warns(UserWarning, match="single domain"):
        trainer([reweight, ScriptedValidation(SCRIPT)], max_epochs=1).fit(module(tiny_target), datamodule=dm)
    assert reweight.weights is None and dm.domain_weights is None and dm.drawn == [(0, None)]

    # a metric no callback of the run logs: refused before the first step
    dm = RecordingDataModule(**data_args)
    with pytest.raises(ValueError, match=r"DomainReweighting\.metric='val/offline_mal' is not logged by any callback"):
        trainer([DomainReweighting(metric="val/offline_mal"), ScriptedValidation(SCRIPT)], max_epochs=1).fit(
            module(tiny_target), datamodule=dm
        )


def test_any_callback_that_declares_the_metric_feeds_the_weights(data_args, tiny_target):
    """DomainReweighting asks the callbacks what they log; it knows none of them by class."""
    dm = RecordingDataModule(**data_args)
    reweight = DomainReweighting(metric="own/mal", beta=1.0, floor=0.0, smoothing=0.0)
    trainer([reweight, OwnEvaluation({"chat": 1.0, "code": 3.0})], max_epochs=1).fit(module(tiny_target), datamodule=dm)
    # (1/1) : (1/3) -> 0.75 : 0.25, before training and after the epoch's validation
    assert [step for step, _ in reweight.history] == [0, dm.trainer.global_step]
    assert close(reweight.weights, {"chat": 0.75, "code": 0.25})
    assert close(shares(dm, dm.domain_weights), reweight.weights)
