"""Where rollouts are drawn: our own target in this process, or any OpenAI-compatible server (vLLM, SGLang).

A unit of work is a conversation: its user turns (and system prompt) from the source, and ``sample``. Every assistant
turn is regenerated given the regenerated history: turn t's prompt is the chat template applied to the source's
messages before its t-th assistant turn, with the target's own answers in place of the source's
(``conversation_prompt``; chat-template keyword arguments such as Qwen3's ``enable_thinking`` reach it). A turn
that hits ``max_new_tokens`` without an end-of-sequence token ends the conversation there, as does a prompt
longer than ``max_prompt_tokens``.

Both engines yield finished conversations (``Regenerated``) for the writer (``rollout_writer.py``) to store:

- ``LocalEngine``: batched plain decoding with our ``Target`` (``decoding/batched.py``), ``batch_size``
  conversations at a time, turn by turn; tokens are reproducible from the seed (exact on CPU in fp32);
- ``ServerEngine``: ``/v1/completions`` requests with the prompt as token ids (so the server's tokenizer and
  template play no part), ``concurrency`` conversations in flight, a per-request seed, and the generated token ids
  back (vLLM's ``return_token_ids``; SGLang and others: the ``token_id:N`` tokens of ``return_tokens_as_token_ids``).
  Sampled tokens follow the target's distribution but not our seeds' streams; greedy ones equal ours up to the two
  engines' float rounding (measured in benchmarks/README.md, "``regeneration_speed.py``: our engine against vLLM's
  server on the same prompts"; usage in docs/data.md, "Regenerating with a serving engine").
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_spec.data.chat import prompt_ids
from lightning_spec.decoding.batched import sample_batch
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target


@dataclass
class Conversation:
    """One conversation to regenerate: ``messages`` are the source's (assistant turns are replaced), ``prompt_ids``
    its first turn's chat-templated prompt."""

    id: str
    sample: int
    seed: int
    domain: str
    subdomain: str
    prompt_ids: list[int]
    messages: list[dict] = field(default_factory=list)  # empty: a bare token prompt (one turn)


@dataclass
class Regenerated:
    """A finished conversation: per turn its prompt ids, response ids and whether it ended with EOS, and the whole
    conversation as text with the target's answers (``messages``)."""

    conversation: Conversation
    prompts: list[list[int]]
    responses: list[list[int]]
    finished: list[bool]
    messages: list[dict]


def user_turns(messages: Sequence[dict]) -> list[list[dict]]:
    """The source's non-assistant messages split at its assistant turns: what precedes assistant turn 1, 2, ...
    A conversation without an assistant turn (a bare prompt) has one part."""
    parts: list[list[dict]] = [[]]
    for message in messages:
        if message["role"] == "assistant":
            parts.append([])
        else:
            parts[-1].append(message)
    return [p for p in parts if p] or [[]]


class Turns:
    """Walks one conversation turn by turn: the next prompt, then the answer it got."""

    def __init__(self, conversation: Conversation, tokenizer: Any, max_turns: int | None, max_prompt_tokens: int | None,
                 chat_template_kwargs: dict | None) -> None:
        self.conversation = conversation
        self.tokenizer, self.kwargs = tokenizer, chat_template_kwargs or {}
        # a bare token prompt, or no tokenizer to template later turns with: one turn
        parts = user_turns(conversation.messages) if conversation.messages and tokenizer is not None else [[]]
        self.parts = parts[:max_turns] if max_turns else parts
        self.max_prompt_tokens = max_prompt_tokens
        self.history: list[dict] = []
        self.prompts: list[list[int]] = []
        self.responses: list[list[int]] = []
        self.finished: list[bool] = []

    def next_prompt(self) -> list[int] | None:
        """The next turn's prompt ids, or None when the conversation is over."""
        t = len(self.responses)
        if t >= len(self.parts) or (t and not self.finished[-1]):
            return None
        if t == 0:
            ids = self.conversation.prompt_ids
        else:
            ids = prompt_ids(self.tokenizer, self.history + self.parts[t], **self.kwargs)
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                return None
        return ids

    def answer(self, prompt: list[int], response: list[int], finished: bool) -> None:
        t = len(self.responses)
        self.prompts.append(prompt)
        self.responses.append(response)
        self.finished.append(finished)
        if self.tokenizer is not None and self.conversation.messages:
            text = self.tokenizer.decode(response, skip_special_tokens=True).strip()
            self.history += self.parts[t] + [{"role": "assistant", "content": text}]

    def done(self) -> Regenerated:
        return Regenerated(self.conversation, self.prompts, self.responses, self.finished, self.history)


