"""What the metric callbacks share: sums added across ranks before any ratio, the per-domain MAL they declare,
state that older checkpoints load, and the final table printed after the progress bar has stopped."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers.fits import TINY

from lightning_spec import SamplingConfig, generate
from lightning_spec.callbacks import DomainReweighting, MetricsCallback, OfflineEvaluation, SpecDecodeValidation
from lightning_spec.decoding.timed import decode_prompts
from lightning_spec.metrics import acceptance_metrics, acceptance_sums, reduce_sums, slot_counts

# ------------------------------------------------------------------------------------------- ratios of sums


class RankZeroOfTwo:
    """A trainer stand-in for rank 0 of 2 ranks: its all-reduce adds the other rank's packed sums."""

    world_size = 2

    def __init__(self, other: dict[str, torch.Tensor]) -> None:
        self.other = torch.cat([v.double().reshape(-1) for v in other.values()])
        self.strategy = SimpleNamespace(root_device=torch.device("cpu"), reduce=self.reduce)

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "sum" and tensor.shape == self.other.shape
        return tensor + self.other


def test_slot_counts_by_hand():
    # rounds that accepted 0, 2 and 1 drafts of K = 3: all reach slot 1, two reach slot 2, one reaches slot 3
    accepted, reached = slot_counts([0, 2, 1], block_size=3)
    assert accepted.tolist() == [2.0, 1.0, 0.0] and reached.tolist() == [3.0, 2.0, 1.0]


def test_ranks_add_their_sums_before_any_ratio():
    domains = ["chat", "code"]
    k = torch.tensor  # rank 0 decoded chat only; rank 1 chat and code
    rank0 = acceptance_sums({"chat": (10.0, 5.0)}, k([4.0, 1.0]), k([5.0, 4.0]), domains)
    rank1 = acceptance_sums({"chat": (2.0, 2.0), "code": (6.0, 4.0)}, k([2.0, 0.0]), k([5.0, 2.0]), domains)
    got = acceptance_metrics(reduce_sums(RankZeroOfTwo(rank1), rank0), domains, "val/mal", "val/accept_rate")
    want = {"val/mal": 18 / 11, "val/mal/chat": 12 / 7, "val/mal/code": 6 / 4,
            "val/accept_rate/t1": 6 / 10, "val/accept_rate/t2": 1 / 6}
    assert got == pytest.approx(want, rel=1e-12) and list(got) == list(want)
    # not the mean of the ranks' own MALs (2 and 4/3)
    assert got["val/mal"] != pytest.approx((10 / 5 + 8 / 6) / 2)
    # one process: the sums themselves
    one = acceptance_metrics(reduce_sums(SimpleNamespace(world_size=1), rank0), domains, "m", "r")
    assert one == pytest.approx({"m": 2.0, "m/chat": 2.0, "m/code": 0.0, "r/t1": 0.8, "r/t2": 0.25})


def test_decode_report_holds_the_sums_of_its_generations(tiny_target, make_block_drafter):
    drafter = make_block_drafter(tiny_target, block_size=3)
    prompts = [{"prompt_ids": [5 + i, 9, 11 + i], "domain": d} for i, d in enumerate(["chat", "code", "chat"])]
    report = decode_prompts(tiny_target, drafter, prompts, SamplingConfig(temperature=1.0), 8, seed=4)
    gens = [generate(tiny_target, p["prompt_ids"], 8, SamplingConfig(temperature=1.0), drafter=drafter, seed=4 + i)
            for i, p in enumerate(prompts)]
    chat, code = [gens[0], gens[2]], [gens[1]]
    assert report.domain_sums() == {
        "chat": (float(sum(len(g.tokens) for g in chat)), float(sum(g.rounds for g in chat))),
        "code": (float(len(code[0].tokens)), float(code[0].rounds)),
    }
    assert report.tokens == sum(len(g.tokens) for g in gens) and report.rounds == sum(g.rounds for g in gens)
    accepted, reached = slot_counts([a for g in gens for a in g.accept_lengths], 3)
    assert torch.equal(report.slot_accepted, accepted) and torch.equal(report.slot_reached, reached)
    assert report.mal == pytest.approx(report.tokens / report.rounds)


