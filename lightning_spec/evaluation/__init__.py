"""Evaluation: real decoding over prompt sets (benchmark.py); offline exact rounds and paired tests later."""

from lightning_spec.evaluation.benchmark import DecodeReport, decode_prompts

__all__ = ["DecodeReport", "decode_prompts"]
