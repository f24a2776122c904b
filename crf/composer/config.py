"""``ComposerConfig``: TRL's ``GRPOConfig`` plus the composer's channel knobs.

Every knob is a plain dataclass field. Names never reuse TRL's: ``GRPOConfig.beta`` stays the
KL-to-reference weight of the GRPO term; the composer's weights are ``distill_alpha`` and
``replay_beta``. Invalid values and combinations fail at construction with a message that
names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from crf.composer.names import DISTILL_WRAPPERS, REPLAY_LOSSES, TAID_SCHEDULES

_OPD_DEFAULT_THRESHOLD = 1.0
_OPD_DEFAULT_FORWARD_WEIGHT = 1.0


@dataclass
class ComposerConfig(GRPOConfig):
    r"""Configuration of ``ComposerReplicationTrainer``.

    ``loss = grpo + distill_alpha · distill + replay_beta · replay`` (see docs/composer.md).

    Channel 2 — distillation from the policy conditioned on a hint:
        distill_alpha: weight of the channel (0 disables it; it is then skipped entirely).
        distill_jsd_beta: GKD's β of the generalized JSD: 0 = forward KL(teacher‖student),
            1 = reverse KL(student‖teacher), in between the β-skewed JSD.
        distill_temperature: logits are divided by it before the divergence.
        distill_clip: optional per-token cap on the divergence (value ``min(x, clip)``, the
            gradient above the cap is scaled by ``clip / x``).
        distill_wrapper: ``"none"``, ``"taid"`` or ``"entropy_opd"``.
        distill_hint_column: dataset column holding the hint (str; None/"" = no hint).
        distill_teacher_prompt_column: dataset column holding the teacher's full prompt; when
            present and non-empty it is used instead of ``hint`` + template.
        distill_hint_template: how the teacher prompt is built from a hint, with ``{hint}``
            and ``{prompt}``; for conversational prompts it is applied to the last message.
        taid_t: constant TAID interpolation t in [0, 1].
        taid_schedule: ``"linear"`` or ``"adaptive"`` (the paper's); exclusive with taid_t.
            With neither, call ``trainer.set_taid_t(t)`` yourself; training without any t
            raises ``ValueError`` at the first step.
        taid_t_start, taid_t_end, taid_momentum, taid_step_size: schedule parameters (paper
            defaults 0.4, 1.0, 0.99, 5e-4).
        opd_entropy_threshold: teacher entropy (nats) from which entropy-aware OPD adds the
            forward KL term (default 1.0).
        opd_forward_weight: weight of that forward KL term (default 1.0).

    Channel 3 — replay of correct teacher traces against the policy's own rollouts:
        replay_beta: weight of the channel (0 disables it).
        replay_loss: ``"dpo"`` (frozen reference = the initial policy) or ``"simpo"``.
        replay_trace_column: dataset column holding the correct trace (the completion text).
        replay_reward_threshold: rollouts whose total reward is >= this are not used as
            "rejected" (they are already correct). None = every rollout.
        dpo_beta: DPO's β.
        simpo_beta, simpo_gamma: SimPO's β and target margin γ.

    Generation:
        generation_cudnn_attention: let PyTorch's SDPA use cuDNN's attention while generating
            on CUDA (off by default: cuDNN builds a plan on the CPU for each new sequence
            length, which is every decoding step; crf/composer/generation.py).
        generation_compile: decode with a static KV cache whose decoding step transformers
            compiles (torch.compile, CUDA graphs) on CUDA, the cache sized in buckets of 256
            tokens so that the steps reuse one compilation (crf/composer/generation.py). The
            first generation compiles (tens of seconds for a 0.5B model). Only with TRL's
            ``generate`` path: not with ``use_vllm`` or continuous batching, and
            ``cache_implementation`` unset or ``"static"``. None (the default): on where
            it can run, on CUDA for a model transformers compiles whole, with a C compiler
            for Triton (``decoding_compiled``), and off for the rest of the run if compiling
            fails there; True or False: as set.
        ``use_transformers_continuous_batching`` needs ``bf16=False`` and ``fp16=False``:
            transformers' paged cache holds keys and values in the weights' dtype, and
            autocast makes them bf16/fp16 from fp32 master weights.
    """

    distill_alpha: float = field(default=0.0, metadata={"help": "weight of channel 2"})
    distill_jsd_beta: float = field(default=0.5, metadata={"help": "GKD generalized-JSD beta"})
    distill_temperature: float = field(default=1.0, metadata={"help": "distillation temperature"})
    distill_clip: float | None = field(default=None, metadata={"help": "per-token cap"})
    distill_wrapper: str = field(default="none", metadata={"help": "none | taid | entropy_opd"})
    distill_hint_column: str = field(default="hint", metadata={"help": "hint column"})
    distill_teacher_prompt_column: str = field(
        default="teacher_prompt", metadata={"help": "full teacher prompt column"}
    )
    distill_hint_template: str = field(
        default="{hint}\n{prompt}", metadata={"help": "teacher prompt from {hint} and {prompt}"}
    )
    taid_t: float | None = field(default=None, metadata={"help": "constant TAID t"})
    taid_schedule: str | None = field(default=None, metadata={"help": "linear | adaptive"})
    taid_t_start: float = field(default=0.4, metadata={"help": "TAID schedule start"})
    taid_t_end: float = field(default=1.0, metadata={"help": "TAID schedule end"})
    taid_momentum: float = field(default=0.99, metadata={"help": "TAID adaptive momentum"})
    taid_step_size: float = field(default=5e-4, metadata={"help": "TAID adaptive step size"})
    opd_entropy_threshold: float | None = field(
        default=None, metadata={"help": "entropy-aware OPD threshold (nats), default 1.0"}
    )
    opd_forward_weight: float | None = field(
        default=None, metadata={"help": "entropy-aware OPD forward-KL weight, default 1.0"}
    )
    replay_beta: float = field(default=0.0, metadata={"help": "weight of channel 3"})
    replay_loss: str = field(default="dpo", metadata={"help": "dpo | simpo"})
    replay_trace_column: str = field(default="trace", metadata={"help": "trace column"})
    replay_reward_threshold: float | None = field(
        default=None, metadata={"help": "skip rollouts with reward >= this as rejected"}
    )
    dpo_beta: float = field(default=0.1, metadata={"help": "DPO beta"})
    simpo_beta: float = field(default=2.0, metadata={"help": "SimPO beta"})
    simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO gamma (target margin)"})
    generation_cudnn_attention: bool = field(
        default=False,
        metadata={"help": "let SDPA use cuDNN's attention while generating on CUDA (off: its "
                  "per-length plan costs more CPU time per decoding step than the step's "
                  "GPU work)"},
    )  # fmt: skip

    generation_compile: bool | None = field(
        default=None,
        metadata={"help": "decode with a static KV cache whose decoding step transformers "
                  "compiles on CUDA (the cache in buckets of 256 tokens: one compilation for "
                  "the run's steps); TRL's generate path only. Unset: on where it can run "
                  "(CUDA, TRL's generate path, a model transformers compiles whole, a C "
                  "compiler for Triton), and off for the run if compiling fails"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate_composer()

    # ------------------------------------------------------------------ validation
    @property
    def resolved_opd_entropy_threshold(self) -> float:
        v = self.opd_entropy_threshold
        return _OPD_DEFAULT_THRESHOLD if v is None else float(v)

    @property
    def resolved_opd_forward_weight(self) -> float:
        v = self.opd_forward_weight
        return _OPD_DEFAULT_FORWARD_WEIGHT if v is None else float(v)

    def validate_composer(self) -> None:
        """Raise ``ValueError`` naming the field for any invalid value or combination (checked
        in this order: which loss, its weights and knobs, the hint template, then the distill
        wrapper's own knobs)."""
        self._validate_choices()
        self._validate_loss_knobs()
        self._validate_hint_template()
        self._validate_wrapper_knobs()
        self._validate_taid()
        self._validate_opd()
        self._validate_generation()

    def _validate_generation(self) -> None:
        """Continuous batching only without autocast (its paged cache takes the weights'
        dtype for keys and values; autocast makes them bf16/fp16 from fp32 weights); a
        compiled static-cache decoding only on TRL's ``generate`` path."""
        _need(
            not (self.use_transformers_continuous_batching and (self.bf16 or self.fp16)),
            "use_transformers_continuous_batching needs fp32 training (bf16=False, "
            "fp16=False; in crf: --precision fp32): transformers' paged cache keeps keys and "
            "values in the weights' dtype, and bf16/fp16 autocast makes them from fp32 master "
            "weights in the other dtype",
        )
        if self.generation_compile:
            other = (
                "use_vllm" if self.use_vllm
                else "use_transformers_continuous_batching"
                if self.use_transformers_continuous_batching else None
            )  # fmt: skip
            _need(
                other is None,
                f"generation_compile applies to TRL's generate path, and {other} replaces it: "
                "leave one of them off",
            )
            _need(
                self.cache_implementation in (None, "static"),
                f"generation_compile decodes with a static cache, and cache_implementation is "
                f"{self.cache_implementation!r}: leave cache_implementation unset",
            )

    def _validate_choices(self) -> None:
        """The distill wrapper and the replay loss are among the known ones."""
        wrapper = self.distill_wrapper
        _need(isinstance(wrapper, str), f"distill_wrapper must be a string (got {wrapper!r})")
        low = wrapper.lower()
        _need(
            not ("taid" in low and ("opd" in low or "entropy" in low)),
            f"distill_wrapper={wrapper!r}: TAID and entropy-aware OPD are alternatives, "
            "not a stack; choose one of 'taid' or 'entropy_opd'",
        )
        _need(
            wrapper in DISTILL_WRAPPERS,
            f"unknown distill_wrapper {wrapper!r}; choose one of {', '.join(DISTILL_WRAPPERS)}",
        )
        _need(
            self.replay_loss in REPLAY_LOSSES,
            f"unknown replay_loss {self.replay_loss!r}; choose one of {', '.join(REPLAY_LOSSES)}",
        )

    def _validate_loss_knobs(self) -> None:
        """Loss weights, distillation and preference-loss knobs in their ranges."""
        for name in ("distill_alpha", "replay_beta"):
            v = getattr(self, name)
            _need(
                isinstance(v, int | float) and v >= 0 and v == v,
                f"{name} must be a number >= 0 (got {v!r}); it is a loss weight",
            )
        _need(
            0.0 <= self.distill_jsd_beta <= 1.0,
            f"distill_jsd_beta must be in [0, 1] (got {self.distill_jsd_beta})",
        )
        _need(
            self.distill_temperature > 0,
            f"distill_temperature must be > 0 (got {self.distill_temperature})",
        )
        _need(
            self.distill_clip is None or self.distill_clip > 0,
            f"distill_clip must be None or > 0 (got {self.distill_clip})",
        )
        _need(self.dpo_beta > 0, f"dpo_beta must be > 0 (got {self.dpo_beta})")
        _need(self.simpo_beta > 0, f"simpo_beta must be > 0 (got {self.simpo_beta})")
        _need(self.simpo_gamma >= 0, f"simpo_gamma must be >= 0 (got {self.simpo_gamma})")

    def _validate_hint_template(self) -> None:
        """The hint template has ``{hint}`` and no field but ``{hint}`` and ``{prompt}``."""
        _need(
            "{hint}" in self.distill_hint_template,
            f"distill_hint_template must contain '{{hint}}' (got {self.distill_hint_template!r})",
        )
        try:
            self.distill_hint_template.format(hint="", prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"ComposerConfig: distill_hint_template {self.distill_hint_template!r} may only "
                f"use the fields {{hint}} and {{prompt}} (write '{{{{' for a literal brace): {e!r}"
            ) from None

    def _validate_wrapper_knobs(self) -> None:
        """TAID knobs only with the TAID wrapper, OPD knobs only with entropy-aware OPD."""
        wrapper = self.distill_wrapper
        taid_knobs = self.taid_t is not None or self.taid_schedule is not None
        opd_knobs = self.opd_entropy_threshold is not None or self.opd_forward_weight is not None
        if wrapper == "taid":
            _need(
                not opd_knobs,
                "distill_wrapper='taid' but opd_entropy_threshold/opd_forward_weight are set: "
                "TAID and entropy-aware OPD cannot be combined",
            )
        elif wrapper == "entropy_opd":
            _need(
                not taid_knobs,
                "distill_wrapper='entropy_opd' but taid_t/taid_schedule are set: "
                "TAID and entropy-aware OPD cannot be combined",
            )
        else:
            _need(
                not taid_knobs,
                "taid_t/taid_schedule are set but distill_wrapper is 'none': "
                "set distill_wrapper='taid' to use TAID",
            )
            _need(
                not opd_knobs,
                "opd_entropy_threshold/opd_forward_weight are set but distill_wrapper is "
                "'none': set distill_wrapper='entropy_opd' to use them",
            )

    def _validate_taid(self) -> None:
        """TAID's interpolation: a constant t or a schedule, with its range and momentum."""
        _need(
            not (self.taid_t is not None and self.taid_schedule is not None),
            "set either taid_t (a constant t) or taid_schedule, not both",
        )
        _need(
            self.taid_t is None or 0.0 <= self.taid_t <= 1.0,
            f"taid_t must be in [0, 1] (got {self.taid_t})",
        )
        _need(
            self.taid_schedule is None or self.taid_schedule in TAID_SCHEDULES,
            f"unknown taid_schedule {self.taid_schedule!r}; choose one of "
            f"{', '.join(TAID_SCHEDULES)} (or leave it None and set taid_t)",
        )
        _need(
            0.0 <= self.taid_t_start <= self.taid_t_end <= 1.0,
            f"TAID needs 0 <= taid_t_start <= taid_t_end <= 1 (got {self.taid_t_start}, "
            f"{self.taid_t_end})",
        )
        _need(
            0.0 <= self.taid_momentum < 1.0,
            f"taid_momentum must be in [0, 1) (got {self.taid_momentum})",
        )
        _need(self.taid_step_size >= 0, f"taid_step_size must be >= 0 (got {self.taid_step_size})")

    def _validate_opd(self) -> None:
        """Entropy-aware OPD's threshold and forward weight are non-negative."""
        _need(
            self.opd_entropy_threshold is None or self.opd_entropy_threshold >= 0,
            f"opd_entropy_threshold must be >= 0 nats (got {self.opd_entropy_threshold})",
        )
        _need(
            self.opd_forward_weight is None or self.opd_forward_weight >= 0,
            f"opd_forward_weight must be >= 0 (got {self.opd_forward_weight})",
        )


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"ComposerConfig: {msg}")
