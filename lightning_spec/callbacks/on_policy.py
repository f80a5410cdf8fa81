"""OnPolicyRollouts: the training data of on-policy regimes, decoded by the drafter being trained.

Draft-OPD (Lei et al. 2026, arXiv 2605.29343) and AdaFlash (Qian et al. 2026, arXiv 2607.19223) train a drafter on
responses decoded speculatively *with that drafter*: speculative decoding is lossless, so the responses are samples
of the target, and each round records where the drafter's own decoding started and which drafts the target
rejected (``data/replay.py``). This callback is their data: the same ``DraftModule`` and training loop, other data.

- ``on_fit_start``: the training prompts (the data module's train split, each conversation's first prompt) are
  shuffled with ``seed``; ``buffer_size`` of them are decoded with the current drafter through our engine
  (``generate(trace=True)``) into a ``ReplayBuffer`` (``data/replay.py``), and the data module trains on that buffer
  (``SpecDataModule.train_on``; its length stays ``buffer_size``, so Lightning's epoch length is fixed).
- ``setup`` declares the fit on-policy to the module (``DraftModule.train_on_policy``): Lightning runs every
  callback's ``setup`` before the module's, which then opens no feature store for a set that changes.
- every ``refresh_every`` optimizer steps, ``rollouts_per_refresh`` further prompts are decoded with the drafter as
  it is now and replace the oldest buffer entries (a ring). ``rollouts_per_refresh = buffer_size`` renews the whole
  buffer: AdaFlash's loop of "roll out a buffer, train on it for ``refresh_every`` steps, roll out with the new
  weights", in one process. Examples carry ``drawn_step``; the module logs ``train/staleness`` (optimizer steps
  since the drafter that decoded a batch's examples).
- DDP: each rank decodes an interleaved share of the prompts of a refresh (``prompts[rank::world]``), then the
  examples are gathered (``all_gather_object``) in prompt order, so every rank holds the same buffer, and the data
  module's sampler shards it as it shards any training split. Sample i of the run is decoded with seed
  ``seed * 1_000_003 + i`` on whichever rank: the buffer does not depend on the number of ranks.
- The buffer, its ring cursor and the prompt cursor are saved in checkpoints: a resumed run continues with them.

Logged per refresh (rank 0): ``rollout/mal`` (the live drafter's MAL on training prompts), ``rollout/seconds``,
``rollout/tokens``. The target features of buffer examples are never cached (they change with every refresh).
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import lightning as L
import torch

from lightning_spec.callbacks.base import MetricsCallback, full_parameters, refuse_sharded_target
from lightning_spec.data.replay import ReplayBuffer, prompt_of, replay_example
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.decoding.engine import generate
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig


class OnPolicyRollouts(MetricsCallback):
    """Keep the training data a replay buffer of responses decoded with the live drafter.

    Args:
        buffer_size: examples in the buffer (the epoch length in examples).
        refresh_every: optimizer steps between refreshes.
        rollouts_per_refresh: prompts decoded per refresh, replacing the oldest entries; null = ``buffer_size``
            (renew the whole buffer, AdaFlash's loop).
        max_new_tokens: response budget per prompt; prompts longer than ``data.max_length - max_new_tokens`` are
            not used.
        sampling: how rollouts are decoded (the serving config the drafter is trained for; greedy by default).
        seed: shuffles the prompts and seeds every rollout.
        all_rejected: keep every rejected draft of a round (exact for drafters whose slots do not read earlier
            drafts, ``parallel_slots``: DFlash's block); null = that, else only the first rejected one per round.
    """

    def __init__(
        self,
        buffer_size: int = 64,
        refresh_every: int = 20,
        rollouts_per_refresh: int | None = None,
        max_new_tokens: int = 96,
        sampling: SamplingConfig = SamplingConfig(),
        seed: int = 0,
        all_rejected: bool | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("buffer_size", buffer_size), ("refresh_every", refresh_every),
                            ("max_new_tokens", max_new_tokens)):
            if value < 1:
                raise UserError(f"OnPolicyRollouts.{name} is {value}; it must be >= 1.")
        if rollouts_per_refresh is not None and not 1 <= rollouts_per_refresh <= buffer_size:
            raise UserError(
                f"OnPolicyRollouts.rollouts_per_refresh is {rollouts_per_refresh}; it must be in 1..buffer_size "
                f"({buffer_size}), or null to renew the whole buffer."
            )
        self.buffer_size = buffer_size
        self.refresh_every = refresh_every
        self.rollouts_per_refresh = rollouts_per_refresh or buffer_size
        self.max_new_tokens = max_new_tokens
        self.sampling = SamplingConfig.coerce(sampling)
        self.seed = seed
        self.all_rejected = all_rejected
        self.prompts: list[dict[str, Any]] = []
        self.buffer = ReplayBuffer(buffer_size)
        self.next_prompt = 0  # position in the shuffled prompt list
        self.drawn = 0  # rollouts decoded so far (their seeds and example indices)
        self.last_refresh: int | None = None  # the optimizer step of the last refresh

    # ------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        pl_module.train_on_policy()  # before the module's own setup (Lightning's order): no feature store for it
        dm = trainer.datamodule
        if not isinstance(dm, SpecDataModule):  # plain dataloaders or another data module: no prompts to decode
            raise UserError("OnPolicyRollouts needs a data module (data: SpecDataModule) whose prompts it decodes.")
        budget = dm.max_length - self.max_new_tokens
        seen, prompts = set(), []
        for e in dm.train_dataset:
            prompt = prompt_of(e)
            if 1 < len(prompt) <= budget and tuple(prompt) not in seen:
                seen.add(tuple(prompt))
                prompts.append({"prompt": prompt, "domain": e["domain"], "domain_id": e["domain_id"], "id": e["id"]})
        if not prompts:
            raise UserError(
                f"no training prompt fits data.max_length={dm.max_length} with OnPolicyRollouts.max_new_tokens="
                f"{self.max_new_tokens}; raise data.max_length or lower max_new_tokens."
            )
        random.Random(self.seed).shuffle(prompts)
        self.prompts = prompts

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        refuse_sharded_target(pl_module, type(self).__name__)
        if not self.buffer.full:  # a fresh run (a resumed one restored its buffer)
            self.buffer.fill(self._rollouts(trainer, pl_module, self.buffer_size))
            self.last_refresh = trainer.global_step
        trainer.datamodule.train_on(self.buffer)  # this very buffer: refreshed in place below

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.last_refresh is None or step - self.last_refresh < self.refresh_every:
            return
        if trainer.max_steps is not None and 0 <= trainer.max_steps <= step:
            return  # training is over; a refresh now would never be trained on
        self.buffer.put(self._rollouts(trainer, pl_module, self.rollouts_per_refresh))  # what the loader reads
        self.last_refresh = step

    # ----------------------------------------------------------------------------------------- rollouts
    def _rollouts(self, trainer: L.Trainer, module: L.LightningModule, count: int) -> list[dict[str, Any]]:
        """``count`` new buffer examples decoded with the live drafter (prompts that give an empty response are
        skipped and the next ones taken), the same list on every rank."""
        start, step = time.perf_counter(), trainer.global_step
        drafter = module.drafter
        all_rejected = drafter.parallel_slots if self.all_rejected is None else self.all_rejected
        world, rank = trainer.world_size, trainer.global_rank
        out: list[dict[str, Any]] = []
        tokens = rounds = tried = 0
        was_training = drafter.training
        drafter.eval()
        with full_parameters(trainer), torch.no_grad():
            while len(out) < count:
                if tried >= len(self.prompts) and not out:
                    raise RuntimeError("OnPolicyRollouts: every training prompt gave an empty response.")
                batch = [self._next_prompt() for _ in range(count - len(out))]
                mine = []
                for i in range(rank, len(batch), world):
                    number, prompt = batch[i]
                    gen = generate(module.target, prompt["prompt"], self.max_new_tokens, self.sampling,
                                   drafter=drafter, seed=self.seed * 1_000_003 + number, trace=True)
                    example = replay_example(
                        prompt["prompt"], gen, drafter.block_size, all_rejected, domain=prompt["domain"],
                        domain_id=prompt["domain_id"], id=prompt["id"], index=number, drawn_step=step,
                    )
                    mine.append((i, example, len(gen.tokens), gen.rounds))
                gathered = [mine]
                if world > 1:
                    gathered = [None] * world
                    torch.distributed.all_gather_object(gathered, mine)
                for _, example, n_tokens, n_rounds in sorted((x for part in gathered for x in part),
                                                             key=lambda x: x[0]):
                    tokens, rounds = tokens + n_tokens, rounds + n_rounds
                    if example is not None:
                        out.append(example)
                tried += len(batch)
        drafter.train(was_training)
        seconds = time.perf_counter() - start
        metrics = {"rollout/mal": tokens / max(rounds, 1), "rollout/seconds": seconds, "rollout/tokens": tokens}
        self.history.append((step, metrics))
        self.publish(trainer, metrics, step)
        if trainer.is_global_zero:
            print(f"[on-policy] step {step}: decoded {len(out)} responses ({tokens} tokens) with the live drafter "
                  f"in {seconds:.1f} s, MAL {metrics['rollout/mal']:.3f}", file=sys.stderr)
        return out

    def _next_prompt(self) -> tuple[int, dict[str, Any]]:
        """(rollout number, prompt), cycling through the shuffled prompts."""
        prompt = self.prompts[self.next_prompt % len(self.prompts)]
        self.next_prompt += 1
        self.drawn += 1
        return self.drawn - 1, prompt

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.buffer.state_dict(), "next_prompt": self.next_prompt,
                "drawn": self.drawn, "last_refresh": self.last_refresh}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.buffer.load_state_dict(state_dict)  # its "buffer" and "cursor" keys, as checkpoints have always held
        self.next_prompt = int(state_dict.get("next_prompt", 0))
        self.drawn = int(state_dict.get("drawn", 0))
        self.last_refresh = state_dict.get("last_refresh")


