"""Data: conversation sources, chat templates with assistant loss masks, prompt selection and target rollouts.

Nothing here imports Lightning; the Lightning data module that batches this data is ``lightning_spec.datamodule``.
"""

from lightning_spec.data.chat import prompt_ids, tokenize_conversation
from lightning_spec.data.sources import PACKAGED, Source, iter_json_list, load_source

__all__ = [
    "PACKAGED",
    "Source",
    "iter_json_list",
    "load_source",
    "prompt_ids",
    "tokenize_conversation",
]
