"""The model a replica trains when the run names one (``--model``): where it runs, in what
precision, loaded how, and which of its parameters DiLoCo exchanges.

Used by the built-in jobs (composer, sft and lm), so a Hub id or a folder is loaded the same way
everywhere:

- :func:`choose_device` / :func:`choose_dtype` turn ``--device`` / ``--precision`` (``auto``
  included) into a decision; pure functions of what the hardware offers, so they are tested
  without a GPU. :class:`Placement` carries the decision to the trainers
  (:meth:`Placement.trainer_args`: ``use_cpu``, ``bf16``, ``fp16``).
- :func:`load_pretrained`: tokenizer and causal LM through ``from_pretrained`` (remote code
  only with ``--trust-remote-code``), a pad token where the tokenizer has none (its EOS), the
  chat template kept as the tokenizer carries it. ``from_pretrained`` is deterministic, so
  every replica starts from the same weights.
- Full fine-tuning keeps fp32 master weights and trains bf16/fp16 under autocast (mixed
  precision): DiLoCo's pseudo-gradients are differences of weights, which bf16 weights would
  round away. With LoRA (crf/replica/lora.py: ``--lora-target-modules``, checked) the
  frozen base is loaded in the compute dtype (it never changes) and peft keeps the adapters
  in fp32; the adapters' random initial values are drawn from the run's seed, so every
  replica starts bit-identical. Only parameters with ``requires_grad`` are exchanged
  (crf/replica/context.py), so P is the adapters' size.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

#: a run's precision names -> torch dtype names
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def choose_device(requested: str, cuda_available: bool) -> str:
    """``cuda`` or ``cpu`` for ``--device`` (``auto``: cuda when there is one). ValueError for
    ``cuda`` on a machine without a GPU: training on the CPU instead would be silently slow."""
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    if requested == "cuda" and not cuda_available:
        raise ValueError(
            "--device cuda but this replica has no CUDA GPU (torch.cuda.is_available() is "
            "False): ask the backend for a GPU (--gpu) or use --device auto"
        )
    if requested not in ("cuda", "cpu"):
        raise ValueError(f"--device {requested!r} is unknown; choose auto, cuda or cpu")
    return requested


def choose_dtype(requested: str, device: str, bf16_supported: bool) -> str:
    """``bf16``, ``fp16`` or ``fp32`` for ``--precision`` on ``device`` (``auto``: bf16 on a
    CUDA GPU that supports it, else fp32). ValueError for what the hardware cannot do."""
    if requested == "auto":
        return "bf16" if device == "cuda" and bf16_supported else "fp32"
    if requested not in DTYPES:
        raise ValueError(f"--precision {requested!r} is unknown; choose auto, bf16, fp16 or fp32")
    if requested == "fp16" and device != "cuda":
        raise ValueError("--precision fp16 needs a CUDA GPU; on a CPU use bf16 or fp32")
    if requested == "bf16" and device == "cuda" and not bf16_supported:
        raise ValueError(
            "--precision bf16 but this GPU has no bfloat16 of its own (pre-Ampere, where "
            "torch emulates it): use fp16 or fp32"
        )
    return requested


def native_bf16() -> bool:
    """Whether this machine's CUDA GPU computes in bfloat16 itself (Ampere and later).
    ``torch.cuda.is_bf16_supported()`` also says yes for a T4 or a V100, where bf16 is
    emulated: slower than fp32 there, and SDPA's fused kernels refuse it."""
    import torch

    return bool(
        torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    )


@dataclass(frozen=True)
class Placement:
    """Where a replica trains and in what precision (``dtype``: bf16, fp16 or fp32)."""

    device: str
    dtype: str

    @classmethod
    def for_spec(cls, spec: Any) -> Placement:
        """The decision for this machine from the run's ``device`` and ``precision``."""
        import torch

        cuda = torch.cuda.is_available()
        device = choose_device(getattr(spec, "device", "auto"), cuda)
        bf16 = bool(cuda and device == "cuda" and native_bf16())
        return cls(device, choose_dtype(getattr(spec, "precision", "auto"), device, bf16))

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, DTYPES[self.dtype])

    def trainer_args(self) -> dict[str, Any]:
        """The ``TrainingArguments`` fields that follow from the placement (mixed precision
        under autocast; the weights stay as loaded)."""
        return {
            "use_cpu": self.device == "cpu",
            "bf16": self.dtype == "bf16",
            "fp16": self.dtype == "fp16",
        }

    def autocast(self) -> Any:
        """An autocast context for a hand-written training loop (a no-op in fp32)."""
        import torch

        return torch.autocast(self.device, dtype=self.torch_dtype, enabled=self.dtype != "fp32")


def require_peft() -> None:
    """ImportError with the install line when peft (the ``lora`` extra) is missing."""
    if importlib.util.find_spec("peft") is None:
        raise ImportError("--lora-rank needs peft: install composer-replication[lora]")