class Engine:
    """Draws the target's answers to conversations; ``run`` yields them as they finish."""

    name = "engine"
    shard_rows = 1  # the writer stores finished conversations in shards of at least this many (or every 30 s)

    def describe(self) -> dict[str, Any]:
        """What the rollouts record about the engine (``rollouts.json``)."""
        return {"engine": self.name}

    def run(self, conversations: list[Conversation], sampling: SamplingConfig, max_new_tokens: int,
            turns: Callable[[Conversation], Turns], eos_ids: Sequence[int]) -> Iterator[list[Regenerated]]:
        """Regenerate ``conversations``; ``turns`` walks one; a turn ends at one of ``eos_ids`` (the target's)."""
        raise NotImplementedError

    def probe(self, prompts: list[list[int]], sampling: SamplingConfig, eos_ids: Sequence[int]) -> tuple[float, float]:
        """(seconds per prompt token of prefill, seconds per generated token) measured on a short run of ``prompts``:
        the estimate printed before a regeneration starts."""
        raise NotImplementedError


class LocalEngine(Engine):
    """Our target, in this process: ``batch_size`` conversations decoded together (left padding), turn by turn."""

    name = "local"  # a shard per batch (shard_rows = 1: each ``run`` yield is a batch)

    def __init__(self, target: Target, batch_size: int = 8) -> None:
        if batch_size < 1:
            raise UserError(f"--batch_size={batch_size} must be at least 1.")
        self.target, self.batch_size = target, batch_size

    def run(self, conversations, sampling, max_new_tokens, turns, eos_ids):
        # the target's own EOS ids end a turn (sample_batch); the longest first prompts first and similar lengths
        # together: less padding; the order changes no token
        order = sorted(conversations, key=lambda c: (-len(c.prompt_ids), c.id, c.sample))
        for lo in range(0, len(order), self.batch_size):
            walks = [turns(c) for c in order[lo : lo + self.batch_size]]
            active = [(w, w.next_prompt()) for w in walks]
            turn = 0
            while active := [(w, p) for w, p in active if p is not None]:
                # turn t of a conversation draws from its seed + t: every turn its own stream, batch-independent
                results = sample_batch(self.target, [p for _, p in active],
                                       [w.conversation.seed + turn for w, _ in active], sampling, max_new_tokens)
                for (walk, prompt), (response, finished) in zip(active, results):
                    walk.answer(prompt, response, finished)
                active = [(w, w.next_prompt()) for w, _ in active]
                turn += 1
            yield [w.done() for w in walks]

    def probe(self, prompts, sampling, eos_ids):
        batch = prompts[: self.batch_size]
        seeds = list(range(len(batch)))
        start = time.perf_counter()
        sample_batch(self.target, batch, seeds, sampling, 1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        sample_batch(self.target, batch, seeds, sampling, 9)
        per_step = max(time.perf_counter() - start - prefill, 0.0) / 8
        return prefill / max(sum(map(len, batch)), 1), per_step / len(batch)


class ServerError(UserError):
    """A server that cannot be reached or refuses a request: one sentence naming ``--server_url``."""


class ServerEngine(Engine):
    """Any OpenAI-compatible server (vLLM, SGLang): ``concurrency`` conversations in flight.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8000`` (``/v1`` is added when missing).
        model: the served model name; None takes the server's only model.
        concurrency: conversations in flight at once (one request each).
        timeout: seconds a request may take before it is retried.
        retries: attempts per request before the run stops (what is written stays; rerun to resume).
    """

    name = "server"

    def __init__(self, url: str, model: str | None = None, concurrency: int = 64, timeout: float = 600.0,
                 retries: int = 3) -> None:
        if concurrency < 1:
            raise UserError(f"--concurrency={concurrency} must be at least 1.")
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else f"{base}/v1"
        self.url, self.concurrency, self.timeout, self.retries = url, concurrency, timeout, retries
        self.shard_rows = concurrency  # conversations finish one by one here: a shard per round of them
        self.model = self._check_model(model)

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "server_url": self.url, "server_model": self.model}

    # ------------------------------------------------------------------------------------------------ HTTP
    def _call(self, path: str, payload: dict | None = None, timeout: float | None = None) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(f"{self.base}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            body = err.read().decode(errors="replace")[:300]
            raise ServerError(f"the server at --server_url {self.url} answered {path} with HTTP {err.code} "
                              f"({body.strip()}); check --server_model and the server's log.") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ServerError(f"no OpenAI-compatible server answers at --server_url {self.url} ({reason}); start one "
                              "(`make serve-target` for the packaged target) or fix the URL.") from None

    def _check_model(self, model: str | None) -> str:
        served = [m["id"] for m in self._call("/models", timeout=30).get("data", [])]
        if model is None:
            if len(served) != 1:
                raise ServerError(f"the server at --server_url {self.url} serves {served}; name one with "
                                  "--server_model.")
            return served[0]
        if model not in served:
            raise ServerError(f"the server at --server_url {self.url} serves {served}, not --server_model "
                              f"'{model}'; pass one of those.")
        return model

    def complete(self, prompt: list[int], sampling: SamplingConfig, max_new_tokens: int, seed: int,
                 stop_ids: Sequence[int]) -> tuple[list[int], bool]:
        """One completion: (response token ids, ended with a stop id)."""
        payload = {
            "model": self.model, "prompt": prompt, "max_tokens": max_new_tokens,
            "temperature": float(sampling.temperature), "top_p": float(sampling.top_p), "seed": int(seed) % 2**63,
            "stop_token_ids": list(stop_ids), "skip_special_tokens": False, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "logprobs": 0,
        }
        if sampling.top_k > 0:
            payload["top_k"] = int(sampling.top_k)
        for attempt in range(self.retries):
            try:
                choice = self._call("/completions", payload)["choices"][0]
                break
            except ServerError:
                if attempt + 1 == self.retries:
                    raise
                time.sleep(2**attempt)
        ids = choice.get("token_ids")
        if ids is None:  # servers without return_token_ids: the logprobs' "token_id:N" tokens
            tokens = (choice.get("logprobs") or {}).get("tokens")
            if not tokens or not all(str(t).startswith("token_id:") for t in tokens):
                raise ServerError(f"the server at --server_url {self.url} returned no token ids (neither "
                                  "return_token_ids nor return_tokens_as_token_ids); use vLLM or SGLang.")
            ids = [int(str(t).split(":", 1)[1]) for t in tokens]
        ids = [int(t) for t in ids]
        stopped = bool(ids) and ids[-1] in set(stop_ids)
        if choice.get("finish_reason") == "stop" and stop_ids and not stopped and len(ids) < max_new_tokens:
            stopped = True  # a server that leaves the stop token out of its output (SGLang's default)
            ids.append(int(stop_ids[0]))
        return ids, stopped

    # --------------------------------------------------------------------------------------------- the run
    def run(self, conversations, sampling, max_new_tokens, turns, eos_ids):
        stop_ids = sorted(set(eos_ids))

        def regenerate(conversation: Conversation) -> Regenerated:
            walk = turns(conversation)
            turn = 0
            while (prompt := walk.next_prompt()) is not None:
                response, finished = self.complete(prompt, sampling, max_new_tokens, conversation.seed + turn,
                                                   stop_ids)
                walk.answer(prompt, response, finished)
                turn += 1
            return walk.done()

        pending = iter(conversations)
        with ThreadPoolExecutor(self.concurrency) as pool:
            flight: set[Future] = set()
            try:
                for c in pending:
                    flight.add(pool.submit(regenerate, c))
                    if len(flight) >= self.concurrency:
                        break
                while flight:
                    done, flight = wait(flight, return_when=FIRST_COMPLETED)
                    yield [f.result() for f in done]
                    for c in pending:
                        flight.add(pool.submit(regenerate, c))
                        if len(flight) >= self.concurrency:
                            break
            finally:
                for f in flight:
                    f.cancel()

    def probe(self, prompts, sampling, eos_ids):
        stop = sorted(set(eos_ids))
        batch = prompts[: min(self.concurrency, 8)]

        def timed(max_tokens: int) -> tuple[float, int]:
            start = time.perf_counter()
            with ThreadPoolExecutor(len(batch)) as pool:
                made = sum(len(r) for r, _ in pool.map(lambda p: self.complete(p, SamplingConfig(), max_tokens, 0,
                                                                                stop), batch))
            return time.perf_counter() - start, made

        prefill, _ = timed(1)  # the prompts' first prefill
        again, first = timed(1)  # the same prompts again: what a repeated prefill costs (~0 with a prefix cache)
        total, made = timed(17)  # the same prompts, 16 more tokens each (fewer where EOS comes first)
        per_token = max(total - again, 1e-6) / max(made - first, 1)
        return prefill / max(sum(map(len, batch)), 1), per_token
