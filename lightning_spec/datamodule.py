"""SpecDataModule: conversations -> tokenized, loss-masked, domain-labelled batches, plus held-out eval prompts.

Its ``__init__`` is the ``data:`` section of an experiment YAML. After ``setup`` it holds

    train_dataset / val_dataset   lists of examples {input_ids, loss_mask, domain_id, index, id, domain}
    domains                       sorted union of the train and eval domains; domain_id indexes it
    fingerprint                   sha256 of what a feature cache depends on (tokenizer, train token ids, max_length)

and ``eval_prompts()`` gives the prompts that validation decodes for real (MAL per domain). The order in which
examples are trained (domain weights, DDP shards, mid-epoch resume) is ``loaders.py``'s.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_spec.data.chat import prompt_ids, tokenize_conversation
from lightning_spec.data.prompts import domain_prompts, first_user, opening
from lightning_spec.data.rollouts import is_rollouts_folder, load_rollouts, sft_examples
from lightning_spec.data.sources import Source, as_source, held_out_keys, load_source
from lightning_spec.loaders import DomainSampler, TrainLoader, check_val_check_interval, collate, example_weights
from lightning_spec.target import load_tokenizer


class SpecDataModule(L.LightningDataModule):
    """Training conversations and held-out eval prompts, tokenized with the target's chat template.

    Args:
        target: the target whose tokenizer and chat template are used: a packaged name
            (``smollm2-135m-instruct``, ``tiny-random``), an HF hub id or a local folder. The CLI links
            ``model.target`` to this field.
        train_sources: training conversation sources: packaged names (``sharegpt``), local
            ``.jsonl``/``.json``/``.parquet`` files or folders, hub ids, or ``Source`` entries
            (``{name, domain, limit, split}``). A rollouts folder (``lightning-spec rollouts``) trains on the
            target's own responses (prompt + response, loss on the response, EOS included); it must have been
            drawn from this target.
        train_limit: conversations read per training source (the first usable ones, in file order) unless the
            source sets its own ``limit``; null = all.
        max_length: tokens per training example; longer conversations are truncated.
        val_fraction: share of the training conversations held out for ``val/loss`` (at least one).
        batch_size: examples per batch, for training and validation.
        num_workers: DataLoader worker processes (0 = load in the main process).
        seed: seeds the train/val split, the training order and the eval prompt shuffle.
        eval_sources: sources of held-out prompts that validation decodes for real (MAL per domain); their
            first user message must not appear in training, and matching training conversations are dropped.
        eval_prompts_per_domain: prompts per domain for speculative decoding during validation.
        tokenizer: an already built tokenizer (Python use; overrides ``target``'s tokenizer).
    """

    def __init__(
        self,
        target: str = "smollm2-135m-instruct",
        train_sources: list[Source | str] = ["sharegpt"],  # noqa: B006 (copied below; a list default shows in --help)
        train_limit: int | None = 2000,
        max_length: int = 512,
        val_fraction: float = 0.02,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        eval_sources: list[Source | str] = ["mt-bench", "humaneval", "mmath"],  # noqa: B006
        eval_prompts_per_domain: int = 8,
        tokenizer: Any = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer"])
        self.target = target
        self.train_sources = [as_source(s) for s in train_sources]
        self.eval_sources = [as_source(s) for s in eval_sources]
        self.train_limit = train_limit
        self.max_length = max_length
        self.val_fraction = val_fraction
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.eval_prompts_per_domain = eval_prompts_per_domain
        self._tokenizer = tokenizer
        self._tokenizer_given = tokenizer is not None
        self._check_args()

        self.train_dataset: list[dict] | None = None
        self.val_dataset: list[dict] | None = None
        self._eval_rows: list[dict] | None = None
        self._eval_prompts: list[dict] | None = None
        self._domains: list[str] | None = None
        self._fingerprint: str | None = None
        self._domain_weights: dict[str, float] | None = None
        self._rollout_meta: list[dict] | None = None

    def _check_args(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"data.max_length={self.max_length} must be at least 2 tokens; raise it (e.g. 512).")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be in [0, 1); use e.g. 0.02.")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size} must be at least 1.")
        if self.train_limit is not None and self.train_limit < 1:
            raise ValueError(f"data.train_limit={self.train_limit} must be at least 1, or null for all rows.")
        if self.eval_prompts_per_domain < 0:
            raise ValueError(f"data.eval_prompts_per_domain={self.eval_prompts_per_domain} must be >= 0.")
        if not self.train_sources:
            raise ValueError("data.train_sources is empty; name at least one source, e.g. ['sharegpt'].")

    # ------------------------------------------------------------------------------------------ tokenizer

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.target)
        return self._tokenizer

    @property
    def pad_id(self) -> int:
        """The padding id: the tokenizer's pad token, else its EOS, else 0."""
        tok = self.tokenizer
        for candidate in (tok.pad_token_id, tok.eos_token_id):
            if candidate is not None:
                return int(candidate)
        return 0

    # ------------------------------------------------------------------------------------------------ data

    def _load_eval(self) -> list[dict]:
        if self._eval_rows is None:
            rows: list[dict] = []
            for i, source in enumerate(self.eval_sources):
                dataset = load_source(source)
                if len(dataset) == 0:
                    raise ValueError(
                        f"data.eval_sources[{i}] ('{source.name}') gave no usable prompts; check the path/filters "
                        "or remove it."
                    )
                rows.extend(dataset.to_list())
            self._eval_rows = rows
        return self._eval_rows

    @property
    def rollout_meta(self) -> list[dict]:
        """``rollouts.json`` of each rollouts folder among the train sources (plus ``folder``), checked against
        ``data.target``; ``DraftModule.setup`` checks their weight fingerprints against the loaded target."""
        return [dict(m) for m in self._check_rollouts()]

    def _check_rollouts(self) -> list[dict]:
        if self._rollout_meta is None:
            metas = []
            for i, source in enumerate(self.train_sources):
                if not is_rollouts_folder(source.name):
                    continue
                _, meta = load_rollouts(source.name)
                if meta.get("target") != self.target:
                    raise ValueError(
                        f"data.train_sources[{i}] ('{source.name}') holds rollouts drawn from target "
                        f"'{meta.get('target')}', but data.target (model.target) is '{self.target}'; regenerate them "
                        f"with `lightning-spec rollouts --target {self.target} ...` or train against "
                        f"'{meta.get('target')}'."
                    )
                size = meta.get("tokenizer_size")
                if size is not None and size != len(self.tokenizer):
                    raise ValueError(
                        f"data.train_sources[{i}] ('{source.name}') was tokenized with a {size}-token vocabulary but "
                        f"this run's tokenizer has {len(self.tokenizer)}; regenerate the rollouts with this target."
                    )
                metas.append({**meta, "folder": source.name})
            self._rollout_meta = metas
        return self._rollout_meta

    def _rollout_rows(self, i: int, source: Source, held_out_prompts: set[tuple[int, ...]]) -> list[dict]:
        """Target-regenerated SFT rows: prompt + response, loss mask on the response (the target's own answers)."""
        dataset, _ = load_rollouts(source.name)
        limit = source.limit if source.limit is not None else self.train_limit
        rows = [
            {"id": e["id"], "domain": source.domain or e["domain"], "_enc": e["enc"], "_key": e["key"]}
            for e in sft_examples(dataset, self.max_length, held_out_prompts, limit)
        ]
        if not rows:
            raise ValueError(
                f"data.train_sources[{i}] ('{source.name}') gave no usable rollouts; it is empty, or its prompts "
                "are all data.eval_sources prompts (which never train): roll out other prompts."
            )
        return rows

    def _load_train(self) -> list[dict]:
        held_out: set[str] = set()
        for row in self._load_eval():
            held_out |= held_out_keys(row["messages"])
        held_out_prompts: set[tuple[int, ...]] | None = None
        self._check_rollouts()  # every rollouts folder was drawn from this target, before any data is read
        rows: list[dict] = []
        for i, source in enumerate(self.train_sources):
            if is_rollouts_folder(source.name):
                if held_out_prompts is None:  # a rollout is held out when its prompt is an eval prompt, token for token
                    held_out_prompts = {tuple(prompt_ids(self.tokenizer, opening(r))) for r in self._load_eval()}
                rows.extend(self._rollout_rows(i, source, held_out_prompts))
                continue
            dataset = load_source(source, limit=self.train_limit)
            kept = [r for r in dataset.to_list() if not (held_out_keys(r["messages"]) & held_out)]
            if not kept:
                raise ValueError(
                    f"data.train_sources[{i}] ('{source.name}') gave no usable conversations; check the "
                    "path/filters (conversations need a user turn, and eval prompts are removed from training)."
                )
            rows.extend(kept)
        return rows

    def setup(self, stage: str | None = None) -> None:
        """Load, hold out, tokenize and split once; later calls (fit, then validate) reuse the result."""
        if self.train_dataset is not None:
            return
        tok = self.tokenizer
        rows = self._load_train()
        examples = []
        for row in rows:
            if "_enc" in row:  # a rollout: already tokenized
                enc, key = row["_enc"], row["_key"]
            else:
                enc, key = tokenize_conversation(tok, row["messages"], self.max_length), first_user(row)
            if any(enc["loss_mask"]):  # the assistant must speak within max_length, or there is nothing to learn
                examples.append({**enc, "id": row["id"], "domain": row["domain"], "_key": key})
        if not examples:
            raise ValueError(
                f"no training conversation has an assistant token within data.max_length={self.max_length} "
                f"tokens ({len(rows)} conversations read from data.train_sources); raise data.max_length or use "
                "sources with assistant replies."
            )
        if len(examples) < 2:
            raise ValueError(
                "data.train_sources gave a single usable conversation, which cannot be split into train and "
                "validation; add data (raise data.train_limit or add sources)."
            )

        self._domains = sorted({e["domain"] for e in examples} | {r["domain"] for r in self._load_eval()})
        domain_id = {d: i for i, d in enumerate(self._domains)}
        train, val = self._split(examples)
        self.train_dataset = _finalize(train, domain_id)
        self.val_dataset = _finalize(val, domain_id)
        self._fingerprint = None

    def _split(self, examples: list[dict]) -> tuple[list[dict], list[dict]]:
        """Hold out ``val_fraction`` of the examples (at least one), grouped by first user message.

        Conversations sharing an opening prompt (ShareGPT repeats some) go to the same side, so validation
        never scores a prompt the drafter was trained on.
        """
        groups: dict[str, list[int]] = {}
        for i, e in enumerate(examples):
            groups.setdefault(e["_key"], []).append(i)
        keys = list(groups)
        if len(keys) < 2:
            raise ValueError(
                "data.train_sources has a single distinct conversation opening, which cannot be split into train "
                "and validation; add more conversations (raise data.train_limit or add sources)."
            )
        random.Random(self.seed).shuffle(keys)
        n_val = max(1, math.ceil(self.val_fraction * len(examples)))
        val_idx: list[int] = []
        for key in keys[:-1]:  # the last group always trains
            if len(val_idx) >= n_val:
                break
            val_idx.extend(groups[key])
        val_set = set(val_idx)
        train = [e for i, e in enumerate(examples) if i not in val_set]
        val = [examples[i] for i in sorted(val_set)]
        return train, val

    # ----------------------------------------------------------------------------------------- properties

    def _require_setup(self, what: str) -> None:
        if self.train_dataset is None:
            raise RuntimeError(f"SpecDataModule.{what} needs the data: call setup('fit') first.")

    @property
    def domains(self) -> list[str]:
        """Sorted union of the domains of the train and eval data; ``domain_id`` indexes this list."""
        self._require_setup("domains")
        return list(self._domains)

    @property
    def fingerprint(self) -> str:
        """Short sha256 of the tokenizer (name, vocab size), the train split's token ids and ``max_length``."""
        self._require_setup("fingerprint")
        if self._fingerprint is None:
            tok = self.tokenizer
            # The packaged/hub name, not a cache folder path, so two machines agree; a passed-in tokenizer is
            # known by its own name.
            name = getattr(tok, "name_or_path", "") if self._tokenizer_given else self.target
            h = hashlib.sha256(f"{name}|{len(tok)}|{self.max_length}|{len(self.train_dataset)}".encode())
            for e in self.train_dataset:
                ids = e["input_ids"]
                h.update(len(ids).to_bytes(4, "little"))
                h.update(ids.to(torch.int32).numpy().tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs at loss-masked positions of the train split, shape (V,)."""
        self._require_setup("token_counts")
        ids = torch.cat([e["input_ids"][e["loss_mask"]] for e in self.train_dataset])
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"the tokenizer produced token id {int(ids.max())} but vocab_size={vocab_size}; the target's "
                "vocabulary must cover its tokenizer (check model.target and data.target)."
            )
        return torch.bincount(ids, minlength=vocab_size)  # (V,)

    # --------------------------------------------------------------------------------------- eval prompts

    def eval_prompts(self) -> list[dict]:
        """Held-out prompts for speculative decoding during validation, ``eval_prompts_per_domain`` per domain.

        Each is ``{"id", "domain", "subdomain", "prompt_ids"}``. Within a domain the rows are shuffled with
        ``seed`` and then taken round-robin over subdomains, so eight MT-Bench prompts cover its eight
        categories. The prompt is the conversation up to its first assistant turn, with the generation header.
        """
        if self._eval_prompts is None:
            self._eval_prompts = domain_prompts(
                self.tokenizer, self._load_eval(), self.eval_prompts_per_domain, self.seed
            )
        return [dict(p, prompt_ids=list(p["prompt_ids"])) for p in self._eval_prompts]

    # ---------------------------------------------------------------------------------- domain weighting

    def set_domain_weights(self, weights: dict[str, float] | None) -> None:
        """Sample training examples with probability ∝ the weight of their domain (with replacement, epoch
        size = dataset size), from the next epoch on; None restores the plain seeded shuffle.

        Domains missing from ``weights`` get weight 0; at least one training domain needs a positive weight.
        """
        if weights is None:
            self._domain_weights = None
            return
        weights = {str(d): float(w) for d, w in weights.items()}
        bad = {d: w for d, w in weights.items() if not math.isfinite(w) or w < 0}
        if bad:
            raise ValueError(f"domain weights must be finite and >= 0, got {bad}.")
        if self.train_dataset is not None:
            unknown = sorted(set(weights) - set(self._domains))
            if unknown:
                raise ValueError(f"domain weights name unknown domains {unknown}; the domains are {self._domains}.")
            if not any(weights.get(e["domain"], 0.0) > 0 for e in self.train_dataset):
                raise ValueError(
                    f"domain weights {weights} give every training example weight 0; give a positive weight to "
                    f"one of the training domains {sorted({e['domain'] for e in self.train_dataset})}."
                )
        self._domain_weights = weights

    @property
    def domain_weights(self) -> dict[str, float] | None:
        return None if self._domain_weights is None else dict(self._domain_weights)

    def sample_weights(self) -> torch.Tensor | None:
        """Per-example sampling weights of the train split under the current domain weights (None: shuffle)."""
        if self._domain_weights is None:
            return None
        self._require_setup("sample_weights")
        return example_weights(self.train_dataset, self._domain_weights)

    def state_dict(self) -> dict[str, Any]:
        return {"domain_weights": self._domain_weights}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._domain_weights = state_dict.get("domain_weights")

    # ---------------------------------------------------------------------------------------- dataloaders

    def _collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        return collate(examples, self.pad_id)

    def train_dataloader(self) -> DataLoader:
        self._require_setup("train_dataloader")
        # this rank's shard of every epoch's order (DDP: num_replicas = world size; one process: the whole order)
        shard = getattr(self.trainer, "distributed_sampler_kwargs", None) or {}
        loader = TrainLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=DomainSampler(self, self.seed, shard.get("num_replicas", 1), shard.get("rank", 0)),
            collate_fn=self._collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
        check_val_check_interval(self.trainer, loader)  # where the trainer and the data meet
        return loader

    def val_dataloader(self) -> DataLoader:
        self._require_setup("val_dataloader")
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self._collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


def _finalize(examples: list[dict], domain_id: dict[str, int]) -> list[dict]:
    """Tensors, a domain id and the example's index in its split (the feature-cache key)."""
    return [
        {
            "input_ids": torch.tensor(e["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(e["loss_mask"], dtype=torch.bool),
            "domain_id": domain_id[e["domain"]],
            "domain": e["domain"],
            "index": index,
            "id": e["id"],
        }
        for index, e in enumerate(examples)
    ]

