"""The composer job's trainer settings: which ``GRPOConfig`` the job builds, and the checks
on ``trl.<field>`` settings before launch.

Three layers, the later winning:

1. Defaults. Without ``--model`` the embedded toy's values (:data:`TOY`: a large learning
   rate, 4 short completions), tuned so the demo's reward rises in seconds. With ``--model``
   TRL's own ``GRPOConfig`` defaults (read from the class, never copied here), except the
   learning rate under LoRA: TRL's example scripts (``trl/scripts/sft.py``, ``dpo.py`` and
   ``distillation.py`` in TRL 1.16) train LoRA adapters at 10x the learning rate of full
   fine-tuning (SFT 2e-5 -> 2e-4, DPO 5e-7 -> 5e-6), so crf applies that factor
   (:data:`LORA_LR_FACTOR`) to GRPOConfig's default.
2. The job's trainer knobs (``--set learning_rate=...``: :data:`KNOBS`), short names for the
   GRPOConfig fields every run tunes.
3. ``trl.<field>`` (``--set trl.top_p=0.9``, ``[job.trl]``, ``job_config={"trl": {...}}``):
   any other GRPOConfig field, checked against the class (name, type, GRPOConfig's own
   validation) before launch. Fields crf sets itself (:data:`OWNED`) are refused with the
   crf option that sets them, and fields a knob sets with the knob.

The learning-rate schedule stays ``constant`` with ``--model`` too (``trl.lr_scheduler_type``
changes it): a restarted replica trains only its remaining steps, so a decaying schedule
would start again from its peak at every resume.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
from collections.abc import Mapping
from typing import Any

#: the job's trainer knobs -> the GRPOConfig field each one sets
KNOBS: dict[str, str] = {
    "learning_rate": "learning_rate",
    "num_generations": "num_generations",
    "max_completion_length": "max_completion_length",
    "temperature": "temperature",
    "grpo_beta": "beta",
}
#: the embedded toy's trainer values (no --model); max_completion_length: the task's max_len + 2
TOY: dict[str, Any] = {
    "learning_rate": 5e-3,
    "num_generations": 4,
    "temperature": 1.0,
    "beta": 0.0,
}
#: LoRA learning rate = GRPOConfig's default x this (TRL's scripts: LoRA at 10x full FT)
LORA_LR_FACTOR = 10.0
#: what crf sets on every run whatever the model (overridable with trl.<field>)
CRF_DEFAULTS: dict[str, Any] = {"lr_scheduler_type": "constant"}
#: TrainingArguments fields crf sets itself in every job's trainer -> what to do instead
#: (the end of the one-line refusal); each job adds its own (:data:`OWNED`, the sft job's)
TRAINER_OWNED: dict[str, str] = {
    "output_dir": "crf chooses it; the trained model is the run's model/ (crf export)",
    "max_steps": "use -H/--sync-every x --rounds",
    "num_train_epochs": "use -H/--sync-every x --rounds",
    "seed": "use --seed",
    "data_seed": "use --seed",
    "save_strategy": "use --checkpoint-every (crf checkpoints the global model)",
    "save_steps": "use --checkpoint-every (crf checkpoints the global model)",
    "save_total_limit": "use --checkpoint-every (crf checkpoints the global model)",
    "resume_from_checkpoint": "use crf launch --resume",
    "report_to": "use --report-to",
    "run_name": "crf names each replica's run (--report-to)",
    "logging_steps": "crf logs every optimizer step",
    "logging_strategy": "crf logs every optimizer step",
    "disable_tqdm": "replicas write logs, not progress bars",
    "use_cpu": "use --device",
    "bf16": "use --precision",
    "fp16": "use --precision",
    "gradient_checkpointing": "use --gradient-checkpointing",
    "activation_checkpointing": "use --gradient-checkpointing",
    "ddp_broadcast_buffers": "crf sets it for --procs-per-replica (local rank 0's buffers)",
    "ddp_find_unused_parameters": "crf sets it for --procs-per-replica (no extra collective)",
    "model_init_kwargs": (
        "crf loads the model (TRL ignores it for a loaded model): use --precision for its "
        "dtype, --trust-remote-code for the model's own code"
    ),
    "trust_remote_code": "use --trust-remote-code (crf loads the model and its tokenizer)",
    "push_to_hub": "use crf export",
    "hub_model_id": "use crf export",
}
#: GRPOConfig fields crf sets itself -> what to do instead
OWNED: dict[str, str] = TRAINER_OWNED | {
    "per_device_train_batch_size": "use --set prompts_per_step (x num_generations)",
    "reward_weights": "use --reward NAME=WEIGHT",
}
#: the documented way to install vLLM for crf
VLLM_EXTRA = "pip install 'composer-replication[vllm]'"
#: the transformers release TRL's continuous-batching generation needs (TRL 1.16's
#: GRPOTrainer refuses older ones in trl/trainer/grpo_trainer.py); crf accepts older
#: transformers (PRIME-RL pins 5.6.2), so that one setting is refused before launch there
CONTINUOUS_BATCHING_TRANSFORMERS = "5.8.0"


class SettingError(ValueError):
    """A trl.<field> setting cannot be used; the message is one line naming the fix."""


def checkpointing(config_cls: type, on: bool) -> dict[str, bool]:
    """Activation (gradient) checkpointing under the name ``config_cls`` takes: newer
    transformers call it ``activation_checkpointing`` (the old name warns there), releases
    before it only know ``gradient_checkpointing``."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    key = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else ("gradient_checkpointing")
    )
    return {key: on}


