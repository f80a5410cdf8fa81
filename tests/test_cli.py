"""The CLI: every shipped YAML parses, a tiny fit logs to MLflow, and user errors are one clear sentence (a bad
``--ckpt_path``, a bad config value, a ``val_check_interval`` beyond the epoch)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import yaml
from helpers.cli import exit_code, last_error_line, local_data_args, run_main
from helpers.data import chats, write_jsonl
from helpers.overlays import config_files, meant_config, printed_config, printed_of, restated

from lightning_spec import load_drafter
from lightning_spec.cli import main
from lightning_spec.cli import run_cli as cli_raising
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.errors import DivergedLoss, UserError

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))
TINY = ROOT / "experiments" / "tiny.yaml"


# ------------------------------------------------------------------------------------- every YAML parses


def test_experiments_exist():
    assert TINY in EXPERIMENTS and len(EXPERIMENTS) >= 2


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_every_experiment_yaml_parses(path, in_tmp, capsys, monkeypatch):
    import transformers

    import lightning_spec.module

    def refuse(*args, **kwargs):
        raise AssertionError("--print_config must not load a model")

    # --print_config only parses and type-checks: the GPU example must never load Qwen3-8B
    monkeypatch.setattr(lightning_spec.module, "load_target", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    files = config_files(path)  # an overlay goes on the base its header names
    assert exit_code(["fit", *[arg for f in files for arg in ("-c", str(f))], "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    sources = [yaml.safe_load(f.read_text()).get("model", {}) for f in files]
    drafter = [s["drafter"]["class_path"] for s in sources if "class_path" in s.get("drafter", {})][-1]
    assert printed["model"]["drafter"]["class_path"] == drafter
    assert printed["model"]["target"] == [s["target"] for s in sources if "target" in s][-1]
    assert not list(in_tmp.iterdir())  # nothing written: no run, no checkpoint


DRAFTER_OVERLAYS = sorted((ROOT / "experiments" / "drafters").glob("*.yaml"))
REGIME_OVERLAYS = sorted((ROOT / "experiments" / "regimes").glob("*.yaml"))
OVERLAYS = [path for path in EXPERIMENTS if len(config_files(path)) > 1] + DRAFTER_OVERLAYS + REGIME_OVERLAYS


def test_every_drafter_family_has_an_overlay():
    """issue 11: every family is a YAML choice, ``fit -c experiments/quickstart.yaml -c experiments/drafters/<f>.yaml``
    (DFlash is the quickstart itself)."""
    from lightning_spec.drafters import FAMILIES

    assert {p.stem for p in DRAFTER_OVERLAYS} >= set(FAMILIES) - {"dflash"}  # the registry, not a list kept here
    for path in DRAFTER_OVERLAYS:
        assert config_files(path)[0] == ROOT / "experiments" / "quickstart.yaml", path.name


def test_every_training_regime_is_a_second_stage_overlay():
    """issue 13: each regime is ``fit -c experiments/quickstart.yaml -c experiments/regimes/<r>.yaml``, started from
    a first stage's checkpoint (``--model.init_from``), its header saying how long it takes on the CPU."""
    wanted = {"sft_then_opd", "adaflash", "eal_then_grpo", "wtv_then_grpo", "edr_finetune"}
    assert {p.stem for p in REGIME_OVERLAYS} >= wanted
    for path in REGIME_OVERLAYS:
        header = path.read_text().split("\n# lightning-spec fit", 1)
        assert config_files(path)[0] == ROOT / "experiments" / "quickstart.yaml", path.name
        assert "--model.init_from" in header[1].splitlines()[0] and "CPU time" in path.read_text(), path.name


def test_the_long_and_reweighting_runs_are_overlays():
    assert {p.stem for p in OVERLAYS} >= {"smollm2_long", "reweighting"}


@pytest.mark.parametrize("path", OVERLAYS, ids=[p.stem for p in OVERLAYS])
def test_experiment_overlays_say_only_what_differs(path):
    """An overlay restates nothing of its base, and ``fit -c base -c overlay`` builds the config its author means:
    its values in, a list or a class block of another class replacing the base's whole (tests/helpers/overlays.py says
    where LightningCLI's merge differs, and so what an overlay has to state)."""
    files = config_files(path)
    base = meant_config(files[:-1]) if len(files) > 1 else {}  # every file before it: what it lands on
    assert restated(yaml.safe_load(path.read_text()), base) == []
    assert printed_config(*files) == printed_of(meant_config(files))


