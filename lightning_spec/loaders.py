"""The training loader: examples in a seeded, optionally domain-weighted order, DDP-sharded, resumable mid-epoch.

``SpecDataModule`` (``datamodule.py``) decides what the examples are; this file decides in which order they are
trained: ``DomainSampler`` draws one global order per epoch (every rank the same), each rank takes its
interleaved shard, and ``TrainLoader`` remembers how far the current pass got, for Lightning's checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_spec.errors import UserError


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples to the batch's longest sequence."""
    n, s = len(examples), max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((n, s), pad_id, dtype=torch.long)  # (N, S)
    attention_mask = torch.zeros((n, s), dtype=torch.long)  # (N, S)
    loss_mask = torch.zeros((n, s), dtype=torch.bool)  # (N, S)
    for row, e in enumerate(examples):
        length = len(e["input_ids"])
        input_ids[row, :length] = e["input_ids"]
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = e["loss_mask"]
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "domain_id": torch.tensor([e["domain_id"] for e in examples], dtype=torch.long),  # (N,)
        "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),  # (N,)
    }
    if "round_starts" in examples[0]:  # on-policy rollouts (data/replay.py): their rounds, padded
        batch.update(collate_rounds(examples))
    return batch


def collate_rounds(examples: list[dict]) -> dict[str, torch.Tensor]:
    """The per-round fields of on-policy examples (``data/replay.py``) padded to the batch's most rounds R:
    ``round_starts`` (N, R) with -1 padding, ``rejected`` (N, R, K) -1, ``rejected_logp`` (N, R, K) 0, and
    ``drawn_step`` (N,)."""
    n, r = len(examples), max(len(e["round_starts"]) for e in examples)
    k = examples[0]["rejected"].shape[-1]
    starts = torch.full((n, r), -1, dtype=torch.long)  # (N, R)
    rejected = torch.full((n, r, k), -1, dtype=torch.long)  # (N, R, K)
    logp = torch.zeros((n, r, k))  # (N, R, K)
    for row, e in enumerate(examples):
        m = len(e["round_starts"])
        starts[row, :m] = e["round_starts"]
        rejected[row, :m] = e["rejected"]
        logp[row, :m] = e["rejected_logp"]
    steps = torch.tensor([e["drawn_step"] for e in examples], dtype=torch.long)  # (N,)
    return {"round_starts": starts, "rejected": rejected, "rejected_logp": logp, "drawn_step": steps}