def grpo_defaults() -> dict[str, Any]:
    """Every GRPOConfig field with its default (None for those with a factory)."""
    from trl import GRPOConfig

    out: dict[str, Any] = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def check_names(trl: Mapping[str, Any], job_knobs: Mapping[str, Any]) -> None:
    """SettingError for a trl.<name> that is no GRPOConfig field (with the nearest one), a
    field crf sets itself, or a field one of the job's knobs sets (:data:`KNOBS`): the knob
    is checked (range, the toy's and LoRA's defaults) where ``trl.<field>`` would reach the
    replicas unchecked, as the sft job refuses its own knobs."""
    fields = grpo_defaults()
    by_field = {field: knob for knob, field in KNOBS.items()}
    for name in trl:
        if name in OWNED:
            raise SettingError(f"trl.{name} is set by crf: {OWNED[name]}")
        if name in by_field:
            knob = by_field[name]
            raise SettingError(
                f"trl.{name} is a knob of the composer job: set it as the job's own {knob} "
                f"(--set {knob}=..., or {knob} = ... in [job]), not in its trl table"
            )
        if name not in fields:
            if name in job_knobs:
                raise SettingError(
                    f"trl.{name} is no GRPOConfig field but a composer job option: set it "
                    f"as the job's own {name} (--set {name}=..., or {name} = ... in [job])"
                )
            near = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean trl.{near[0]}?" if near else ""
            raise SettingError(f"trl.{name} is no field of TRL's GRPOConfig{hint}")


def coerce(trl: Mapping[str, Any]) -> dict[str, Any]:
    """trl.<field> values given as text (``--set``) as the field's type (its annotation or
    default); SettingError naming the field for text that is not one."""
    from trl import GRPOConfig

    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    defaults = grpo_defaults()
    return {k: _coerce(k, v, str(fields[k].type), defaults.get(k)) for k, v in trl.items()}


