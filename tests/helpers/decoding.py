"""Greedy decoding's independent reference and the prompts the decoding tests share."""

import torch

MAX_NEW = 24  # new tokens per greedy comparison


def random_prompts(vocab: int, lengths=(1, 6, 13), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def argmax_reference(target, prompt: list[int], max_new: int) -> list[int]:
    """Greedy decoding with no cache: a full forward over the whole sequence for every new token, stopping
    after the first EOS. Independent of the engine (checked against transformers' ``generate`` in
    tests/decoding/test_engine.py)."""
    ids, eos = list(prompt), set(target.eos_token_ids)
    while len(ids) - len(prompt) < max_new and not (len(ids) > len(prompt) and ids[-1] in eos):
        ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
