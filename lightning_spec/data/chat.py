"""Chat templates and loss masks: which tokens of a conversation the drafter learns to predict.

The loss mask is 1 on the tokens of assistant messages: their content, first token included, and the
template's end-of-turn token (``<|im_end|>`` for ChatML), because the drafter must learn to predict where a
turn ends. It is 0 on everything the target is given rather than asked to produce: system prompts (a
template's default one included), user turns and the ``<|im_start|>assistant\\n`` headers.

We find the assistant spans without knowing the template: render the conversation up to an assistant turn
with ``add_generation_prompt=True`` (the prompt the model would see) and up to the end of that turn; the
characters in between are the turn, less trailing whitespace the template puts after its end-of-turn token.
Character spans become token masks through the fast tokenizer's offset mapping, so BPE merges across a
boundary cannot shift the mask by a token.
"""

from __future__ import annotations

from typing import Any

from lightning_spec.errors import UserError

# End-of-turn markers of common templates, for the fallback search when prefix rendering is not stable.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False, **template_kwargs: Any) -> str:
    """The chat-templated text of ``messages``; ``template_kwargs`` reach the template (Qwen3's ``enable_thinking``)."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "the tokenizer")
        raise UserError(
            f"{name} has no chat template; use an instruct/chat target (model.target) or set "
            "tokenizer.chat_template before building the data."
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def prompt_ids(tokenizer: Any, messages: list[dict], **template_kwargs: Any) -> list[int]:
    """Token ids of the chat-templated prompt with the assistant header appended (``add_generation_prompt``).

    ``messages`` are the turns before the answer (the user turns, optionally a system message).
    """
    text = render(tokenizer, messages, add_generation_prompt=True, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _end_of_turn_tokens(tokenizer: Any) -> list[str]:
    eos = getattr(tokenizer, "eos_token", None)
    return ([eos] if eos else []) + [t for t in _END_OF_TURN if t != eos]


def assistant_spans(
    tokenizer: Any, messages: list[dict], text: str, max_chars: int | None = None, **template_kwargs: Any
) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the assistant turns inside ``text`` (the rendered conversation).

    A span starts at the first character of the assistant's content (after the header) and ends after the
    template's end-of-turn marker. Turns starting at or after ``max_chars`` are skipped (they would be
    truncated away anyway).
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        span = None
        try:
            prompt = render(tokenizer, messages[:i], add_generation_prompt=True, **template_kwargs)
            turn = render(tokenizer, messages[: i + 1], **template_kwargs)
        except Exception:  # templates that reject a prefix (e.g. strict role alternation): search instead
            prompt = turn = None
        if prompt is not None and turn.startswith(prompt) and text.startswith(turn):
            if max_chars is not None and len(prompt) >= max_chars:
                break
            end = len(turn.rstrip())
            if end > len(prompt) >= cursor:
                span = (len(prompt), end)
        if span is None:
            span = _search_span(tokenizer, text, message["content"], cursor)
            if span is not None and max_chars is not None and span[0] >= max_chars:
                break
        if span is not None:
            spans.append(span)
            cursor = span[1]
    return spans


def _search_span(tokenizer: Any, text: str, content: str, cursor: int) -> tuple[int, int] | None:
    """Fallback: the content's next occurrence after ``cursor``, extended over an end-of-turn marker."""
    content = content.strip()
    start = text.find(content, cursor) if content else -1
    if start < 0:
        return None
    end = start + len(content)
    for marker in _end_of_turn_tokens(tokenizer):
        if text.startswith(marker, end):
            end += len(marker)
            break
    return start, end


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for tokens whose characters overlap a span (spans and offsets both sorted by position)."""
    mask = [0] * len(offsets)
    j = 0
    for k, (start, end) in enumerate(offsets):
        end = max(end, start + 1)  # zero-width tokens (e.g. a bare sentencepiece prefix) take their position
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        if j < len(spans) and spans[j][0] < end:
            mask[k] = 1
    return mask


# Characters kept after the last needed token when we tokenize only the head of a long text: a BPE
# pre-token (word, whitespace run) straddling the cut is re-tokenized, so the cut stays this far away.
_CUT_MARGIN = 1024


def _encode_head(tokenizer: Any, text: str, max_length: int) -> Any:
    """Encode (with offsets) at least the first ``max_length`` tokens of ``text``, without tokenizing all of it.

    ShareGPT conversations run to tens of thousands of tokens and we keep a few hundred; tokenizing a growing
    prefix is several times faster and gives the same first ``max_length`` tokens as the full text.
    """
    cut = max_length * 8 + _CUT_MARGIN
    while True:
        enc = tokenizer(text[:cut], add_special_tokens=False, return_offsets_mapping=True)
        if cut >= len(text):
            return enc
        offsets = enc["offset_mapping"]
        if len(offsets) > max_length and offsets[max_length - 1][1] <= cut - _CUT_MARGIN:
            return enc
        cut *= 2


def tokenize_conversation(
    tokenizer: Any, messages: list[dict], max_length: int, **template_kwargs: Any
) -> dict[str, list[int]]:
    """Token ids of the templated conversation and its assistant loss mask (every assistant turn), truncated to
    ``max_length`` tokens; ``template_kwargs`` reach the chat template.

    Returns ``{"input_ids": list[int], "loss_mask": list[int]}`` of equal length.
    """
    text = render(tokenizer, messages, **template_kwargs)
    try:
        enc = _encode_head(tokenizer, text, max_length)
        offsets = [tuple(o) for o in enc["offset_mapping"][:max_length]]
    except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets
        enc, offsets = tokenizer(text, add_special_tokens=False), None
    input_ids = list(enc["input_ids"][:max_length])
    if offsets is not None:
        max_chars = offsets[-1][1] if len(enc["input_ids"]) > max_length and offsets else None  # truncated
        spans = assistant_spans(tokenizer, messages, text, max_chars, **template_kwargs)
        loss_mask = _mask_from_offsets(offsets, spans)
    else:  # count the tokens of each span's prefix text instead (exact when boundaries do not merge)
        loss_mask = [0] * len(input_ids)
        for start, end in assistant_spans(tokenizer, messages, text, **template_kwargs):
            first = len(tokenizer(text[:start], add_special_tokens=False)["input_ids"])
            last = len(tokenizer(text[:end], add_special_tokens=False)["input_ids"])
            for k in range(first, min(last, len(input_ids))):
                loss_mask[k] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask}