def load_tokenizer(name: str, *, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer, padding on the left (generation), with a pad token: its EOS
    when it has none. The chat template stays as the repo ships it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def local_tokenizer(name: str, *, trust_remote_code: bool = False) -> Any | None:
    """``name``'s tokenizer as it loads on this machine alone (a folder, or the Hugging Face
    cache; nothing is downloaded), None when it does not. The launcher's checks read prompts
    and answers with it before any replica starts, so they never wait on the network, and a
    tokenizer they cannot build leaves the verdict to the replica that loads the model."""
    return load_local_tokenizer(name, trust_remote_code=trust_remote_code)[0]


def load_local_tokenizer(name: str, *, trust_remote_code: bool = False) -> tuple[Any, str]:
    """(``name``'s tokenizer or None, the first line of why it did not load, "" when it
    did): :func:`local_tokenizer` with the reason, for the launcher's check of a model
    folder, whose tokenizer every replica would fail to load the same way."""
    try:
        from transformers import AutoTokenizer

        with quiet_transformers():
            return AutoTokenizer.from_pretrained(
                name, local_files_only=True, trust_remote_code=trust_remote_code
            ), ""
    except Exception as e:  # noqa: BLE001 - not here, or of a kind this machine cannot build
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return None, f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings off while the launcher reads a model's files (crf says in
    one line what is wrong), and its verbosity as it was after: the SDK runs in the user's
    own process."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def kind_problem(config: Mapping[str, Any]) -> str | None:
    """Why the model ``config`` (config.json's fields) describes is no causal LM, as the
    rest of "--model X ..." (None: it is one, or it brings its own code). An encoder-decoder
    (T5) has no causal-LM class; a BERT-family encoder has one that trains bidirectionally
    unless ``is_decoder``, silently wrong; a type without a causal-LM class fails to load."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED,
    )

    kind = config.get("model_type")
    if config.get("auto_map") or not isinstance(kind, str):
        return None
    why = "crf trains causal (decoder-only) LMs"
    if config.get("is_encoder_decoder"):
        return f"is a {kind} (an encoder-decoder model): {why}"
    if kind in MASKED and not config.get("is_decoder") and not config.get("causal"):
        return f"is a {kind} (an encoder model, is_decoder false): {why}"
    if kind not in CAUSAL:
        return f"is a {kind}, which has no causal-LM class in transformers: {why}"
    return None


def missing_message(model: str, missing: list[str]) -> str:
    """One line for a checkpoint that lacks tensors the model needs (transformers would
    initialise them at random, differently on each replica)."""
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    head = f"--model {model}: its weights lack {missing[0]}{more}: "
    if any(n.split(".")[0] in ("lm_head", "cls", "embed_out", "output") for n in missing):
        return head + (
            "it was saved without its LM head (AutoModel?) — save it with AutoModelForCausalLM"
        )
    return head + "the checkpoint is incomplete; save or download the model again"


def check_finite(model: Any, name: str) -> None:
    """DataError naming the first parameter or buffer holding NaN or inf: sampling from it
    fails ("probability tensor contains either inf, nan") on every attempt. One pass, on
    the tensors' own device."""
    import torch

    from crf.replica.data_files import DataError

    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise DataError(f"--model {name}: weight {key} holds NaN or inf values")


def check_kind(name: str, *, trust_remote_code: bool) -> None:
    """DataError at a replica's setup for a model that is no causal LM (:func:`kind_problem`)
    (a Hub model the launcher could not read)."""
    from transformers import AutoConfig

    from crf.replica.data_files import DataError

    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    why = kind_problem(config.to_dict() | {"auto_map": getattr(config, "auto_map", None)})
    if why:
        raise DataError(f"--model {name} {why}")


def load_pretrained(spec: Any, placement: Placement, *, seed: int) -> tuple[Any, Any]:
    """(model, tokenizer) for ``spec.model``: from_pretrained on ``placement.device``, with
    gradient checkpointing and LoRA as the spec asks (see module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from crf.composer.generation import one_input_grads_hook

    remote = bool(getattr(spec, "trust_remote_code", False))
    lora_rank = int(getattr(spec, "lora_rank", 0) or 0)
    local = str(spec.model).startswith(("/", ".", "~"))
    if local and not os.path.isdir(os.path.expanduser(spec.model)):
        # a path, not a Hub id: transformers' OSError would read as a failing machine and be
        # restarted; the same path is missing on every attempt
        raise FileNotFoundError(f"--model {spec.model}: no such folder on this replica")
    check_kind(spec.model, trust_remote_code=remote)
    tokenizer = load_tokenizer(spec.model, trust_remote_code=remote)
    # full fine-tuning: fp32 master weights; LoRA: the frozen base in the compute dtype
    dtype = placement.torch_dtype if lora_rank else torch.float32
    model, info = AutoModelForCausalLM.from_pretrained(
        spec.model, dtype=dtype, trust_remote_code=remote, output_loading_info=True
    )
    if info.get("missing_keys"):
        from crf.replica.data_files import DataError

        raise DataError(missing_message(spec.model, sorted(info["missing_keys"])))
    model.to(placement.device)
    check_finite(model, spec.model)
    # one input-embeddings hook however often gradient checkpointing is turned on (below,
    # by PEFT, by TRL around each generation): crf/composer/generation.py
    one_input_grads_hook(model)
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = tokenizer.pad_token_id
    if getattr(spec, "gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if lora_rank:
            model.enable_input_require_grads()  # checkpointed blocks need a grad path in
    if lora_rank:
        from crf.replica.lora import add_lora

        require_peft()
        alpha, targets = int(getattr(spec, "lora_alpha", 16)), spec_targets(spec)
        model = add_lora(model, lora_rank, alpha, seed=seed, targets=targets, name=spec.model)
    model.train()
    return model, tokenizer


def spec_targets(spec: Any) -> str | None:
    """The run's ``--lora-target-modules`` (None: peft's all-linear)."""
    value = getattr(spec, "lora_target_modules", None)
    return value if isinstance(value, str) else None


def trainable_count(model: Any) -> int:
    """Elements of the parameters that train (and are exchanged): the adapters with LoRA."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