# ------------------------------------------------------------------------------------------- a tiny fit


def test_a_drafter_that_cannot_be_logged_does_not_fail_the_finished_fit(in_tmp, capsys, monkeypatch):
    import lightning_spec.cli

    def broken(*args, **kwargs):
        raise RuntimeError("the artifact store is full")

    monkeypatch.setattr(lightning_spec.cli, "log_drafter", broken)
    assert exit_code(["fit", "-c", str(TINY), "--trainer.max_steps=1", "--trainer.callbacks=[]",
                      "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]) == 0
    out = capsys.readouterr().out
    assert "drafter: not logged to MLflow (RuntimeError: the artifact store is full); the checkpoint holds it" in out
    assert list(in_tmp.glob("runs/*/*/checkpoints/last.ckpt"))


def test_a_first_fit_prints_the_target_frozen_and_no_dependency_noise(in_tmp, capfd, caplog):
    """The model summary shows the frozen target in eval mode, and neither Lightning's cloud advertisements ("💡
    Tip: ... litlogger") nor its ``_pytree`` deprecation warning reach the output (``cli.quiet_dependencies``)."""
    import logging
    import warnings

    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert exit_code(["fit", "-c", str(TINY), "--trainer.max_steps=1", "--trainer.callbacks=[]",
                          "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                          "--trainer.enable_model_summary=true"]) == 0
    out, err = capfd.readouterr()
    summary = next(line for line in (out + err).splitlines() if " target " in line and "Target" in line)
    assert "eval" in summary and " train " not in summary
    assert "Tip:" not in out + err and "litlogger" not in out + err
    assert "Trainer.fit` stopped" in caplog.text and "Tip:" not in caplog.text  # its other lines still reach it
    assert not [w for w in caught if "LeafSpec" in str(w.message)]


def test_fit_tiny_logs_an_mlflow_run(in_tmp, capsys):
    import mlflow

    assert exit_code(["fit", "-c", str(TINY)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{in_tmp / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lightning_spec: tiny-random")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "tiny"  # named after the experiment file
    params = run.data.params
    assert params["target"] == "tiny-random" and params["max_length"] == "96" and params["lr"] == "0.001"
    metrics = run.data.metrics
    assert {"train/loss", "val/mal", "val/loss", "val/mal/chat", "val/accept_rate/t1", "val/temp1/mal"} <= set(metrics)
    assert metrics["val/mal"] >= 1.0  # tokens per round, bonus included
    mal_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/mal")]
    assert mal_steps == [0, 3, 6]  # before training, then every val_check_interval=3 of max_steps=6
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 6
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml"}  # the drafter once, below
    # the drafter itself, not only its curves, as the run's logged model (MLflow's Models column): the tiny fit's
    # DFlashDrafter is not the served DFlash layout, so its own folder with a card saying why it is not exported
    (model,) = client.search_logged_models(experiment_ids=[experiment.experiment_id])
    assert model.source_run_id == run.info.run_id and model.name == "dflash-K4" and model.status == "READY"
    assert run.data.tags["drafter_model"] == f"models:/{model.model_id}"
    assert [o.model_id for o in run.outputs.model_outputs] == [model.model_id]
    files = {a.path for a in client.list_logged_model_artifacts(model.model_id)}
    assert files == {"README.md", "drafter.json", "drafter.pt", "provenance.json"}
    assert run.data.tags["drafter_layout"].startswith("lightning_spec")
    folder = mlflow.artifacts.download_artifacts(f"models:/{model.model_id}", dst_path=str(in_tmp / "served"))
    card = (Path(folder) / "README.md").read_text()
    assert "not exported for serving" in card and "qk_norm" in card and "provenance.json" in card
    record = json.loads((Path(folder) / "provenance.json").read_text())  # the fit's config travels with the model
    assert record["fit"]["command"] == f"lightning-spec fit -c {TINY}" and "max_steps: 6" in record["fit"]["config"]
    assert load_drafter(folder).block_size == 4  # what a user downloads loads
    # the checkpoint holds a drafter that loads for its target by name
    (last,) = in_tmp.rglob("last.ckpt")
    drafter = load_drafter(last)
    assert drafter.block_size == 4 and drafter.target.vocab_size == 320
    # fit ends with where the checkpoint is and how to see the run, after the MAL table (printed at train end)
    assert out[-5:] == [
        f"checkpoint: {last.relative_to(in_tmp)}",
        f"drafter: MLflow logged model 'dflash-K4' of the run (models:/{model.model_id}), lightning_spec "
        "(drafter.json + drafter.pt)",
        f"MLflow run: {run.info.run_id} (experiment 'lightning_spec: tiny-random', id {experiment.experiment_id})",
        "see it: mlflow ui --backend-store-uri sqlite:///mlflow.db",
        f"compare the experiment's drafters: http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs"
        "?workflowType=machine_learning&viewStateShareKey=drafters",
    ]
    assert any(line.startswith("└") for line in out[:-5])  # the table's last border came before


def test_a_fit_records_what_drafters_are_compared_by(in_tmp):
    """One experiment per target, opened on its runs with the comparison view; every run carries the columns that
    compare drafters and its training data as its dataset input (issue 35)."""
    import json

    import mlflow

    from lightning_spec.tracking import COMPARISON_COLUMNS, EXPERIMENT_KIND

    assert exit_code(["fit", "-c", str(TINY), "--trainer.max_steps=2", "--trainer.val_check_interval=2"]) == 0
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{in_tmp / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lightning_spec: tiny-random")
    assert experiment.tags[EXPERIMENT_KIND[0]] == EXPERIMENT_KIND[1]
    view = json.loads(experiment.tags["mlflow.sharedViewState.drafters"])
    assert view["selectedColumns"] == COMPARISON_COLUMNS and view["orderByKey"] == "metrics.`val/mal`"
    (run,) = client.search_runs([experiment.experiment_id])
    params = run.data.params
    compared = (params["family"], params["objective"], params["K"], params["draft_vocab"])
    assert compared == ("dflash", "KL + ExpDecay", "4", "full")
    assert params["target"] == "tiny-random" and len(params["target_fingerprint"]) > 8
    assert int(params["train_examples"]) > 0 and run.data.metrics["steps"] == 2
    (data,) = run.inputs.dataset_inputs
    assert data.dataset.digest and json.loads(data.dataset.profile)["num_rows"] == int(params["train_examples"])
    assert [(t.key, t.value) for t in data.tags] == [("mlflow.data.context", "training")]


def test_fits_from_two_folders_in_one_process_log_to_their_own_stores(in_tmp, monkeypatch):
    """MLflow caches one store per URI string for the life of the process: the default relative
    ``sqlite:///mlflow.db`` must become this folder's file, or a second fit (a notebook, a test session) writes
    into the first folder's database."""
    from mlflow import MlflowClient

    quick = ["--trainer.max_steps=1", "--trainer.val_check_interval=null", "--trainer.callbacks=[]",
             "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]
    for name in ("a", "b"):
        (in_tmp / name).mkdir()
        monkeypatch.chdir(in_tmp / name)
        assert exit_code(["fit", "-c", str(TINY), *quick]) == 0
        client = MlflowClient(tracking_uri=f"sqlite:///{in_tmp / name / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("lightning_spec: tiny-random")
        assert experiment is not None and len(client.search_runs([experiment.experiment_id])) == 1, name


# ----------------------------------------------------------------------------------------------- errors


def short_chats(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
        for i in range(n)
    ]


def run_in_subprocesses(arg_lists: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    """The real console entry point, several at once (each pays ~8 s of imports; the cores overlap them)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    script = Path(sys.executable).parent / "lightning-spec"  # the installed console script
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_spec"]
    procs = [
        subprocess.Popen([*command, *args], cwd=cwd, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for args in arg_lists
    ]
    out = []
    for proc, args in zip(procs, arg_lists):
        stdout, stderr = proc.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    return out


def tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@pytest.mark.integration  # a subprocess: the process boundary is what it tests
def test_user_errors_in_the_console(tmp_path):
    """What a user sees on stderr: the last lines name the field (no bare torch/datasets traceback)."""
    bad_key = yaml.safe_load(TINY.read_text())
    bad_key["model"]["drafter"]["init_args"]["bogus"] = 1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad_key))
    block = ["fit", "-c", str(TINY), *local_data_args(tmp_path, short_chats(6)),
             "--model.drafter.init_args.block_size", "64", "--data.max_length", "32"]
    unknown, too_long = run_in_subprocesses([["fit", "-c", str(tmp_path / "bad.yaml")], block], tmp_path)

    assert unknown.returncode != 0
    assert "bogus" in tail(unknown.stderr) and "not accepted" in tail(unknown.stderr), unknown.stderr[-2000:]
    assert "Traceback" not in unknown.stderr

    assert too_long.returncode == 2
    last = tail(too_long.stderr, 1)
    assert last.startswith("lightning-spec: error: ") and "drafter.block_size=64" in last, last
    assert "data.max_length" in last and "Traceback" not in too_long.stderr, too_long.stderr[-2000:]


def test_empty_dataset_is_a_clear_error(in_tmp):
    for name, content in [("empty.jsonl", ""), ("unusable.jsonl", None)]:
        path = in_tmp / name
        if content is None:  # rows exist, but none opens with a user turn or has content
            write_jsonl(path, [{"messages": [{"role": "assistant", "content": "hi"}]},
                               {"messages": [{"role": "user", "content": "   "}]}])
        else:
            path.write_text(content)
        args = local_data_args(in_tmp, short_chats(2))
        args[1] = json.dumps([str(path)])
        with pytest.raises(ValueError, match=rf"data\.train_sources\[0\] \('.*{name}'\) gave no usable conversations"):
            cli_raising(["fit", "-c", str(TINY), *args])


def test_no_assistant_tokens_after_masking_is_a_clear_error(in_tmp):
    long_prompt = [
        {"messages": [{"role": "user", "content": f"{i} " + "x" * 200}, {"role": "assistant", "content": "ok"}]}
        for i in range(4)
    ]
    with pytest.raises(ValueError, match=r"no training conversation has an assistant token within data\.max_length=64"):
        cli_raising(["fit", "-c", str(TINY), *local_data_args(in_tmp, long_prompt), "--data.max_length", "64"])


def test_block_longer_than_sequence_is_a_clear_error_in_process(in_tmp):
    with pytest.raises(ValueError, match=r"drafter\.block_size=64 needs data\.max_length >= block_size \+ 2"):
        cli_raising(["fit", "-c", str(TINY), *local_data_args(in_tmp, short_chats(6)),
              "--model.drafter.init_args.block_size", "64", "--data.max_length", "32"])


def test_drafter_for_another_vocabulary_is_a_clear_error(tmp_path, make_random_llama):
    from lightning_spec.checkpoint import save_drafter
    from lightning_spec.drafters import DFlashDrafter

    drafter = DFlashDrafter(block_size=2, num_layers=1)
    drafter.bind(make_random_llama(vocab_size=96))
    folder = save_drafter(drafter, tmp_path / "drafter", target_spec="random-96")
    with pytest.raises(ValueError, match=r"96-token vocabulary, but this target has 320.*'random-96'"):
        load_drafter(folder, target="tiny-random")


def test_a_diverging_fit_stops_with_one_sentence(in_tmp, capsys):
    # lr 1e30: the first AdamW step blows the drafter up and the next loss is NaN
    args = ["fit", "-c", str(TINY), "--model.lr=1e30", "--model.warmup_ratio=0", "--trainer.logger=false"]
    assert exit_code(args) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lightning-spec: error: train/loss is not finite (nan) at step 1: ") and "model.lr" in last


def test_the_progress_bar_counts_steps_not_an_endless_epoch_range():
    """With ``max_epochs`` -1 (training bounded by steps or time) Lightning's bar would read "Epoch 2/-2"; ours names
    the epoch alone and shows the step out of ``max_steps``."""
    from types import SimpleNamespace

    from lightning_spec.cli import StepProgressBar

    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1, max_steps=500, global_step=7)
    assert bar._get_train_description(2).strip() == "Epoch 2"
    bar._trainer.max_epochs = 5
    assert bar._get_train_description(2).strip() == "Epoch 2/4"
    trainer = SimpleNamespace(max_steps=500, global_step=7, progress_bar_metrics={"train/loss": 3.4}, loggers=[])
    assert bar.get_metrics(trainer, None) == {"step": "7/500", "train/loss": 3.4}


# ------------------------------------------------------------------------------- one sentence for a bad fit
def test_fit_ckpt_path_to_a_missing_or_empty_file_is_one_sentence(in_tmp, capsys):
    (in_tmp / "empty.ckpt").write_bytes(b"")  # an interrupted copy
    for path, sentence in [
        ("runs/nothing/last.ckpt", "--ckpt_path 'runs/nothing/last.ckpt' does not exist; pass the path of a .ckpt "
         "written by `lightning-spec fit` (e.g. runs/<experiment id>/<run id>/checkpoints/last.ckpt)."),
        ("empty.ckpt", "--ckpt_path 'empty.ckpt' is an empty file"),
    ]:
        assert exit_code(["fit", "-c", str(TINY), "--ckpt_path", path]) == 2
        err = capsys.readouterr().err
        assert last_error_line(err).startswith("lightning-spec: error: " + sentence), err[-2000:]
        assert "Traceback" not in err
    assert not (in_tmp / "mlflow.db").exists()  # refused before any run was started


@pytest.mark.parametrize(
    "option, says",
    [
        # 85 lines of nested Union alternatives before, the cause at the bottom
        ("--model.objective.init_args.loss=lightning_spec.objectives.NoSuchLoss",
         "model.objective.loss: module 'lightning_spec.objectives' has no attribute 'NoSuchLoss'"),
        ("--model.lr=-1", "model.lr is -1.0; it must be a learning rate > 0"),  # torch's "Invalid learning rate" before
        ("--model.lr=abc", "model.lr: Expected a <class 'float'>"),
        ("--model.no_such_option=3", "unrecognized arguments: --model.no_such_option=3"),
    ],
)
def test_a_bad_config_value_is_one_line(in_tmp, capsys, option, says):
    code = exit_code(["fit", "-c", str(TINY), option, "--trainer.logger=false", "--trainer.max_steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("lightning-spec: error: ") and says in err[-1]
    assert not any("Traceback" in line or line.startswith("usage:") for line in err)


# ------------------------------------------------------------------------- val_check_interval beyond an epoch
def test_val_check_interval_beyond_the_epoch_names_the_field_and_the_batch_count(tiny_target, tmp_path):
    """Was Lightning's ValueError from inside its fit loop (a traceback in the console)."""
    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.module import DraftModule

    train = write_jsonl(tmp_path / "train.jsonl", chats(20))
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    dm = SpecDataModule(target="tiny-random", train_sources=[train], eval_sources=[evals], train_limit=None,
                        max_length=48, batch_size=4, val_fraction=0.2)
    module = DraftModule(DFlashDrafter(block_size=2, num_layers=1, num_anchors=4), target="tiny-random",
                         feature_cache="off")
    trainer = L.Trainer(accelerator="cpu", max_steps=2, val_check_interval=50, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"trainer\.val_check_interval=50 is more than the 4 training batches of an "
                                         r"epoch .*lower it to at most 4, or set trainer\.check_val_every_n_epoch"):
        trainer.fit(module, datamodule=dm)
    # counted across epochs (check_val_every_n_epoch=None), the same interval is Lightning's to run
    dm.trainer = L.Trainer(val_check_interval=50, check_val_every_n_epoch=None, logger=False)
    assert len(dm.train_dataloader()) == 4


def test_val_check_interval_beyond_the_epoch_in_the_console_is_one_line(in_tmp, capsys):
    train = write_jsonl(in_tmp / "train.jsonl", chats(8))
    evals = write_jsonl(in_tmp / "eval.jsonl", [{"messages": [{"role": "user", "content": "Say something."}]}])
    code, err = run_main(
        ["fit", "-c", str(TINY), "--data.train_sources", json.dumps([train]), "--data.eval_sources",
         json.dumps([evals]), "--data.val_fraction", "0.25", "--trainer.logger", "false",
         "--trainer.val_check_interval", "40", "--trainer.num_sanity_val_steps", "0"],
        capsys,
    )
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert last.startswith("lightning-spec: error: trainer.val_check_interval=40 is more than the 2 training"), last


# ------------------------------------------------------------------------------------ commands as objects
def test_a_command_reads_the_same_options_from_a_yaml_file_and_from_flags(in_tmp, monkeypatch):
    """``evaluate``'s options are the fields of the ``Evaluate`` command: a ``-c`` YAML file and the same values as
    flags build one and the same command (nested classes instantiated, the rest at their defaults), and
    ``run_command`` returns what its ``run()`` returns."""
    from lightning_spec.cli import run_command
    from lightning_spec.decoding.plans import Tree
    from lightning_spec.evaluation.cli import Evaluate
    from lightning_spec.target import TargetOptions

    ran = []
    monkeypatch.setattr(Evaluate, "run", lambda self: ran.append(self) or "ran")
    values = {"drafters": ["runs/a/last.ckpt", "runs/b/last.ckpt"], "mode": "online", "names": ["a", "b"],
              "baseline": "b", "target_options": {"revision": "main"}, "sources": ["mt-bench"], "temperature": 0.5,
              "decoding": {"kind": "tree", "nodes": 8, "top_k": 2}}
    Path("evaluate.yaml").write_text(yaml.safe_dump(values))
    flags = [f"--{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in values.items()]
    assert run_command("evaluate", ["-c", "evaluate.yaml"]) == run_command("evaluate", flags) == "ran"
    from_file, from_flags = ran
    assert from_file == from_flags
    assert from_file.plans() == [Tree(nodes=8, top_k=2)] * 2 and from_file.target_options == TargetOptions("main")
    assert (from_file.prompts_per_source, from_file.output) == (8, "evaluation.json")
    assert from_file.bootstrap().baseline == "b"


# ------------------------------------------------------------------------------------------ errors by kind
def test_a_user_error_in_the_console_is_one_sentence_and_status_2(in_tmp, capsys, monkeypatch):
    """A ``UserError`` the package raises (``evaluate``'s own check of ``--drafters``) is its one sentence."""
    monkeypatch.delenv("LIGHTNING_SPEC_TRACEBACK", raising=False)
    code, err = run_main(["evaluate", "--drafters", "[]"], capsys)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert last_error_line(err) == ("lightning-spec: error: --drafters is empty; pass one or more checkpoints, e.g. "
                                    "--drafters '[runs/a/last.ckpt]'.")
    monkeypatch.setenv("LIGHTNING_SPEC_TRACEBACK", "1")  # the traceback on request
    with pytest.raises(UserError, match="--drafters is empty"):
        main(["evaluate", "--drafters", "[]"])


def boom(*args, **kwargs):
    raise ValueError("boom")


def internal_invariant(*args, **kwargs):
    """A plain ValueError raised inside the package (its last frame in lightning_spec/): still a bug."""
    from lightning_spec.paired import _clusters

    _clusters(["p", "p"], ["chat", "code"])


@pytest.mark.parametrize("raiser, says", [(boom, "boom"), (internal_invariant, "appears in two domains")])
def test_a_plain_value_error_is_a_bug_and_keeps_its_traceback(in_tmp, monkeypatch, raiser, says):
    import lightning_spec.evaluation.cli as evaluation_cli

    monkeypatch.delenv("LIGHTNING_SPEC_TRACEBACK", raising=False)
    monkeypatch.setattr(evaluation_cli, "arm_names", raiser)  # reached after evaluate's own checks pass
    with pytest.raises(ValueError, match=says) as caught:  # not SystemExit: main lets it through
        main(["evaluate", "--drafters", "[runs/a/last.ckpt]"])
    assert not isinstance(caught.value, UserError)


def test_a_diverged_loss_is_a_user_error_and_a_floating_point_error():
    err = DivergedLoss("train/loss is not finite (nan) at step 1")
    assert isinstance(err, UserError) and isinstance(err, FloatingPointError) and isinstance(err, ValueError)
    with pytest.raises(FloatingPointError):  # what caught the module's FloatingPointError still does
        raise err
