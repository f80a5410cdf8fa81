"""Finding and loading a target: a packaged name, a local folder or a hub id resolved to a folder
(``assets.resolve_target_folder``), its remote code refused unless asked for, its tokenizer, the dtype ``auto``
resolves to on this device, and ``load_target`` itself, whole or head-only (an export needs only the embedding, the
final norm and the LM head). The ``Target`` it returns, and its options, are ``target.py``'s."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_spec.assets import PACKAGED_TARGETS, resolve_target_folder
from lightning_spec.cpu_kernels import SHARED_KV_SDPA, register_shared_kv_sdpa
from lightning_spec.errors import UserError
from lightning_spec.target import Target, TargetOptions, WeightsHash, check_decode


def _unknown_target(spec: str, err: BaseException) -> UserError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "trust_remote_code" in str(err):  # transformers' own refusal of a hub model's code
        return UserError(f"model.target {spec!r} needs the Python code of its repository; set "
                         "model.target_options.trust_remote_code: true if you trust that code.")
    offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
    return UserError(
        f"model.target {spec!r} is not a packaged name ({', '.join(PACKAGED_TARGETS)}), a local model folder, or a "
        f"Hugging Face hub id that can be loaded here{offline} ({reason.rstrip('.')})."
    )


@dataclass(frozen=True)
class TargetSource:
    """A target spec resolved once, at the edge: the name the user gave (``spec``: a packaged name, a folder or a hub
    id), what transformers loads (``folder``: the local folder, or the hub id itself), and how (``options``), with
    the unknown-name check and the remote-code refusal already passed. Loading passes this value on; nothing
    resolves the spec again (tests/test_target.py counts it)."""

    spec: str
    folder: str
    options: TargetOptions

    @classmethod
    def of(cls, spec: str | TargetSource, options: TargetOptions | dict | None = None) -> TargetSource:
        """``spec`` resolved (an already resolved source is returned as it is)."""
        if isinstance(spec, TargetSource):
            return spec
        options = TargetOptions.of(options)
        folder = resolve_target_folder(spec)
        if spec not in PACKAGED_TARGETS and not os.path.isdir(folder) and "/" not in spec.strip("/"):
            raise _unknown_target(spec, ValueError("no such folder, and hub ids have the form org/name"))
        refuse_remote_code(spec, folder, options)
        return cls(spec, folder, options)


def load_tokenizer(spec: str | TargetSource, options: TargetOptions | dict | None = None):
    """The one tokenizer loader: the tokenizer of a packaged name, a local folder or a hub id (at ``options``'
    revision, with its remote code only when ``options.trust_remote_code``)."""
    from transformers import AutoTokenizer

    source = TargetSource.of(spec, options)
    try:
        return AutoTokenizer.from_pretrained(source.folder, **source.options.loading())
    except (OSError, ValueError) as err:
        raise _unknown_target(source.spec, err) from None


def _local_config(folder: str) -> dict[str, Any] | None:
    """The config.json of a local model folder, or None (a hub id: transformers reads it remotely)."""
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def refuse_remote_code(spec: str, folder: str, options: TargetOptions) -> None:
    """Refuse, in one sentence, a model whose classes are its own Python code (``auto_map`` naming a model type that
    transformers does not have) unless ``trust_remote_code`` is on. A hub id's config is checked by transformers
    itself, whose error is reworded by ``_unknown_target``."""
    config = _local_config(folder)
    if options.trust_remote_code or not config or "auto_map" not in config:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config.get("model_type") in CONFIG_MAPPING:  # transformers has the class: no code from the folder runs
        return
    code = config["auto_map"].get("AutoModelForCausalLM") or next(iter(config["auto_map"].values()), "?")
    raise UserError(
        f"model.target {spec!r} needs the Python code in its folder ({code}, model type "
        f"{config.get('model_type')!r}); set model.target_options.trust_remote_code: true if you trust that code."
    )


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware: a CUDA GPU that supports bf16, or a CPU with AMX-BF16
    or AVX512-BF16 instructions (``torch.cpu.get_capabilities``). Elsewhere bf16 is emulated and slower than fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device = "cpu") -> torch.dtype:
    """A torch dtype from ``float32``/``bfloat16``/``float16``/a ``torch.dtype``, or ``auto``: bfloat16 where the
    device has native bf16 matrix units (``native_bf16``), float32 elsewhere. On a 2-core AMD EPYC (Zen 5,
    AVX512-BF16) plain greedy decoding of SmolLM2-135M in bf16 ran 1.7-1.9x fp32's tokens/s
    (``benchmarks/verify_cost.py``); bf16 rounds the 1-token and the verify forwards differently, so greedy
    speculative output can differ from plain output there (fp32 keeps the exact guarantee)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"target_dtype must be float32, bfloat16, float16 or auto, got {dtype!r}.")
    return getattr(torch, dtype)