def _coerce(name: str, value: Any, kind: str, default: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("none", "null") and ("None" in kind or default is None):
        return None
    tried: list[str] = []
    for word, parse in (("bool", _bool), ("int", int), ("float", float), ("dict", json.loads),
                        ("list", json.loads)):  # fmt: skip
        like = {"bool": bool, "int": int, "float": float, "dict": dict, "list": list}[word]
        if word in kind or (type(default) is like and default is not None):
            tried.append(word)
            try:
                return parse(text)
            except ValueError:
                continue
    if tried and "str" not in kind:
        raise SettingError(f"trl.{name}={value!r} is not a valid {' or '.join(tried)}")
    return value


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def resolve(
    knobs: Mapping[str, Any],
    trl: Mapping[str, Any],
    *,
    model: bool,
    lora: bool,
    toy_completion: int,
) -> dict[str, Any]:
    """The GRPOConfig fields the job sets from its settings (see module docstring): the
    defaults for the toy or for ``--model``, then the job's knobs, then ``trl.<field>``.
    Fields left out take GRPOConfig's default."""
    out: dict[str, Any] = dict(CRF_DEFAULTS)
    if not model:
        out |= TOY | {"max_completion_length": toy_completion}
    elif lora:
        out["learning_rate"] = grpo_defaults()["learning_rate"] * LORA_LR_FACTOR
    for knob, field in KNOBS.items():
        if knobs.get(knob) is not None:
            out[field] = knobs[knob]
    return out | dict(trl)


def differs(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields whose value is not GRPOConfig's default, sorted by name."""
    defaults = grpo_defaults()
    return {k: fields[k] for k in sorted(fields) if k not in defaults or defaults[k] != fields[k]}


def check_values(fields: Mapping[str, Any], batch: int) -> None:
    """SettingError (one line) when GRPOConfig refuses ``fields`` (with crf's batch of
    ``batch`` completions per step); built on the CPU, nothing is loaded."""
    import tempfile
    import warnings

    from trl import GRPOConfig

    with tempfile.TemporaryDirectory(prefix="crf-trl-check-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            GRPOConfig(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no",
                       per_device_train_batch_size=batch, **fields)  # fmt: skip
        except (TypeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise SettingError(
                f"TRL's GRPOConfig refuses the job's trl settings: {first}"
            ) from None


def check_generation_kwargs(fields: Mapping[str, Any]) -> None:
    """SettingError before launch for ``generation_kwargs`` transformers' GenerationConfig
    refuses (a text where it takes a number, a value out of range), naming the key: TRL
    builds a GenerationConfig from them in every replica, which would fail at setup (or at
    its first rollout) and again after a restart."""
    import warnings

    kwargs = fields.get("generation_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise SettingError(
            f"trl.generation_kwargs must be a table of GenerationConfig fields such as "
            f'{{"top_k": 5}} (got {kwargs!r})'
        )
    from transformers import GenerationConfig

    for key, value in [*kwargs.items(), ("", None)]:
        one = {key: value} if key else kwargs  # each key alone, then all of them together
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                GenerationConfig(do_sample=True, **one).validate()
            except (TypeError, ValueError) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                said = f"{key}={value!r}" if key else f"{kwargs!r}"
                raise SettingError(
                    f"trl.generation_kwargs: transformers' GenerationConfig refuses {said}: {first}"
                ) from None


def check_vllm(fields: Mapping[str, Any], spec: Any, gpus: int | None, local: bool) -> None:
    """SettingError before launch for ``use_vllm`` where it cannot run: a mode other than
    colocate, a replica without CUDA (``--device cpu``, a local machine without a GPU, a
    backend whose hardware has none: ``gpus`` = 0), or (``local``: the replicas run in this
    Python) vLLM not installed. ``gpus`` None: the hardware is not known here."""
    if not fields.get("use_vllm"):
        return
    mode = fields.get("vllm_mode", "colocate")
    if mode != "colocate":
        raise SettingError(
            f"trl.vllm_mode={mode!r}: crf runs vLLM in colocate mode only (each replica "
            "generates on its own GPU); leave trl.vllm_mode unset"
        )
    if getattr(spec, "device", "auto") == "cpu":
        raise SettingError("trl.use_vllm needs a CUDA GPU, but --device is cpu")
    if local:
        import torch

        if not torch.cuda.is_available():
            raise SettingError(
                "trl.use_vllm needs a CUDA GPU, and this machine (where the local replicas "
                "run) has none (torch.cuda.is_available() is False)"
            )
        if importlib.util.find_spec("vllm") is None:
            raise SettingError(f"trl.use_vllm needs vLLM, which is not installed: {VLLM_EXTRA}")
    elif gpus == 0:
        raise SettingError(
            "trl.use_vllm needs a CUDA GPU, and the backend's hardware has none crf knows "
            "of: choose GPU hardware (--hardware)"
        )


#: trl.<field> settings that need a package TRL does not: field -> (import name, pip name)
NEEDS_PACKAGE: dict[str, tuple[str, str]] = {"use_liger_kernel": ("liger_kernel", "liger-kernel")}


def check_packages(fields: Mapping[str, Any], spec: Any, local: bool) -> None:
    """SettingError before launch for a setting of :data:`NEEDS_PACKAGE` whose package the
    replicas will not have: local replicas run in this Python, so it must import here; a
    cloud backend installs crf's extras and ``--pip``, so it must be in ``--pip``. Each
    replica's trainer would otherwise fail at setup with an ImportError (either job)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    for name, (module, package) in NEEDS_PACKAGE.items():
        if not fields.get(name):
            continue
        if local:
            if importlib.util.find_spec(module) is None:
                raise SettingError(
                    f"trl.{name} needs {package}, which is not installed in this Python (where "
                    f"the local replicas run): pip install {package}, or leave it off"
                )
            continue
        wanted = set()
        for entry in getattr(spec, "pip", None) or ():
            try:
                wanted.add(canonicalize_name(Requirement(entry).name))
            except InvalidRequirement:
                continue
        if canonicalize_name(package) not in wanted:
            raise SettingError(
                f"trl.{name} needs {package}, which the replicas install only when asked: "
                f"add --pip {package}, or leave it off"
            )


def check_continuous_batching(
    fields: Mapping[str, Any],
    version: str | None = None,
    *,
    spec: Any = None,
    gpus: int | None = None,
    local: bool = True,
    bf16: bool | None = None,
) -> None:
    """SettingError before launch for ``use_transformers_continuous_batching`` on a
    transformers older than :data:`CONTINUOUS_BATCHING_TRANSFORMERS` (``version``: this
    environment's; replicas install the driver's versions, so theirs is the same), and in a
    run that trains under bf16/fp16 autocast (``--precision`` bf16 or fp16, or auto on a GPU):
    transformers' paged cache keeps keys and values in the weights' dtype, fp32 here, and
    autocast makes them bf16. ``bf16`` False: the backend's GPU has no bfloat16 of its own
    (a T4), so auto is fp32 there."""
    if not fields.get("use_transformers_continuous_batching"):
        return
    from packaging.version import Version

    from crf.versions import distribution_version

    have = version or distribution_version("transformers") or "0"
    need = CONTINUOUS_BATCHING_TRANSFORMERS
    if Version(have) < Version(need):
        raise SettingError(
            f"trl.use_transformers_continuous_batching needs transformers>={need}, and this "
            f"environment has {have}: pip install 'transformers>={need},<6', or leave the "
            "setting off"
        )
    precision = getattr(spec, "precision", None) or "auto"
    if spec is not None and (
        precision in ("bf16", "fp16") or (precision == "auto" and _on_gpu(spec, gpus, local, bf16))
    ):
        said = "auto (bf16 on a GPU)" if precision == "auto" else precision
        raise SettingError(
            f"trl.use_transformers_continuous_batching needs --precision fp32, and this run's "
            f"is {said}: transformers' paged cache keeps keys and values in the weights' "
            "dtype (crf's fp32 master weights) and bf16 autocast makes them bf16; or leave the "
            "setting off (TRL's generate is the faster path on a GPU: docs/performance.md)"
        )


def check_generation_compile(compile_decoding: bool, fields: Mapping[str, Any]) -> None:
    """SettingError before launch for ``generation_compile`` beside a setting that replaces
    TRL's ``generate`` (vLLM, continuous batching) or its cache (``cache_implementation``
    other than static): the trainer would refuse it at start, in every replica."""
    if not compile_decoding:
        return
    for other in ("use_vllm", "use_transformers_continuous_batching"):
        if fields.get(other):
            raise SettingError(
                f"generation_compile compiles TRL's generate path, and trl.{other} replaces "
                "it: leave one of them off"
            )
    from transformers.generation import GenerationMixin

    if not hasattr(GenerationMixin, "_prepare_static_cache"):
        raise SettingError(
            "generation_compile needs a transformers release that prepares static caches "
            "with _prepare_static_cache (5.6 to 5.x); this one does not: leave it off"
        )
    cache = fields.get("cache_implementation")
    if cache not in (None, "static"):
        raise SettingError(
            f"generation_compile decodes with a static cache, and trl.cache_implementation "
            f"is {cache!r}: leave trl.cache_implementation unset"
        )


def check_run(cfg: Any, spec: Any, gpus: int | None, local: bool, bf16: bool | None = None) -> None:
    """The composer job's checks that need the run options: its ``trl`` settings as TRL's
    GRPOConfig takes them (for this model, LoRA and batch), ``use_vllm`` where it can
    run (:func:`check_vllm`), continuous batching where transformers serves it and the
    precision is fp32 (:func:`check_continuous_batching`; ``bf16``: whether the backend's
    GPU has bfloat16 of its own, None unknown), compiled decoding on TRL's generate path
    (:func:`check_generation_compile`). Without ``trl`` settings, only the last (TRL is not
    imported)."""
    compiled = bool(getattr(cfg, "generation_compile", False))
    if not cfg.trl:
        check_generation_compile(compiled, {})
        return
    fields = cfg.trainer_fields(spec)
    generations = fields.get("num_generations") or grpo_defaults()["num_generations"]
    check_values(fields, cfg.prompts_per_step * generations)
    check_generation_compile(compiled, fields)
    check_generation_kwargs(fields)
    check_vllm(fields, spec, gpus, local)
    check_continuous_batching(fields, spec=spec, gpus=gpus, local=local, bf16=bf16)
    check_rollout_loss(fields, spec)
    check_packages(fields, spec, local)


def check_rollout_loss(fields: Mapping[str, Any], spec: Any) -> None:
    """SettingError before launch for a ``loss_type`` the rollout workers' off-policy
    correction cannot weigh (crf.rollouts.config.UNCORRECTABLE_LOSSES); every replica's
    trainer would refuse it at setup."""
    from crf.rollouts.config import UNCORRECTABLE_LOSSES, uncorrectable_loss

    if not getattr(spec, "rollout_workers", 0):
        return
    if getattr(spec, "rollout_correction", "token_truncate") == "off":
        return
    loss = fields.get("loss_type")
    if loss in UNCORRECTABLE_LOSSES:
        raise SettingError(f"trl.{uncorrectable_loss(str(loss))}")


def _on_gpu(spec: Any, gpus: int | None, local: bool, bf16: bool | None = None) -> bool:
    """Whether the replicas train on a CUDA GPU that has bf16 of its own (``--precision
    auto`` is bf16 there, fp32 on an older GPU): this machine's for local replicas, else the
    backend's hardware (``gpus``; ``bf16`` False for a GPU older than Ampere), which
    ``--device cuda`` says has a GPU where the hardware is not known."""
    device = getattr(spec, "device", "auto")
    if device == "cpu":
        return False
    if local:
        from crf.replica.model import native_bf16

        return native_bf16()
    return (device == "cuda" or bool(gpus)) and bf16 is not False


def completion_notes(
    limit: int, rows: list[dict[str, Any]], model: str | None, trust_remote_code: bool = False
) -> list[str]:
    """One line per dataset field (answer, trace) whose longest text in ``rows`` needs more
    than ``limit`` completion tokens: counted with the model's tokenizer when it loads from
    this machine (a folder, or the Hugging Face cache; nothing is downloaded), else
    estimated from its characters (see :func:`token_counter`)."""
    fields = [f for f in ("answer", "trace") if any(r.get(f) for r in rows)]
    if not fields:
        return []
    count, how = token_counter(model, trust_remote_code)
    out = []
    for name in fields:
        longest = max(count(str(r[name])) for r in rows if r.get(name))
        if longest > limit:
            out.append(
                f"max_completion_length {limit} is shorter than the longest {name} in the "
                f"{len(rows)} sampled row(s): {longest} tokens ({how}); completions will be "
                "cut: raise it with --set max_completion_length=N"
            )
    return out


#: characters per token of an English BPE tokenizer, for an estimate without one
CHARS_PER_TOKEN = 4


def token_counter(model: str | None, trust_remote_code: bool) -> tuple[Any, str]:
    """(tokens of a text, how they were counted) for ``model`` (None: the embedded model's
    character tokenizer, one token per character)."""
    if not model:
        return len, "characters: the embedded model reads one character per token"
    from crf.replica.model import local_tokenizer

    tok = local_tokenizer(model, trust_remote_code=trust_remote_code)
    if tok is None:  # not in a folder nor in the cache: no download before launch
        return (
            lambda text: math.ceil(len(text) / CHARS_PER_TOKEN),
            f"estimated as characters / {CHARS_PER_TOKEN}: {model}'s tokenizer is not on "
            "this machine",
        )
    return (
        lambda text: len(tok(text, add_special_tokens=False)["input_ids"]),
        f"counted with {model}'s tokenizer",
    )
