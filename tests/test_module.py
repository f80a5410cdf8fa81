"""DraftModule: gradient reduction across accumulation, the feature cache, drafter-only checkpoints."""

import contextlib

import pytest
import torch
from helpers.data import sequences
from helpers.fits import quiet_trainer
from torch.utils.data import DataLoader

from lightning_spec import SamplingConfig, generate, load_drafter
from lightning_spec.checkpoint import CKPT_KEY, save_drafter
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.drafters import DFlashDrafter
from lightning_spec.features.store import FeatureStore, StoreSpec
from lightning_spec.loaders import collate
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, ExpDecay, Objective

# ----------------------------------------------------------------------------------- accumulation invariance


class SGDModule(DraftModule):
    """Plain SGD, lr 1, no momentum: after one step, initial - updated = the gradient the module reduced.
    (AdamW would hide a wrong gradient scale: its update is nearly scale-free.)"""

    def configure_optimizers(self):
        return torch.optim.SGD(self.drafter.parameters(), lr=1.0, momentum=0.0)


def batches(examples: list[dict], batch_size: int) -> list[dict]:
    out = []
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size], pad_id=0)
        del batch["index"]  # no feature cache here: fresh target features every step
        out.append(batch)
    return out


def make_module(target) -> SGDModule:
    torch.manual_seed(0)
    # num_anchors >= sequence length: every candidate anchor is used, so anchor sampling is a no-op
    drafter = DFlashDrafter(block_size=4, num_layers=1, num_anchors=64)
    return SGDModule(drafter, Objective(KL(), ExpDecay(4.0)), target=target)


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.drafter.named_parameters()}


def lightning_update(target, examples, batch_size: int, accumulate: int, steps: int) -> dict[str, torch.Tensor]:
    """θ_0 - θ_steps after ``steps`` optimizer steps of SGD(lr=1) under Lightning."""
    module = make_module(target)
    before = params(module)
    loader = DataLoader(batches(examples, batch_size), batch_size=None)
    quiet_trainer(max_steps=steps, accumulate_grad_batches=accumulate).fit(module, train_dataloaders=loader)
    assert module.trainer.global_step == steps
    return {k: before[k] - v for k, v in params(module).items()}


def reference_gradient(module, batch_list: list[dict]) -> dict[str, torch.Tensor]:
    """∇ (Σ_i num_i / Σ_i den_i) over the micro-batches, by hand: the gradient of the one equation."""
    module.drafter.zero_grad()
    den = 0.0
    for batch in batch_list:
        _, terms = module.draft_step(batch, use_cache=False)
        terms.num.backward()
        den += float(terms.den)
    return {k: p.grad / den for k, p in module.drafter.named_parameters()}