def load_target(
    spec: str | TargetSource | Target | nn.Module,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    options: TargetOptions | dict | None = None,
    layers: bool = True,
    decode: str = "fast",
) -> Target:
    """A frozen ``Target`` from a packaged name, an HF hub id, a local folder, or a built ``transformers`` model.

    Packaged names: ``smollm2-135m-instruct`` (converted once from the shipped GGUF) and ``tiny-random``
    (2 layers, hidden 64, for tests). ``dtype``: fp32 by default on CPU (the exact guarantees are tested there);
    ``"auto"`` picks bf16 where the device multiplies it natively (``resolve_dtype``); ``torch.bfloat16`` on GPUs.
    ``options``: revision, trust_remote_code, attn_implementation, chat-template arguments (``TargetOptions``).
    ``layers=False``: build the model on the meta device and read only the embedding, the final norm and the LM head
    from its safetensors files, with the weights fingerprint streamed tensor by tensor: what a drafter needs to be
    reattached and exported, never the whole target in memory (``Target.has_layer_weights`` is then False).
    ``decode``: how decoding forwards run (``DECODE_PATHS``): ``fast`` (``FastForward`` where the architecture allows,
    ``fast_forward.py``) or ``transformers`` (the model's own forward).
    """
    check_decode(decode)
    options = TargetOptions.of(options)
    if isinstance(spec, Target):
        spec.decode = decode
        return spec
    if isinstance(spec, nn.Module):
        return Target(spec.to(device), tokenizer=None, options=options, decode=decode)
    if not isinstance(spec, (str, TargetSource)):
        raise TypeError(f"model.target must be a name, a folder or a transformers model, not {type(spec).__name__}.")
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype, device)
    source = TargetSource.of(spec, options)  # the one resolution of this load
    spec, folder, options = source.spec, source.folder, source.options
    attention = {} if options.attn_implementation is None else {"attn_implementation": options.attn_implementation}
    try:
        heads = None if layers else _heads_only(spec, folder, dtype, attention, options)
        if heads is None:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **attention, **options.loading())
            model = model.to(device)
        else:
            model, fingerprints = heads
    except (OSError, ValueError) as err:  # transformers reports an unknown name as a failed download
        raise _unknown_target(spec, err) from None
    if options.attn_implementation is None and getattr(model.config, "_attn_implementation", None) == "sdpa" \
            and layers and register_shared_kv_sdpa():
        model.set_attn_implementation(SHARED_KV_SDPA)  # same outputs, faster verify forwards on CPU
    return Target(model, tokenizer=load_tokenizer(source), name=spec, options=options,
                  fingerprints=None if heads is None else fingerprints, decode=decode, folder=folder)


def _heads_only(spec: str, folder: str, dtype: torch.dtype, attention: dict[str, Any],
                options: TargetOptions) -> tuple[nn.Module, tuple[str, str]] | None:
    """(the model on the meta device with its embedding, final norm and LM head read from the safetensors files,
    the weights fingerprints ``Target.fingerprints`` would compute) without holding more than one tensor of the rest
    in memory at a time. Local folders and the hub cache (``snapshot_download``'s files) alike. None, with a
    warning, where the weights are not safetensors under the model's own parameter names: load it whole then."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    files = _safetensors_files(folder, options)
    if not files:
        warnings.warn(f"target {spec!r} has no .safetensors weights; loading it whole to read its LM head.",
                      stacklevel=3)
        return None
    config = AutoConfig.from_pretrained(folder, **options.loading())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **attention,
                                                 trust_remote_code=options.trust_remote_code)
    with contextlib.ExitStack() as stack:  # each file opened once (memory-mapped), read tensor by tensor
        opened = [stack.enter_context(safe_open(str(path), framework="pt")) for path in files]
        where = {name: f for f in opened for name in f.keys()}
        missing = [n for n, _ in model.named_parameters() if n not in where]
        if missing:  # a checkpoint layout transformers renames on load (e.g. fused experts)
            warnings.warn(f"target {spec!r}: its safetensors names differ from the model's ({missing[0]}, ...); "
                          "loading it whole to read its LM head.", stacklevel=3)
            return None

        def read(name: str) -> Tensor:
            return where[name].get_tensor(name).to(dtype)

        names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter under its first (stored) name
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        heads = [model.get_input_embeddings(), model.get_output_embeddings(), getattr(decoder, "norm", None)]
        loaded: dict[str, nn.Parameter] = {}  # by name: a tied head and embedding share one parameter, read once
        for module in (m for m in heads if m is not None):
            for pname, param in list(module.named_parameters(recurse=False)):
                name = names[id(param)]
                if name not in loaded:
                    loaded[name] = nn.Parameter(read(name), requires_grad=False)
                setattr(module, pname, loaded[name])
        weights = WeightsHash(spec, config)  # Target.fingerprints, one tensor at a time
        for name, param in model.named_parameters():
            weights.add(name, param.detach() if name in loaded else read(name))  # the heads are already read
    return model, weights.digests()


def _safetensors_files(folder: str, options: TargetOptions) -> list[Path]:
    """The safetensors files of a local folder or of a hub id (in the hub cache, downloaded if missing)."""
    local = Path(folder)
    if not local.is_dir():
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(folder, revision=options.revision, allow_patterns=["*.json", "*.safetensors"]))
    return sorted(local.glob("*.safetensors"))
