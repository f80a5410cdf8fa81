"""SpecDataModule: conversations -> tokenized, loss-masked, domain-labelled batches, plus held-out eval prompts.

Its ``__init__`` is the ``data:`` section of an experiment YAML. The conversations are tokenised once into an Arrow
table cached on disk (``data/tokenized.py``: ``prepare_data`` builds it on one process per node, a second run loads
it); after ``setup`` it holds

    train_dataset / val_dataset   ``Examples``: example i = {input_ids, loss_mask, domain_id, index, id, domain}, read
                                  from the memory-mapped table when asked for
    training_set                  what the training loader draws from: ``train_dataset``, or the replay buffer of
                                  an on-policy fit (``train_on``, a ``data.replay.ReplayBuffer``)
    domains                       sorted union of the train and eval domains; domain_id indexes it
    fingerprint                   sha256 of what a feature store depends on (the tokenised set, the train split)

and ``eval_prompts()`` gives the prompts that validation decodes for real (MAL per domain). The order in which
examples are trained (domain weights, DDP shards, mid-epoch resume) is ``loaders.py``'s.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_spec.data.chat import prompt_ids, tokenize_conversation
from lightning_spec.data.prompts import domain_prompts, first_user, opening
from lightning_spec.data.replay import ReplayBuffer
from lightning_spec.data.rollouts import is_rollouts_folder, load_rollouts, sft_examples
from lightning_spec.data.sources import Source, as_source, held_out_keys, load_source
from lightning_spec.data.tokenized import Examples, cache_key, source_identity, tokenized_set, tokenizer_identity
from lightning_spec.errors import UserError
from lightning_spec.loaders import DomainSampler, TrainLoader, check_val_check_interval, collate, example_weights
from lightning_spec.target import TargetOptions
from lightning_spec.target_loading import load_tokenizer


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
        target_options: how the target's tokenizer is loaded (revision, trust_remote_code) and its chat template
            applied (``chat_template_kwargs``, e.g. ``{enable_thinking: false}`` for Qwen3, everywhere: training
            conversations, eval prompts): ``TargetOptions``, linked from ``model.target_options`` by the CLI.
        num_proc: processes that tokenise the conversations; null: one per 4000 conversations, up to the CPUs.
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
        target_options: TargetOptions | None = None,
        num_proc: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer", "target_options"])
        self.target_options = TargetOptions.of(target_options)
        self.hparams["target_options"] = self.target_options.to_dict()
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
        self.chat_template_kwargs = dict(self.target_options.chat_template_kwargs)
        self.num_proc = num_proc
        self._tokenizer = tokenizer
        self._tokenizer_given = tokenizer is not None
        self._check_args()

        self.train_dataset: Examples | None = None  # the training split of the data
        self.replay: ReplayBuffer | None = None  # an on-policy fit's training set instead (``train_on``)
        self.val_dataset: Examples | None = None
        self._eval_rows: list[dict] | None = None
        self._eval_prompts: list[dict] | None = None
        self._domains: list[str] | None = None
        self._fingerprint: str | None = None
        self._content: str | None = None  # the tokenised set's content fingerprint
        self._domain_weights: dict[str, float] | None = None
        self._rollout_meta: list[dict] | None = None

    def _check_args(self) -> None:
        if self.max_length < 2:
            raise UserError(f"data.max_length={self.max_length} must be at least 2 tokens; raise it (e.g. 512).")
        if not 0.0 <= self.val_fraction < 1.0:
            raise UserError(f"data.val_fraction={self.val_fraction} must be in [0, 1); use e.g. 0.02.")
        if self.batch_size < 1:
            raise UserError(f"data.batch_size={self.batch_size} must be at least 1.")
        if self.train_limit is not None and self.train_limit < 1:
            raise UserError(f"data.train_limit={self.train_limit} must be at least 1, or null for all rows.")
        if self.eval_prompts_per_domain < 0:
            raise UserError(f"data.eval_prompts_per_domain={self.eval_prompts_per_domain} must be >= 0.")
        if self.num_proc is not None and self.num_proc < 1:
            raise UserError(f"data.num_proc={self.num_proc} must be at least 1, or null to choose.")
        if not self.train_sources:
            raise UserError("data.train_sources is empty; name at least one source, e.g. ['sharegpt'].")

    # ------------------------------------------------------------------------------------------ tokenizer

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.target, self.target_options)
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
                    raise UserError(
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
                    raise UserError(
                        f"data.train_sources[{i}] ('{source.name}') holds rollouts drawn from target "
                        f"'{meta.get('target')}', but data.target (model.target) is '{self.target}'; regenerate them "
                        f"with `lightning-spec rollouts --target {self.target} ...` or train against "
                        f"'{meta.get('target')}'."
                    )
                size = meta.get("tokenizer_size")
                if size is not None and size != len(self.tokenizer):
                    raise UserError(
                        f"data.train_sources[{i}] ('{source.name}') was tokenized with a {size}-token vocabulary but "
                        f"this run's tokenizer has {len(self.tokenizer)}; regenerate the rollouts with this target."
                    )
                metas.append({**meta, "folder": source.name})
            self._rollout_meta = metas
        return self._rollout_meta

    def _rollout_rows(self, i: int, source: Source, held_out_prompts: set[tuple[int, ...]]) -> datasets.Dataset:
        """Target-regenerated SFT rows, already tokenised: prompt + response, loss on the response (the target's own
        answers), or a regenerated multi-turn conversation with the loss on every assistant turn."""
        dataset, meta = load_rollouts(source.name)
        limit = source.limit if source.limit is not None else self.train_limit
        examples = sft_examples(dataset, self.max_length, held_out_prompts, limit, self.tokenizer,
                                meta.get("chat_template_kwargs"))
        if not examples:
            raise UserError(
                f"data.train_sources[{i}] ('{source.name}') gave no usable rollouts; it is empty, or its prompts "
                "are all data.eval_sources prompts (which never train): roll out other prompts."
            )
        return datasets.Dataset.from_dict({
            "id": [e["id"] for e in examples], "domain": [source.domain or e["domain"] for e in examples],
            "key": [e["key"] for e in examples], "input_ids": [e["enc"]["input_ids"] for e in examples],
            "loss_mask": [[bool(m) for m in e["enc"]["loss_mask"]] for e in examples],
        })

    def _read_train(self) -> list[tuple[datasets.Dataset, Any]]:
        """Per training source: its usable conversations (eval prompts held out) and the function that tokenises one
        (``data/tokenized.py`` runs it with ``datasets.map``)."""
        held_out: set[str] = set()
        for row in self._load_eval():
            held_out |= held_out_keys(row["messages"])
        held_out_prompts: set[tuple[int, ...]] | None = None
        self._check_rollouts()  # every rollouts folder was drawn from this target, before any data is read
        parts = []
        for i, source in enumerate(self.train_sources):
            if is_rollouts_folder(source.name):
                if held_out_prompts is None:  # a rollout is held out when its prompt is an eval prompt, token for token
                    held_out_prompts = {tuple(prompt_ids(self.tokenizer, opening(r), **self.chat_template_kwargs))
                                        for r in self._load_eval()}
                parts.append((self._rollout_rows(i, source, held_out_prompts), None))  # tokenised already
                continue
            dataset = load_source(source, limit=self.train_limit)
            kept = dataset.filter(lambda r: not (held_out_keys(r["messages"]) & held_out),
                                  new_fingerprint=f"held-out-{i}")
            if len(kept) == 0:
                raise UserError(
                    f"data.train_sources[{i}] ('{source.name}') gave no usable conversations; check the "
                    "path/filters (conversations need a user turn, and eval prompts are removed from training)."
                )
            parts.append((kept, _Tokenize(self.tokenizer, self.max_length, self.chat_template_kwargs)))
        return parts

    def _cache_key(self) -> str:
        """What the tokenised set depends on, without reading any data (``data/tokenized.py``)."""
        name = getattr(self.tokenizer, "name_or_path", "") if self._tokenizer_given else self.target
        return cache_key({
            "train": [[source_identity(s.name), s.domain, s.limit, s.split] for s in self.train_sources],
            "eval": [[source_identity(s.name), s.domain, s.limit, s.split] for s in self.eval_sources],
            "train_limit": self.train_limit, "max_length": self.max_length,
            "tokenizer": tokenizer_identity(self.tokenizer, name), "chat_template_kwargs": self.chat_template_kwargs,
        })

    def prepare_data(self) -> None:
        """Tokenise the training conversations into the on-disk cache (Lightning calls this on one process per node
        before any process sets up)."""
        tokenized_set(self._cache_key(), self._read_train, self.num_proc)

    def setup(self, stage: str | None = None) -> None:
        """Load (or build) the tokenised set, then split it once; later calls (fit, then validate) reuse the result."""
        if self.train_dataset is not None:
            return
        table, meta = tokenized_set(self._cache_key(), self._read_train, self.num_proc)
        if len(table) == 0:
            raise UserError(
                f"no training conversation has an assistant token within data.max_length={self.max_length} "
                f"tokens ({meta['conversations']} conversations read from data.train_sources); raise data.max_length "
                "or use sources with assistant replies."
            )
        if len(table) < 2:
            raise UserError(
                "data.train_sources gave a single usable conversation, which cannot be split into train and "
                "validation; add data (raise data.train_limit or add sources)."
            )
        columns = table.select_columns(["domain", "key"])
        domains, keys = columns["domain"], columns["key"]
        self._domains = sorted(set(domains) | {r["domain"] for r in self._load_eval()})
        domain_id = {d: i for i, d in enumerate(self._domains)}
        train, val = self._split(keys)
        self.train_dataset = Examples(table, train, domain_id)
        self.val_dataset = Examples(table, val, domain_id)
        self._content, self._fingerprint = meta["fingerprint"], None

    def _split(self, keys: list[str]) -> tuple[list[int], list[int]]:
        """Row numbers of the train and validation examples: ``val_fraction`` of them (at least one) held out,
        grouped by ``keys`` (the first user message).

        Conversations sharing an opening prompt (ShareGPT repeats some) go to the same side, so validation
        never scores a prompt the drafter was trained on.
        """
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        order = list(groups)
        if len(order) < 2:
            raise UserError(
                "data.train_sources has a single distinct conversation opening, which cannot be split into train "
                "and validation; add more conversations (raise data.train_limit or add sources)."
            )
        random.Random(self.seed).shuffle(order)
        n_val = max(1, math.ceil(self.val_fraction * len(keys)))
        val_idx: list[int] = []
        for key in order[:-1]:  # the last group always trains
            if len(val_idx) >= n_val:
                break
            val_idx.extend(groups[key])
        val_set = set(val_idx)
        return [i for i in range(len(keys)) if i not in val_set], sorted(val_set)

    def check_trained_for(self, target_fingerprints: tuple[str, ...], target_spec: str, block_size: int) -> None:
        """Refuse, in one sentence, data a fit of this target and block size cannot train on: rollouts of other
        target weights (target-regenerated SFT holds for the same weights only; ``Target.fingerprints``), or a block
        no example holds."""
        for meta in self.rollout_meta:
            if meta.get("target_fingerprint") not in target_fingerprints:
                raise UserError(
                    f"data.train_sources '{meta['folder']}' holds rollouts of target '{meta.get('target')}' with "
                    f"weight fingerprint {meta.get('target_fingerprint')}, but model.target has fingerprint "
                    f"{target_fingerprints[0]}; regenerate them with `lightning-spec rollouts --target {target_spec} "
                    "...`."
                )
        self.check_block_size(block_size)

    def dataset_input(self) -> dict[str, Any]:
        """The training data as a run's MLflow dataset input: name, content digest, source and rows."""
        sources, rows = ", ".join(s.name for s in self.train_sources), len(self.train_dataset)
        return {"name": sources[:200], "digest": self.fingerprint, "source": sources, "rows": rows}

    def check_block_size(self, block_size: int) -> None:
        """Refuse, in one sentence, a drafter block that no example can hold: an anchor needs a token before it and
        the K it drafts after it (``block_size + 2 <= max_length``)."""
        if block_size + 2 > self.max_length:
            raise UserError(
                f"model.drafter.block_size={block_size} needs data.max_length >= block_size + 2 (got "
                f"{self.max_length}); raise data.max_length or lower model.drafter.block_size."
            )

    def train_on(self, buffer: ReplayBuffer) -> None:
        """Train on ``buffer`` (on-policy rollouts, ``OnPolicyRollouts``) instead of the data from now on: the object
        itself, which its owner refreshes in place. The draft vocabulary, the prompts and ``fingerprint`` keep
        coming from the data (``train_dataset``)."""
        self._require_setup("train_on")
        self.replay = buffer

    @property
    def training_set(self) -> Examples | ReplayBuffer:
        """What the training loader draws from: the replay buffer of an on-policy fit, else the data's train split."""
        self._require_setup("training_set")
        return self.replay if self.replay is not None else self.train_dataset

    def train_domains(self) -> list[str]:
        """The domain of every training example, in order."""
        return self.training_set.domains

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
        """Short sha256 of the tokenised set's content, the train split's rows and ``max_length``: what a feature
        store of this data depends on, the same on every machine."""
        self._require_setup("fingerprint")
        if self._fingerprint is None:
            rows = self.train_dataset.rows
            h = hashlib.sha256(f"{self._content}|{self.max_length}|{len(rows)}".encode())
            h.update(torch.tensor(rows, dtype=torch.int64).numpy().tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs at loss-masked positions of the train split, shape (V,)."""
        self._require_setup("token_counts")
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for e in self.train_dataset:
            ids = e["input_ids"][e["loss_mask"]]
            if ids.numel() and int(ids.max()) >= vocab_size:
                raise UserError(
                    f"the tokenizer produced token id {int(ids.max())} but vocab_size={vocab_size}; the target's "
                    "vocabulary must cover its tokenizer (check model.target and data.target)."
                )
            counts += torch.bincount(ids, minlength=vocab_size)
        return counts  # (V,)

    # --------------------------------------------------------------------------------------- eval prompts

    def eval_prompts(self) -> list[dict]:
        """Held-out prompts for speculative decoding during validation, ``eval_prompts_per_domain`` per domain.

        Each is ``{"id", "domain", "subdomain", "prompt_ids"}``. Within a domain the rows are shuffled with
        ``seed`` and then taken round-robin over subdomains, so eight MT-Bench prompts cover its eight
        categories. The prompt is the conversation up to its first assistant turn, with the generation header.
        """
        if self._eval_prompts is None:
            self._eval_prompts = domain_prompts(
                self.tokenizer, self._load_eval(), self.eval_prompts_per_domain, self.seed, self.chat_template_kwargs
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
            raise UserError(f"domain weights must be finite and >= 0, got {bad}.")
        if self.train_dataset is not None:
            unknown = sorted(set(weights) - set(self._domains))
            if unknown:
                raise UserError(f"domain weights name unknown domains {unknown}; the domains are {self._domains}.")
            train_domains = set(self.train_domains())
            if not any(weights.get(d, 0.0) > 0 for d in train_domains):
                raise UserError(
                    f"domain weights {weights} give every training example weight 0; give a positive weight to "
                    f"one of the training domains {sorted(train_domains)}."
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
        return example_weights(self.train_domains(), self._domain_weights)

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
            self.training_set,
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


class _Tokenize:
    """One conversation -> the tokenised set's columns (``data/tokenized.py``): ids and the loss mask on every
    assistant turn, truncated to ``max_length``; no assistant token within it: empty ids (dropped). A class, not a
    closure, so ``datasets.map`` can send it to worker processes."""

    def __init__(self, tokenizer: Any, max_length: int, template_kwargs: dict[str, Any]) -> None:
        self.tokenizer, self.max_length, self.template_kwargs = tokenizer, max_length, template_kwargs

    def __call__(self, row: dict) -> dict:
        enc = tokenize_conversation(self.tokenizer, row["messages"], self.max_length, **self.template_kwargs)
        useful = any(enc["loss_mask"])  # the assistant must speak within max_length, or there is nothing to learn
        return {"id": row["id"], "domain": row["domain"], "key": first_user(row),
                "input_ids": enc["input_ids"] if useful else [],
                "loss_mask": [bool(m) for m in enc["loss_mask"]] if useful else []}

