"""Data: conversation sources, chat templates with assistant loss masks, and the Lightning data module."""

from lightning_spec.data.chat import prompt_ids, tokenize_conversation
from lightning_spec.data.datamodule import SpecDataModule
from lightning_spec.data.sources import PACKAGED, Source, iter_json_list, load_source

__all__ = [
    "PACKAGED",
    "Source",
    "SpecDataModule",
    "iter_json_list",
    "load_source",
    "prompt_ids",
    "tokenize_conversation",
]
