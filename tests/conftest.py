"""Shared fixtures: tiny CPU targets and drafters whose acceptance we control, the CLI run in tmp_path, data files
and a short trained fit.

Every model here is tiny (2 layers, hidden <= 64) so the whole suite runs on a 2-core laptop.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# The CLI and benchmark processes the tests start compute on one thread, as the workers do (below): two
# OpenMP pools on 2 cores spin on each other (the 10 benchmark tests: 219 s -> 186 s on 2 workers, Zen 3 EPYC).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "LIGHTNING_SPEC_DATA_CACHE" not in os.environ:  # tokenised sets of this run's test data: not the user's cache
    import tempfile

    os.environ["LIGHTNING_SPEC_DATA_CACHE"] = tempfile.mkdtemp(prefix="lightning-spec-data-")

import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers.data import conversations, write_jsonl  # noqa: E402
from helpers.decoding import random_prompts  # noqa: E402
from helpers.fits import quiet_trainer  # noqa: E402

from lightning_spec import load_target  # noqa: E402
from lightning_spec.datamodule import SpecDataModule  # noqa: E402
from lightning_spec.decoding.proposals import ChainProposal  # noqa: E402
from lightning_spec.drafters import DFlashDrafter, Drafter  # noqa: E402
from lightning_spec.module import DraftModule  # noqa: E402
from lightning_spec.objectives import KL, ExpDecay, Objective  # noqa: E402
from lightning_spec.target import Target  # noqa: E402

# Tensors here are a few KB: intra-op threads only add synchronisation (measured ~100x slower decoding with
# the default thread count while another job shares the 2 cores).
torch.set_num_threads(1)


INTEGRATION = os.path.join(os.path.dirname(__file__), "integration")


def pytest_collection_modifyitems(config, items) -> None:
    """Every test under tests/integration/ is an integration test (``make test-fast`` leaves them out)."""
    for item in items:
        if str(item.path).startswith(INTEGRATION):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tiny_target() -> Target:
    """The packaged ``tiny-random`` target: 2 layers, hidden 64, vocab 320, byte tokenizer with ChatML."""
    return load_target("tiny-random")


def random_llama(vocab_size: int = 96, hidden_size: int = 32, init: float = 0.3, seed: int = 0, eos=None) -> Target:
    """A tiny random Llama wrapped as a ``Target`` (no tokenizer).

    ``tiny-random`` is so sharpened that its greedy continuation repeats the last prompt token forever; with
    ``init`` ~0.3 the greedy continuation varies from token to token and the top-2 logit gap stays >~1e-2,
    far above the float noise between a one-token forward and a block forward.
    ``eos=None`` gives a model that never stops (``target.eos_token_ids == []``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4 if hidden_size >= 32 else 2,
        num_key_value_heads=2 if hidden_size >= 32 else 1,
        initializer_range=init,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return Target(LlamaForCausalLM(config), name=f"random-llama-v{vocab_size}-h{hidden_size}-s{seed}")


@pytest.fixture(scope="session")
def diverse_target() -> Target:
    return random_llama()


@pytest.fixture(scope="session")
def prompts(diverse_target: Target) -> list[list[int]]:
    """Three random prompts (1, 6 and 13 tokens) in ``diverse_target``'s vocabulary, the same in every module
    (a module that wants others defines its own ``prompts``)."""
    return random_prompts(diverse_target.vocab_size)


def block_drafter(target: Target, block_size: int = 4, seed: int = 0, **kwargs) -> DFlashDrafter:
    """A freshly initialised (untrained) ``DFlashDrafter`` bound to ``target``, in eval mode."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(block_size=block_size, num_layers=kwargs.pop("num_layers", 1), **kwargs)
    drafter.bind(target)
    return drafter.eval()


class ReferenceDrafter(DFlashDrafter):
    """Proposes the target's own greedy continuation with one slot corrupted, so acceptance varies in 0..K.

    ``reference`` is prompt + the plain greedy continuation (computed by plain decoding). A round whose
    anchor sits at position ``n = state.length`` proposes ``reference[n + 1 : n + 1 + K]`` with slot
    ``j = 7 n mod (K + 2)`` (0-based) replaced by another token: a correct engine accepts exactly ``j`` drafts,
    or all K plus the bonus when ``j >= K``. The DFlashDrafter machinery still runs (``super().propose`` on
    the incremental state), and ``snapshots`` record the state the engine built, for consistency checks.
    """

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size=block_size, num_layers=1)
        self.reference: list[int] = []
        self.snapshots: list[tuple[int, list[torch.Tensor]]] = []

    def propose(self, state, anchor, sampling, generator=None) -> ChainProposal:
        super().propose(state, anchor, sampling, generator)  # exercises the KV state; its tokens are ignored
        self.snapshots.append((state.length, [k.clone() for k in state.keys]))
        n, k, vocab = state.length, self.block_size, self.target.vocab_size
        bad = (7 * n) % (k + 2)
        tokens = []
        for j in range(k):
            ref = self.reference[n + 1 + j] if n + 1 + j < len(self.reference) else 0
            tokens.append((ref + 1) % vocab if j == bad else ref)
        return ChainProposal(tokens=torch.tensor(tokens, device=anchor.device))


def reference_drafter(target: Target, block_size: int, reference: list[int]) -> ReferenceDrafter:
    torch.manual_seed(0)
    drafter = ReferenceDrafter(block_size)
    drafter.bind(target)
    drafter.reference = list(reference)
    return drafter.eval()


class FixedDrafter(Drafter):
    """Ignores its context: slot ``t`` always proposes from a fixed random distribution q_t over the vocabulary.

    For the lossless-sampling tests: q differs a lot from the target's p, so both acceptance and the
    residual path fire. Greedy proposals are argmax q_t.
    """

    def __init__(self, target: Target, block_size: int, scale: float = 1.0, seed: int = 1) -> None:
        super().__init__(block_size, target_layers=[0])
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(block_size, target.vocab_size, generator=g) * scale  # (K, V)
        self.bind(target)

    def build(self, target: Target) -> None:
        pass  # nothing target-shaped: the proposals are fixed

    def begin(self, features, input_ids=None):
        return SimpleNamespace(length=features.shape[1])

    def extend(self, state, features, path) -> None:
        state.length += len(path)

    def propose(self, state, anchor, sampling, generator=None) -> ChainProposal:
        q = self.logits.softmax(-1)  # (K, V)
        if sampling.greedy:
            return ChainProposal(tokens=q.argmax(-1))
        return ChainProposal(tokens=torch.multinomial(q, 1, generator=generator)[:, 0], probs=q)

    def config_dict(self) -> dict:
        return {"block_size": self.block_size}


@pytest.fixture
def saved_drafter(tmp_path, tiny_target):
    """An untrained drafter for ``tiny-random`` saved as a fit checkpoint holds it (``.ckpt``) and as an exported
    folder: (drafter, ckpt path, folder)."""
    from helpers.fits import fit_checkpoint

    from lightning_spec.checkpoint import save_drafter

    drafter = block_drafter(tiny_target, block_size=3)
    ckpt = fit_checkpoint(drafter, tmp_path / "last.ckpt", "tiny-random")
    return drafter, ckpt, save_drafter(drafter, tmp_path / "exported", "tiny-random")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the CLI inside tmp_path (mlflow.db, mlruns/ and checkpoints land there) with a clean argv."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    return tmp_path


@pytest.fixture
def data_files(tmp_path):
    """JSONL files in tmp_path: 12 training conversations (``train``), 12 others (``train_b``) and one eval prompt
    in each of two domains (``eval``)."""
    eval_rows = [
        {"messages": [{"role": "user", "content": "Say hello."}], "domain": "chat"},
        {"messages": [{"role": "user", "content": "def add(a, b):"}], "domain": "code"},
    ]
    return {
        "train": write_jsonl(tmp_path / "train.jsonl", conversations(12)),
        "train_b": write_jsonl(tmp_path / "train_b.jsonl", conversations(12, tag=" (b)")),
        "eval": write_jsonl(tmp_path / "eval.jsonl", eval_rows),
    }


@pytest.fixture
def trained_fit(tmp_path, data_files):
    """A few fit steps on tiny-random with a reduced draft vocabulary (which the checkpoint must carry):
    (the module in eval mode, its last.ckpt, the data module)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    dm = SpecDataModule(target="tiny-random", train_sources=[data_files["train"]], eval_sources=[data_files["eval"]],
                        train_limit=None, max_length=64, batch_size=4, val_fraction=0.2)
    drafter = DFlashDrafter(block_size=3, num_layers=1, num_anchors=8, draft_vocab_size=100)
    module = DraftModule(drafter, Objective(KL(), ExpDecay(4.0)), target="tiny-random", lr=1e-2)
    trainer = quiet_trainer(max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step >= 2
    # the feature cache holds every training example after one epoch
    store = module.feature_source.store
    assert store is not None and len(store) == len(dm.train_dataset)
    return module.eval(), tmp_path / "ckpt" / "last.ckpt", dm


# Helpers as fixtures, so test modules never import conftest.
@pytest.fixture(scope="session")
def make_random_llama():
    return random_llama


@pytest.fixture(scope="session")
def make_block_drafter():
    return block_drafter


@pytest.fixture(scope="session")
def make_reference_drafter():
    return reference_drafter


@pytest.fixture(scope="session")
def make_fixed_drafter():
    return FixedDrafter