# ------------------------------------------------------------------------------------------ declared and saved


def test_every_producer_declares_the_per_domain_mal_it_logs():
    two = SpecDecodeValidation(sampling=[SamplingConfig(), SamplingConfig(temperature=1.0)])
    assert two.mal_prefixes() == {"val/mal", "val/temp1/mal"}
    assert OfflineEvaluation("rollouts").mal_prefixes() == {"val/offline_mal"}
    assert DomainReweighting().mal_prefixes() == set()  # it logs weights, not a MAL
    assert all(isinstance(cb, MetricsCallback) for cb in (two, OfflineEvaluation("r"), DomainReweighting()))


def test_state_saved_before_the_common_base_still_loads():
    """The keys each callback wrote into checkpoints before the callbacks shared a base."""
    history = [(0, {"val/mal": 1.25, "val/mal/chat": 1.5}), (3, {"val/mal": 1.5, "val/mal/chat": 1.75})]
    for callback in (SpecDecodeValidation(), OfflineEvaluation("rollouts")):
        callback.load_state_dict({"history": history})
        assert callback.history == history and callback.last_step == 3
        assert callback.state_dict() == {"history": history}
    weights = {"chat": 0.25, "code": 0.75}
    reweight = DomainReweighting()
    reweight.load_state_dict({"weights": weights, "history": [(3, weights)]})
    assert reweight.weights == weights and reweight.last_step == 3
    assert reweight.state_dict() == {"weights": weights, "history": [(3, weights)]}
    assert SpecDecodeValidation().last_step is None


# ----------------------------------------------------------------------------------------- the final table