class DomainSampler(DistributedSampler):
    """Plain seeded shuffle, or sampling with replacement with probability ∝ the weight of an example's domain.

    The weights are read from the data module at the start of every epoch, so a callback that calls
    ``SpecDataModule.set_domain_weights`` changes the next epoch without rebuilding the loader. Each epoch
    draws from its own generator seeded with ``(seed, epoch)``: every DDP rank draws the same order, and a
    resumed run draws what the original would have.

    Under DDP (``num_replicas`` > 1) every rank draws that one global order of ``len(training_set)`` indices
    (padded by wrapping around to a multiple of ``num_replicas``) and takes the interleaved shard
    ``order[rank::num_replicas]``, so the ranks' i-th batches together are exactly the i-th batch of one
    process with ``num_replicas`` times the batch size. It is a ``DistributedSampler`` so that Lightning keeps
    it (instead of wrapping it) and calls ``set_epoch`` on it.
    """

    def __init__(self, datamodule: Any, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(datamodule.training_set, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.datamodule = datamodule
        self.drawn_with: dict[str, float] | None = None  # the domain weights of the last pass
        # for the next pass only (``resume_pass``): indices of this rank's shard already consumed, and (weights,)
        # that the interrupted pass drew with (a callback may have changed them since)
        self.skip = 0
        self.replay: tuple[dict[str, float] | None] | None = None

    def resume_pass(self, skip: int, drawn_with: tuple[dict[str, float] | None] | None) -> None:
        """Make the next pass the rest of an interrupted one: skip its first ``skip`` indices of this rank's shard,
        and draw its order with ``drawn_with[0]``, the weights the interrupted pass drew with (``(None,)``: the
        plain shuffle), instead of the current ones; ``drawn_with=None`` draws with the current weights."""
        self.skip, self.replay = skip, drawn_with

    def __len__(self) -> int:
        return math.ceil(len(self.datamodule.training_set) / self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1  # without set_epoch calls, the next pass still differs
        if self.replay is not None:
            (self.drawn_with,), self.replay = self.replay, None
            weights = example_weights(self.datamodule.train_domains(), self.drawn_with)
        else:
            self.drawn_with, weights = self.datamodule.domain_weights, self.datamodule.sample_weights()
        n = len(self.datamodule.training_set)
        if weights is None:
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = torch.multinomial(weights, n, replacement=True, generator=generator).tolist()
        if self.num_replicas > 1:
            total = len(self) * self.num_replicas
            order = (order * math.ceil(total / n))[:total][self.rank :: self.num_replicas]
        skip, self.skip = self.skip, 0
        return iter(order[skip:])


class TrainLoader(DataLoader):
    """The training DataLoader, resumable in the middle of an epoch (Lightning's ``state_dict`` protocol).

    ``state_dict`` is ``{"epoch", "batches", "domain_weights"}``: the sampler epoch of the current pass, how many
    batches it has yielded, and the domain weights its order was drawn with. With a sized loader Lightning fetches
    no batch ahead, so when a checkpoint is written (after a training step, a validation or the epoch) the yielded
    batches are exactly the trained ones. After ``load_state_dict`` the next pass over the same epoch redraws
    that order and starts after them (the sampler skips their indices, so nothing is loaded); a pass over another
    epoch (the checkpoint was written at the end of its epoch) is whole.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._progress: dict[str, Any] | None = None  # state_dict() of the current pass
        self._resume: dict[str, Any] | None = None  # from load_state_dict, for the next pass

    def __iter__(self) -> Iterator[Any]:
        # A generator: this body runs at the first next(), after Lightning's set_epoch and load_state_dict.
        sampler = self.sampler
        epoch, done = int(sampler.epoch), 0
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] == epoch and resume["batches"] > 0:
            done = resume["batches"]
            replay = (resume["domain_weights"],) if "domain_weights" in resume else None
            sampler.resume_pass(done * self.batch_size, replay)
        self._progress = {"epoch": epoch, "batches": done, "domain_weights": None}
        for batch in super().__iter__():
            done += 1
            self._progress = {"epoch": epoch, "batches": done, "domain_weights": sampler.drawn_with}
            yield batch

    def state_dict(self) -> dict[str, Any]:
        if self._progress is None:
            return {"epoch": int(self.sampler.epoch), "batches": 0, "domain_weights": None}
        return dict(self._progress)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict)


def example_weights(domains: list[str], domain_weights: dict[str, float] | None) -> torch.Tensor | None:
    """(len(domains),) float64: the weight of each example's domain (0 if unnamed); None for None (shuffle)."""
    if domain_weights is None:
        return None
    return torch.tensor([domain_weights.get(d, 0.0) for d in domains], dtype=torch.double)


def check_val_check_interval(trainer: Any, loader: DataLoader) -> None:
    """An int ``trainer.val_check_interval`` counts training batches within an epoch: one beyond the epoch would
    never validate, which Lightning refuses from deep inside its fit loop; refuse it here, naming the field."""
    interval = trainer.val_check_interval if trainer is not None else None
    if not isinstance(interval, int) or isinstance(interval, bool):
        return  # no trainer, a fraction of the epoch, or a time
    if trainer.check_val_every_n_epoch is None or not trainer.limit_val_batches > 0 or trainer.overfit_batches:
        return  # counted across epochs, no validation, or overfitting a few batches: Lightning's rules
    limit = trainer.limit_train_batches  # as Lightning applies it: an int caps, a float scales
    batches = min(len(loader), limit) if isinstance(limit, int) else int(len(loader) * limit)
    if interval > batches:
        raise UserError(
            f"trainer.val_check_interval={interval} is more than the {batches} training batches of an epoch "
            f"({len(loader.sampler)} training examples per process, data.batch_size={loader.batch_size}); lower it "
            f"to at most {batches}, or set trainer.check_val_every_n_epoch: null to count batches across epochs."
        )
