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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["MasterWeightsCast", "generation_attention", "master_weights_kept"]


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