def relative_error(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5
    den = sum(float(b[k].pow(2).sum()) for k in b) ** 0.5
    return num / den


def test_batch8_equals_batch1_times_accumulate8(tiny_target):
    examples = sequences(16)  # two optimizer steps of 8 sequences: the normaliser must restart every step
    update8 = lightning_update(tiny_target, examples, batch_size=8, accumulate=1, steps=2)
    update1 = lightning_update(tiny_target, examples, batch_size=1, accumulate=8, steps=2)

    module = make_module(tiny_target)
    g1 = reference_gradient(module, batches(examples[:8], 8))
    with torch.no_grad():
        for k, p in module.drafter.named_parameters():
            p -= g1[k]
    g2 = reference_gradient(module, batches(examples[8:], 8))
    want = {k: g1[k] + g2[k] for k in g1}
    assert relative_error(want, g1) > 1e-2  # the second step matters
    assert relative_error(update8, want) < 1e-5
    assert relative_error(update1, want) < 1e-5

    # The check has power: averaging per-micro-batch normalised losses (the usual mistake) is far off.
    module = make_module(tiny_target)
    for batch in batches(examples[:8], 1):
        _, terms = module.draft_step(batch, use_cache=False)
        (terms.num / terms.den / 8).backward()
    naive = {k: p.grad for k, p in module.drafter.named_parameters()}
    assert relative_error(naive, g1) > 1e-3


# ------------------------------------------------------------------------------------------ feature cache


def test_cached_features_equal_fresh_ones(tiny_target, monkeypatch):
    module = DraftModule(DFlashDrafter(block_size=3, num_layers=1), Objective(KL()), target=tiny_target)
    store = FeatureStore(StoreSpec("tiny-random", "f", [0], "d", "float32", 64, 4))
    module.feature_source = module.feature_source.with_store(store)
    examples = sequences(4, seed=1)
    batch = collate(examples[:3], pad_id=0)
    lengths = batch["attention_mask"].sum(1).tolist()

    fresh_f, fresh_h = module.target_features(batch, use_cache=False)
    calls = []
    forward = module.target.forward

    def counting_forward(ids, *args, **kwargs):
        calls.append(ids.shape)
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(module.target, "forward", counting_forward)
    cached_f, cached_h = module.target_features(batch, use_cache=True)  # fills the cache, reads it back
    assert calls == [(3, batch["input_ids"].shape[1])] and len(store) == 3
    for i, length in enumerate(lengths):
        # fp16 storage: relative rounding error <= 2^-11
        torch.testing.assert_close(cached_f[i, :length], fresh_f[i, :length], rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(cached_h[i, :length], fresh_h[i, :length], rtol=1e-3, atol=1e-6)
        assert (cached_f[i, length:] == 0).all()
    assert cached_f.dtype == torch.float32

    calls.clear()
    again_f, again_h = module.target_features(batch, use_cache=True)  # all hits: no target forward
    assert calls == [] and torch.equal(again_f, cached_f) and torch.equal(again_h, cached_h)
    mixed = collate([examples[3], examples[0]], pad_id=0)
    module.target_features(mixed, use_cache=True)  # only the missing example is computed
    assert calls == [(1, mixed["input_ids"].shape[1])] and len(store) == 4


def datamodule(files, train="train", **kwargs) -> SpecDataModule:
    args = dict(target="tiny-random", train_sources=[files[train]], eval_sources=[files["eval"]], train_limit=None,
                max_length=64, batch_size=4, val_fraction=0.2, eval_prompts_per_domain=1)
    dm = SpecDataModule(**{**args, **kwargs})
    dm.setup("fit")
    return dm


def test_store_key_changes_with_layers_target_data_and_dtype(data_files, make_random_llama):
    dm_a, dm_a2 = datamodule(data_files), datamodule(data_files)
    dm_b, dm_short = datamodule(data_files, train="train_b"), datamodule(data_files, max_length=60)
    assert dm_a.fingerprint == dm_a2.fingerprint  # deterministic
    assert len({dm_a.fingerprint, dm_b.fingerprint, dm_short.fingerprint}) == 3
    t0, t1 = make_random_llama(seed=0), make_random_llama(seed=1)
    assert t0.fingerprint == make_random_llama(seed=0).fingerprint and t0.fingerprint != t1.fingerprint

    def key(target, layers, dm, dtype="float32") -> str:
        return StoreSpec("t", target.fingerprint, layers, dm.fingerprint, dtype, 32, 10).key

    assert key(t0, [0, 1], dm_a) == key(t0, [0, 1], dm_a2)
    others = [key(t0, [1], dm_a), key(t0, [1, 0], dm_a), key(t1, [0, 1], dm_a), key(t0, [0, 1], dm_b),
              key(t0, [0, 1], dm_short), key(t0, [0, 1], dm_a, "bfloat16")]
    key = key(t0, [0, 1], dm_a)
    assert key not in others and len(set(others)) == len(others)


# -------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_holds_the_drafter_only_and_reloads_exactly(trained_fit, tiny_target):
    module, path, dm = trained_fit
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    keys = list(ckpt["state_dict"])
    assert keys and not [k for k in keys if k.startswith("target.")]
    assert all(k.startswith(("drafter.", "val_loss.")) for k in keys), keys
    meta = ckpt[CKPT_KEY]
    assert meta["target"] == "tiny-random" and meta["target_vocab_size"] == 320
    assert meta["drafter_config"]["draft_vocab_size"] == 100
    assert bool(module.drafter.vocab.ready) and not torch.equal(module.drafter.vocab.ids, torch.arange(100))

    loaded = load_drafter(path)
    assert type(loaded) is DFlashDrafter and not loaded.training
    want = module.drafter.state_dict()
    got = loaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    # the same proposals, greedy and sampled, from the same context
    prompt = dm.eval_prompts()[0]["prompt_ids"]
    for drafter in (module.drafter, loaded):
        assert drafter.target.fingerprint == tiny_target.fingerprint
    proposals = []
    for drafter in (module.drafter, loaded):
        ids = torch.tensor(prompt[:-1])[None]
        state = drafter.begin(drafter.target(ids, layers=drafter.target_layers, logits=False).features)
        anchor = torch.tensor(prompt[-1:])
        greedy = drafter.propose(state, anchor, SamplingConfig())
        sampled = drafter.propose(state, anchor, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
        proposals.append((greedy.tokens, sampled.tokens, sampled.probs))
    (g0, s0, q0), (g1, s1, q1) = proposals
    assert torch.equal(g0, g1) and torch.equal(s0, s1) and torch.equal(q0, q1)
    assert (q0.sum(-1) - 1).abs().max() < 1e-5 and int((q0[0] > 0).sum()) == 100  # q lives on the draft vocab
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        a = generate(module.target, prompt, 12, sampling, drafter=module.drafter, seed=3)
        b = generate(loaded.target, prompt, 12, sampling, drafter=loaded, seed=3)
        assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths

    # exported folder round trip, and resuming the module from the checkpoint
    folder = save_drafter(loaded, path.parent / "export")
    again = load_drafter(folder, target=tiny_target)
    assert all(torch.equal(want[k], again.state_dict()[k]) for k in want)
    resumed = DraftModule.load_from_checkpoint(
        path, drafter=DFlashDrafter(block_size=3, num_layers=1, num_anchors=8, draft_vocab_size=100),
        objective=Objective(KL(), ExpDecay(4.0)),
    )
    assert all(torch.equal(want[k], resumed.drafter.state_dict()[k]) for k in want)
    assert resumed.target.fingerprint == tiny_target.fingerprint


def test_loading_with_another_vocabulary_is_a_clear_error(trained_fit, make_random_llama, tmp_path):
    _, path, _ = trained_fit
    other = make_random_llama(vocab_size=96)
    with pytest.raises(ValueError, match=r"320-token vocabulary.*has 96.*'tiny-random'"):
        load_drafter(path, target=other)
    bogus = tmp_path / "bogus.ckpt"
    torch.save({"state_dict": {}}, bogus)
    with pytest.raises(ValueError, match="not a lightning_spec checkpoint"):
        load_drafter(bogus)


# -------------------------------------------------------------------------------- determinism, divergence


def test_seeded_anchors_depend_on_the_example_only(tiny_target):
    from lightning_spec.drafters.base import anchor_seeds

    drafter = DFlashDrafter(block_size=3, num_layers=1, num_anchors=4)
    examples = sequences(6)
    seeds = anchor_seeds(0, 5, torch.arange(6))
    assert len(set(seeds.tolist())) == 6 and torch.equal(seeds, anchor_seeds(0, 5, torch.arange(6)))
    assert not torch.equal(seeds, anchor_seeds(0, 6, torch.arange(6)))  # a new step, new anchors
    assert not torch.equal(seeds, anchor_seeds(1, 5, torch.arange(6)))  # another run seed, new anchors
    whole = collate(examples, pad_id=0)  # padded to the longest of all six
    every = drafter.sample_anchors({**whole, "anchor_seed": seeds})
    a_all, k_all = every.positions, every.keep
    for rows in ([4, 1], [2], [5, 0, 3]):  # other neighbours, other padded lengths
        part = collate([examples[i] for i in rows], pad_id=0)
        some = drafter.sample_anchors({**part, "anchor_seed": seeds[rows]})
        assert torch.equal(some.positions, a_all[rows]) and torch.equal(some.keep, k_all[rows])
    assert (k_all.sum(1) == 4).all()  # every sequence has >= 4 candidates: num_anchors of them are kept
    torch.manual_seed(0)
    a1 = drafter.sample_anchors(whole).positions  # no seeds: the global RNG, as before
    a2 = drafter.sample_anchors(whole).positions
    assert not torch.equal(a1, a2)


class NaNObjective(Objective):
    """KL whose numerator is NaN: a diverged run."""

    def __call__(self, draft, ctx=None, chunk=None):
        terms = super().__call__(draft, ctx, chunk)
        return type(terms)(terms.num * float("nan"), terms.den, terms.metrics)


def test_a_non_finite_loss_stops_training_with_one_sentence(tiny_target):
    module = DraftModule(DFlashDrafter(block_size=3, num_layers=1, num_anchors=8), NaNObjective(KL()),
                         target=tiny_target, lr=0.5)
    loader = DataLoader(batches(sequences(4), 2), batch_size=None)
    message = r"^train/loss is not finite \(nan\) at step 0: training diverged; lower model\.lr \(the learning rate is "
    with pytest.raises(FloatingPointError, match=message + r"[0-9.e-]+\) or check the data for broken examples\.$"):
        quiet_trainer(max_steps=2).fit(module, train_dataloaders=loader)
    assert module.trainer.global_step == 0  # stopped before the optimizer step


def test_fsdp_shards_the_drafter_and_leaves_the_target_whole(tiny_target):
    """FSDP itself needs GPUs; this checks the wiring experiments/qwen3_8b_fsdp.yaml relies on."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lightning_spec.callbacks.base import full_parameters

    for strategy, sharded in ((FSDPStrategy(sharding_strategy="FULL_SHARD"), True), (DDPStrategy(), False)):
        strategy.parallel_devices = [torch.device("cpu")]
        module = DraftModule(DFlashDrafter(block_size=3, num_layers=1), Objective(KL()), target=tiny_target)
        module.trainer = SimpleNamespace(strategy=strategy)
        module.configure_model()
        # FSDP must not flatten the frozen target (bf16 on GPUs) with the fp32 drafter, nor shard the embedding
        # and LM head the drafter reads outside FSDP's forward; its checkpoints hold no target weights to load
        assert getattr(strategy, "kwargs", {}).get("ignored_modules") == ([module.target] if sharded else None)
        assert module.strict_loading is not sharded
    assert isinstance(full_parameters(SimpleNamespace(strategy=DDPStrategy())), contextlib.nullcontext)