def run_tiny(cwd: Path, command: str, terminal: bool) -> subprocess.CompletedProcess:
    """``lightning-spec <command> -c experiments/tiny.yaml`` with the rich progress bar and the table on, its
    output piped (rich draws the bar once, when it stops) or drawn as on a terminal (live, redrawn in place)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", COLUMNS="120")
    if terminal:
        env.update(TTY_COMPATIBLE="1", TTY_INTERACTIVE="1")
    cmd = [sys.executable, "-m", "lightning_spec", command, "-c", str(TINY), "--trainer.logger=false",
           "--trainer.enable_progress_bar=true"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.integration  # a subprocess: the process boundary is what it tests
@pytest.mark.parametrize(("command", "terminal", "bar"), [("fit", False, "Epoch"), ("fit", True, "Epoch"),
                                                           ("validate", False, "Validation")],
                         ids=["fit-piped", "fit-terminal", "validate-piped"])
def test_the_table_is_printed_after_the_progress_bar_stopped(tmp_path, command, terminal, bar):
    """Before: the table was printed while the bar was live, and the bar's final frame (``Epoch 4/-2 ━━ 13/96``)
    followed it; ``validate`` printed no table at all."""
    run = run_tiny(tmp_path, command, terminal)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    title = out.index("Mean accepted length")
    assert bar in out[:title]  # the bar was drawn before the table
    end = out.index("\n", out.rindex("-> speedup"))  # the table's last line
    assert "│ all " in out[title:end]
    assert bar not in out[end:] and "━" not in out[end:], out[end:]
    if command == "fit":  # the steps the budget bought, and which budget ended training
        assert "training: 6 optimizer steps (trainer.max_steps=6 reached; decoding before and after not" in out[end:]


def test_decoding_before_training_takes_none_of_the_max_time_budget(tmp_path, monkeypatch):
    """The evaluation before training runs in on_fit_start, before Lightning's Timer starts the training clock at
    on_train_start: with max_time, the untrained drafter's decoding is not paid for with training steps. Lightning's
    Timer reads an injected clock that the evaluation before training moves by 1000 s."""
    import lightning.pytorch.callbacks.timer as timer
    from helpers.clock import FakeClock
    from lightning.pytorch.callbacks import Timer

    from lightning_spec.cli import run_cli

    clock = FakeClock()
    monkeypatch.setattr(timer, "time", clock)
    ended: list[float] = []
    evaluate = SpecDecodeValidation.evaluate

    def timed(self, trainer, module, before_training=False):
        metrics = evaluate(self, trainer, module, before_training=before_training)
        if before_training:
            clock.advance(1000.0)
            ended.append(clock.now)
        return metrics

    monkeypatch.setattr(SpecDecodeValidation, "evaluate", timed)
    monkeypatch.chdir(tmp_path)
    seen = {}

    class Spy(Timer):  # the Timer max_time makes, observed when training ends
        def on_train_end(self, trainer, pl_module):
            super().on_train_end(trainer, pl_module)
            seen["start"] = self.start_time("train")

    monkeypatch.setattr("lightning.pytorch.trainer.connectors.callback_connector.Timer", Spy)
    run_cli(["fit", "-c", str(TINY), "--trainer.logger=false", "--trainer.max_time=00:00:10:00",
             "--trainer.max_steps=2", "--trainer.enable_progress_bar=false"], exit_on_error=False)
    assert ended and seen["start"] >= ended[0]  # the training clock started after the evaluation ended


def test_the_summary_prints_the_training_time_the_budget_counted(tmp_path, monkeypatch, capsys):
    """The summary line's seconds are what max_time's Timer counted when training ended, not the decoding after it:
    with Lightning's Timer on an injected clock, each batch takes 1 s and each evaluation 1000 s, so 3 steps are
    "3 s of training" (the Timer stops its clock only in its own on_train_end, after this callback's evaluation). No
    validation runs inside training, as in the quickstart: a validation there is training time the Timer counts."""
    import lightning.pytorch.callbacks.timer as timer
    from helpers.clock import FakeClock

    from lightning_spec.cli import run_cli

    clock = FakeClock()
    monkeypatch.setattr(timer, "time", clock)
    evaluate = SpecDecodeValidation.evaluate

    def slow(self, trainer, module, before_training=False):
        clock.advance(1000.0)
        return evaluate(self, trainer, module, before_training=before_training)

    class Second(L.Callback):
        def on_train_batch_start(self, *args, **kwargs):
            clock.advance(1.0)

    monkeypatch.setattr(SpecDecodeValidation, "evaluate", slow)
    monkeypatch.chdir(tmp_path)
    run_cli(["fit", "-c", str(TINY), "--trainer.logger=false", "--trainer.max_time=00:00:10:00",
             "--trainer.max_steps=3", "--trainer.val_check_interval=null", "--trainer.check_val_every_n_epoch=1000",
             "--trainer.enable_progress_bar=false"],
            callbacks=[Second()], exit_on_error=False)
    out = capsys.readouterr().out
    assert "training: 3 optimizer steps in 3 s of training (trainer.max_steps=3 reached" in out, out[-400:]


def test_offline_before_decodes_nothing_before_training(tmp_path, monkeypatch, capsys):
    """``offline_before``: no prompt is decoded before training, and step 0 is still in the history and the table."""
    import lightning_spec.callbacks.spec_validation as spec_validation
    from lightning_spec.cli import run_cli

    monkeypatch.chdir(tmp_path)
    decoded_at: list[int] = []
    decode = spec_validation.decode_prompts

    class Steps(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            self.trainer = trainer

    steps = Steps()

    def counting(*args, **kwargs):
        decoded_at.append(steps.trainer.global_step)
        return decode(*args, **kwargs)

    monkeypatch.setattr(spec_validation, "decode_prompts", counting)
    callback = SpecDecodeValidation(prompts_per_domain=1, max_new_tokens=12, measure_speedup=False,
                                    sampling=[SamplingConfig(), SamplingConfig(temperature=1.0)], offline_before=True)
    run_cli(["fit", "-c", str(TINY), "--trainer.logger=false", "--trainer.max_steps=3",
             "--trainer.val_check_interval=null", "--trainer.check_val_every_n_epoch=1000",
             "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]",
             "--trainer.enable_checkpointing=false"], callbacks=[steps, callback], exit_on_error=False)
    assert decoded_at == [3, 3]  # greedy and T=1 after training, nothing before
    out = capsys.readouterr().out
    assert "greedy before" in out and "before: the untrained drafter scored exactly (offline)" in out
    assert [s for s, _ in callback.history] == [0, 3]
    assert {"val/mal", "val/mal/chat", "val/temp1/mal", "val/accept_rate/t1"} <= set(callback.history[0][1])


def test_offline_before_scores_the_initial_weights_as_decoding_with_them_would(diverse_target, prompts):
    """The drafter before training is scored on the answers the evaluation after it decoded: its greedy MAL, per
    domain and pooled, equals decoding with it. Here the weights kept at the start are a trained drafter's (MAL well
    above 1) and the live ones a fresh drafter's, so scoring the wrong ones fails. (Per-slot acceptance is the offline
    evaluator's expectation: the budget's last round, cut short in decoding, can differ.)"""
    from helpers.families import build, trained

    from lightning_spec.decoding.timed import decode_prompts

    start = trained("dflash", diverse_target, prompts, k=3)
    rows = [{"prompt_ids": p, "domain": d} for p, d in zip(prompts, ["chat", "code", "chat"])]
    before = decode_prompts(diverse_target, start, rows, SamplingConfig(), 16)
    assert before.mal > 1.5  # the check has power: a fresh drafter is near 1
    live = build("dflash", diverse_target, 3, seed=1).eval()
    callback = SpecDecodeValidation(offline_before=True)
    callback._initial = {k: v.clone() for k, v in start.state_dict().items()}
    kept = {k: v.clone() for k, v in live.state_dict().items()}
    trainer = SimpleNamespace(world_size=1, is_global_zero=True, loggers=[], callback_metrics={})
    after = decode_prompts(diverse_target, live, rows, SamplingConfig(), 16)
    callback._score_initial(trainer, SimpleNamespace(target=diverse_target, drafter=live), [after], ["chat", "code"])
    ((step, scored),) = callback.history
    assert step == 0 and callback._initial is None
    assert scored["val/mal"] == pytest.approx(before.mal, abs=1e-9)
    assert scored["val/mal/chat"] == pytest.approx(before.mal_by_domain["chat"], abs=1e-9)
    assert scored["val/mal/code"] == pytest.approx(before.mal_by_domain["code"], abs=1e-9)
    assert all(torch.equal(v, live.state_dict()[k]) for k, v in kept.items())  # the live weights are back


def test_validation_auto_over_dtypes_logs_the_fastest_plain_and_trains_on_against_float32(tmp_path, monkeypatch):
    """``decoding: {kind: auto, dtypes: [float32, bfloat16]}`` in the callback after training: the pick decodes in its
    dtype, plain decoding in the dtype auto found fastest is timed for ``val/auto/speedup`` (on every rank: the
    configuration decides, not a rank's pick), and the drafter is bound to the float32 target again afterwards."""
    from lightning_spec.cli import run_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])

    class Keep(L.Callback):
        def on_fit_end(self, trainer, pl_module):
            self.module = pl_module

    keep = Keep()
    callback = SpecDecodeValidation(prompts_per_domain=1, max_new_tokens=8, before_training=False,
                                    decoding={"kind": "auto", "dtypes": ["float32", "bfloat16"]},
                                    calibration_prompts_per_domain=2)
    run_cli(["fit", "-c", str(TINY), "--trainer.logger=false", "--trainer.max_steps=2",
             "--trainer.val_check_interval=null", "--trainer.check_val_every_n_epoch=1000",
             "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
             "--data.eval_prompts_per_domain=3"], callbacks=[callback, keep], exit_on_error=False)
    (step, metrics), = callback.history
    assert step == 2 and callback.choice.dtypes == ["float32", "bfloat16"]
    assert callback.choice.plain_dtype in ("float32", "bfloat16") and metrics["val/auto/plain/tokens_per_s"] > 0
    assert metrics["val/auto/speedup"] == pytest.approx(metrics["val/auto/tokens_per_s"]
                                                        / metrics["val/auto/plain/tokens_per_s"])
    module = keep.module
    assert module.drafter.target is module.target and module.target.dtype == torch.float32
