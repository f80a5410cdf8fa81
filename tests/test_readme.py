"""Every Python block of README.md runs as written, so the README cannot drift from the code.

The blocks name the SmolLM2 target and files earlier README commands produce (a fit checkpoint under ``runs/``,
other checkpoints, a rollouts folder). Here they run verbatim except for the target name, which becomes the
packaged ``tiny-random``, in a folder holding the same files made from the tiny target: a real ``fit`` run for
the checkpoint under ``runs/<experiment>/<run>/checkpoints/`` and real rollouts.
"""

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
SMOLLM2 = "smollm2-135m-instruct"


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_target):
    """A folder with what the README's earlier commands leave behind, for the tiny target."""
    from fit_probe import fit_checkpoint

    from lightning_spec.cli import run_cli
    from lightning_spec.data.rollout_writer import generate_rollouts
    from lightning_spec.drafters import BlockDrafter
    from lightning_spec.sampling import SamplingConfig

    folder = tmp_path_factory.mktemp("readme")
    cwd, argv = Path.cwd(), sys.argv
    try:
        import os

        os.chdir(folder)
        sys.argv = ["lightning-spec"]
        run_cli(["fit", "-c", str(ROOT / "experiments" / "tiny.yaml"), "--trainer.max_steps=2",
                 "--trainer.val_check_interval=null", "--trainer.callbacks=[]", "--trainer.limit_val_batches=0",
                 "--trainer.enable_progress_bar=false"])
        for name, seed in (("a", 1), ("b", 2)):  # the checkpoints `evaluate` compares in the README
            torch.manual_seed(seed)
            drafter = BlockDrafter(block_size=3)
            drafter.bind(tiny_target)
            fit_checkpoint(drafter, folder / "runs" / name / "last.ckpt", "tiny-random")
        prompts = [{"id": f"p{i}", "domain": d, "subdomain": d, "prompt_ids": [5 + i, 17, 40 + i, 9]}
                   for i, d in enumerate(["chat", "code", "math", "chat"])]
        generate_rollouts(tiny_target, prompts, SamplingConfig(temperature=1.0), n_per_prompt=2, max_new_tokens=12,
                          out_dir=folder / "rollouts" / "t1", progress=False)
    finally:
        os.chdir(cwd)
        sys.argv = argv
    assert list(folder.glob("runs/*/*/checkpoints/last.ckpt")), "fit did not write runs/<exp>/<run>/checkpoints/"
    return folder


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, workspace, monkeypatch, capsys):
    code = BLOCKS[index]
    if SMOLLM2 in code:
        code = code.replace(SMOLLM2, "tiny-random")
    monkeypatch.chdir(workspace)
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip(), "every README block prints what it shows"
