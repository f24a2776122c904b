"""How the composer trainer generates without touching its master weights.

TRL's GRPOTrainer has three generation paths: ``model.generate`` (the default), vLLM
(``use_vllm``) and transformers' continuous batching (``use_transformers_continuous_batching``,
``model.generate_batch`` over a paged KV cache). In TRL 1.16 the continuous-batching path
casts the model it generates with to the training precision in place
(``unwrapped_model.to(torch.bfloat16)`` when ``bf16=True``, ``torch.float16`` when ``fp16``)
and never casts it back. crf trains full models with fp32 master weights under autocast, and
DiLoCo's pseudo-gradients are differences of those weights: after one such generation every
parameter would be bf16, the optimizer would step bf16 weights, and the exchange would average
rounded differences. With LoRA the fp32 adapters would be cast the same way.

:func:`master_weights_kept` is the guard: for the duration of one generation it turns the
trainer's ``bf16``/``fp16`` flags off, so TRL skips its cast and the model generates with the
weights it trains; it then checks that no parameter changed dtype, and raises if one did (a
TRL version that casts some other way). Transformers' paged cache takes the model's dtype for
the keys and values too, so under the trainer's bf16/fp16 autocast (which makes bf16 keys from
fp32 weights) that path cannot run at all: :class:`~crf.composer.ComposerConfig` refuses the
combination, and continuous batching runs with ``--precision fp32`` only.

:func:`generation_attention` picks the attention kernels of a generation on CUDA. PyTorch's
SDPA prefers cuDNN's attention on recent GPUs, and cuDNN builds an execution plan on the CPU
for every new sequence length: a decoding step has a new length at every token, so each layer
paid that build at every step (on one H100, 38-121 ms of CPU time in a profiled step of a
24-layer model, against 7-10 ms of GPU kernels; docs/performance.md, "GPU: one H100"). Without
it, SDPA takes FlashAttention or the memory-efficient kernel, which need no plan.

:func:`compile_decoding` and :func:`static_cache_kept` make ``generate`` decode with a static
KV cache whose decoding step transformers compiles (``torch.compile``, CUDA graphs: an
eager step is paced by the CPU's dispatch of about a thousand kernels; docs/performance.md,
"GPU: one H100", has both measured). Transformers compiles for a cache's shape, and sizes
the cache to each call's prompt plus new tokens: GRPO samples prompts of new lengths, and
every longer one would be a new compilation (tens of seconds each). So crf sizes the cache
in buckets of :data:`CACHE_BUCKET` tokens and keeps one cache for the calls it fits, reset
between them: the decoding step keeps its shape and its cache's addresses, so one
compilation and one recording of CUDA graphs serve every step whose prompt and completion
fit the bucket. TRL turns compilation off in its generation config
(``disable_compile=True``); :func:`compile_decoding` turns it back on.

Compiling on CUDA needs a C compiler: Triton builds its kernel launcher with ``gcc`` or
``clang`` (or ``CC``) at its first kernel, and an image built without build tools has none
(as the older ``-runtime`` tags of ``pytorch/pytorch`` had none). Unset,
``generation_compile`` is off where :func:`c_compiler` finds none, and a compilation that
fails all the same (:func:`compile_failed`) turns it off for the rest of the run, the
generation redone with plain ``generate`` (:func:`plain_decoding`): the default must never be
what stops a run. Set to True, the error is raised.

:func:`one_input_grads_hook` stops a leak those generations cause. TRL turns gradient
checkpointing off for every generation and back on after it, and transformers'
``gradient_checkpointing_enable`` registers a new forward hook on the input embeddings
(``enable_input_require_grads``) each time, while ``gradient_checkpointing_disable`` removes
them only for PEFT models. Each optimizer step added two hooks, every forward called them
all (a run of thousands of steps pays thousands of Python calls per forward), and a
compiled decoding step, whose guards check the number of hooks, recompiled at every step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import types
from collections.abc import Iterator
from typing import Any

__all__ = [
    "CACHE_BUCKET",
    "CompileFailed",
    "MasterWeightsCast",
    "c_compiler",
    "compile_decoding",
    "compile_failed",
    "decoding_compiled",
    "error_chain",
    "generation_attention",
    "master_weights_kept",
    "no_compiler_note",
    "no_input_grads_hook",
    "one_input_grads_hook",
    "plain_decoding",
    "root_error",
    "static_cache_kept",
    "static_cache_length",
]

#: the static KV cache's length is a multiple of this many tokens (prompt and completion)
CACHE_BUCKET = 256


class MasterWeightsCast(RuntimeError):
    """A generation path changed the dtype of parameters the trainer optimizes."""


@contextlib.contextmanager
def master_weights_kept(model: Any, args: Any) -> Iterator[None]:
    """Generate inside this block: ``args.bf16``/``args.fp16`` read False within it (TRL's
    continuous-batching path casts the model when they are True), and every parameter of
    ``model`` has the dtype it had before, or :class:`MasterWeightsCast` names the first."""
    before = {name: p.dtype for name, p in model.named_parameters()}
    flags = (args.bf16, args.fp16)
    args.bf16 = args.fp16 = False
    try:
        yield
    finally:
        args.bf16, args.fp16 = flags
    for name, p in model.named_parameters():
        if before.get(name, p.dtype) != p.dtype:
            raise MasterWeightsCast(
                f"generation cast parameter {name} from {before[name]} to {p.dtype}: the "
                "trainer's master weights must keep their dtype (crf exchanges differences "
                "of them)"
            )


@contextlib.contextmanager
def generation_attention(model: Any, cudnn: bool = False) -> Iterator[None]:
    """Generate inside this block: on CUDA, SDPA without cuDNN's attention (its per-length
    plan building costs more CPU time per decoding step than the step's GPU work) unless
    ``cudnn``; elsewhere, or with ``cudnn``, nothing changes."""
    device = getattr(model, "device", None)
    if cudnn or getattr(device, "type", None) != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(kernels):
        yield


def compile_decoding(generation_config: Any) -> tuple[Any, Any]:
    """Make ``generation_config`` (TRL's, which it passes to every ``generate``) decode with
    a static KV cache and let transformers compile the decoding step: on CUDA (transformers
    compiles on a GPU only; elsewhere the static cache runs eagerly), with its default
    ``CompileConfig`` (CUDA graphs) unless one is set. Returns what :func:`plain_decoding`
    restores: the cache implementation and compile switch it had."""
    from transformers import CompileConfig

    before = (generation_config.cache_implementation, generation_config.disable_compile)
    generation_config.cache_implementation = "static"
    generation_config.disable_compile = False
    if getattr(generation_config, "compile_config", None) is None:
        generation_config.compile_config = CompileConfig()
    return before


def plain_decoding(generation_config: Any, before: tuple[Any, Any]) -> None:
    """Undo :func:`compile_decoding`: the cache implementation and compile switch the config
    had before it (TRL's: no static cache, compilation off)."""
    generation_config.cache_implementation, generation_config.disable_compile = before


def c_compiler() -> str | None:
    """The C compiler Triton would build its CUDA kernel launcher with, as Triton looks for
    it (``triton.runtime.build``): ``CC`` if set, else ``gcc`` or ``clang`` on the PATH; None
    where there is none, and a compiled decoding step would fail at its first generation
    ("Failed to find C compiler")."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


class CompileFailed(RuntimeError):
    """``generation_compile=true`` and the decoding step did not compile (raised from the
    compiler's error): the same image fails the same way on every attempt."""


def error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from, outermost first (a cycle ends it)."""
    out: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not e for e in out):
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def root_error(error: BaseException) -> str:
    """``Type: first line`` of the innermost error ``error`` was raised from: what failed
    inside the compiler (dynamo's wrapper says only which backend raised)."""
    root = error_chain(error)[-1]
    first = (str(root).strip().splitlines() or [""])[0][:300]
    return f"{type(root).__name__}: {first}" if first else type(root).__name__


def compile_failed(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is a failure to compile: dynamo's or
    inductor's own errors (a backend's error reaches ``generate`` wrapped in one), or
    Triton's missing C compiler."""
    return any(
        (type(e).__module__ or "").startswith(("torch._dynamo", "torch._inductor"))
        or "Failed to find C compiler" in str(e)
        for e in error_chain(error)
    )


def decoding_compiled(args: Any, model: Any) -> bool:
    """Whether the trainer generates with :func:`compile_decoding`: ``generation_compile``
    as set, and when unset (None) wherever it pays and can run: the trainer on CUDA (the
    only device transformers compiles on), TRL's ``generate`` path (no ``use_vllm``, no
    continuous batching, ``cache_implementation`` unset or static), a model transformers can
    compile whole (``_can_compile_fullgraph``), a transformers release that prepares
    static caches with ``_prepare_static_cache``, and a C compiler for Triton
    (:func:`c_compiler`). On one H200 it made a GRPO step of a 0.5B
    model 3.4x faster with the master weights kept fp32; its first generation compiles
    (about 30 s there), which a run of many steps repays (docs/performance.md)."""
    setting = getattr(args, "generation_compile", None)
    if setting is not None:
        return bool(setting)
    return _would_compile(args, model) and c_compiler() is not None


def no_compiler_note(args: Any, model: Any) -> str | None:
    """The line a replica logs when unset ``generation_compile`` is off for want of a C
    compiler alone (None otherwise): what to install to get it."""
    if getattr(args, "generation_compile", None) is not None or c_compiler() is not None:
        return None
    if not _would_compile(args, model):
        return None
    return (
        "generation_compile: off, since this machine has no C compiler for Triton (gcc, "
        "clang or CC): install gcc in the image (apt-get install gcc) to decode with a "
        "compiled static cache, several times faster on a GPU"
    )


def _would_compile(args: Any, model: Any) -> bool:
    """:func:`decoding_compiled`'s conditions for an unset setting, but the C compiler."""
    from transformers.generation import GenerationMixin

    device = getattr(getattr(args, "device", None), "type", None)
    return bool(
        device == "cuda"
        and not getattr(args, "use_vllm", False)
        and not getattr(args, "use_transformers_continuous_batching", False)
        and getattr(args, "cache_implementation", None) in (None, "static")
        and getattr(_generating_model(model), "_can_compile_fullgraph", False)
        and hasattr(GenerationMixin, "_prepare_static_cache")
    )


def static_cache_length(prompt_tokens: int, new_tokens: int, bucket: int = CACHE_BUCKET) -> int:
    """The static cache's length for a generation of ``new_tokens`` after prompts of up to
    ``prompt_tokens`` (padded): their sum, rounded up to a multiple of ``bucket``."""
    need = max(1, prompt_tokens + new_tokens)
    return -(-need // bucket) * bucket


def _generating_model(model: Any) -> Any:
    """The transformers model whose ``generate`` runs (a PEFT model's base model)."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def _stored_as(layer: Any, dtype: Any) -> None:
    """Make a static cache layer store the keys and values it is given in ``dtype``."""
    update = layer.update

    def update_in_dtype(key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        return update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

    layer.update = update_in_dtype


@contextlib.contextmanager
def static_cache_kept(
    model: Any, length: int, held: dict[int, Any], dtype: Any = None
) -> Iterator[None]:
    """Generate inside this block into a static cache of at least ``length`` tokens, kept in
    ``held`` per batch size (``{batch: (cache, length)}``) and reset for the next call it
    fits. Calls whose prompts differ in length then share one cache shape, so the compiled
    decoding step compiles once, and one cache, whose addresses CUDA graphs recorded:
    transformers 5.6 keeps one cache across calls itself, later releases (5.17) make a new
    one per call, and every new address makes CUDA graphs record again (after 128 such,
    torch stops using them for that step). Through transformers' ``_prepare_static_cache``,
    which both releases call with keywords.

    ``dtype``: the autocast dtype the model generates under, in which the cache then keeps
    keys and values. Transformers' static cache allocates the values in the keys' dtype,
    and under autocast with fp32 weights the two differ (the keys come out of the rotary
    embedding in fp32, the values out of a bf16 projection): the first generation would
    fail. Attention casts both to that dtype anyway, so storing them in it changes nothing
    it computes."""
    from transformers import StaticCache

    target = _generating_model(model)
    prepare = getattr(target, "_prepare_static_cache", None)
    if prepare is None:
        raise RuntimeError(
            "this transformers release prepares static caches without _prepare_static_cache: "
            "leave generation_compile off"
        )

    def kept(*args: Any, **kwargs: Any) -> Any:
        want = max(int(kwargs["max_cache_len"]), length)
        batch = int(kwargs["batch_size"])
        cache, has = held.get(batch, (None, 0))
        if cache is not None and has >= want:
            cache.reset()
            return cache
        kwargs["max_cache_len"] = want
        cache = prepare(*args, **kwargs)
        if isinstance(cache, StaticCache):
            if dtype is not None:
                for layer in cache.layers:
                    _stored_as(layer, dtype)
            held[batch] = (cache, want)
        return cache

    target._prepare_static_cache = kept
    try:
        yield
    finally:
        del target._prepare_static_cache


def _enable_input_require_grads_once(self: Any) -> None:
    self.disable_input_require_grads()  # the hooks of the previous call, if any
    type(self).enable_input_require_grads(self)


def one_input_grads_hook(model: Any) -> None:
    """Make ``enable_input_require_grads`` of every transformers model in ``model`` remove
    the hooks its previous call registered before it registers new ones, so turning gradient
    checkpointing off and on (TRL does, around every generation) keeps one hook, not one
    more per call. Bound to each model, so a copy of the model (``copy.deepcopy``) binds
    its own."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel) and hasattr(m, "disable_input_require_grads"):
            m.enable_input_require_grads = types.MethodType(_enable_input_require_grads_once, m)


@contextlib.contextmanager
def no_input_grads_hook(model: Any) -> Iterator[None]:
    """Generate inside this block without the input-embeddings hook that gradient
    checkpointing adds (``enable_input_require_grads``): a generation runs under
    ``no_grad``, where the hook does nothing, and inside a compiled decoding step its
    ``requires_grad_`` breaks the graph (torch 2.11). The hook is back after the block
    when it was there before it (TRL's own re-enabling of gradient checkpointing after the
    generation may already have put it back: :func:`one_input_grads_hook` keeps that to one)."""
    from transformers import PreTrainedModel

    had = [
        m for m in model.modules()
        if isinstance(m, PreTrainedModel) and getattr(m, "_require_grads_hooks", None)
    ]  # fmt: skip
    for m in had:
        m.disable_input_require_grads()
    try:
        yield
    finally:
        for m in had:
            if not getattr(m, "_require_grads_hooks", None):
                m.enable_input_require_grads()
