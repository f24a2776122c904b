"""ComposerConfig: plain fields, no name clashes with TRL, invalid combinations fail early."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("trl")

from trl import GRPOConfig  # noqa: E402

from crf.composer import ComposerConfig  # noqa: E402

BASE = dict(output_dir="/tmp/crf-composer-config-test", use_cpu=True, bf16=False, report_to=[])


def make(**kw) -> ComposerConfig:
    return ComposerConfig(**BASE, **kw)


def test_defaults_are_stock_grpo_and_channels_off() -> None:
    cfg = make()
    assert cfg.distill_alpha == 0.0 and cfg.replay_beta == 0.0
    assert cfg.beta == GRPOConfig(**BASE).beta  # TRL's KL weight keeps its meaning
    assert cfg.distill_wrapper == "none" and cfg.replay_loss == "dpo"


def test_composer_fields_do_not_collide_with_trl() -> None:
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    ours = {f.name for f in dataclasses.fields(ComposerConfig)} - grpo
    expected = {
        "distill_alpha",
        "replay_beta",
        "distill_jsd_beta",
        "distill_temperature",
        "distill_clip",
        "distill_wrapper",
        "taid_t",
        "taid_schedule",
        "replay_loss",
        "simpo_gamma",
        "simpo_beta",
        "dpo_beta",
    }
    assert expected <= ours
    assert not (ours & grpo)


def test_all_knobs_round_trip_through_to_dict() -> None:
    cfg = make(distill_alpha=0.3, distill_wrapper="taid", taid_schedule="adaptive", replay_beta=1)
    d = cfg.to_dict()
    assert d["distill_alpha"] == 0.3 and d["taid_schedule"] == "adaptive"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(distill_alpha=-0.1), "distill_alpha must be a number >= 0"),
        (dict(replay_beta=-1.0), "replay_beta must be a number >= 0"),
        (dict(distill_wrapper="kd"), "unknown distill_wrapper 'kd'"),
        (dict(distill_wrapper="taid+entropy_opd"), "TAID and entropy-aware OPD are alternatives"),
        (
            dict(distill_wrapper="taid", taid_t=0.5, opd_entropy_threshold=1.0),
            "TAID and entropy-aware OPD cannot be combined",
        ),
        (
            dict(distill_wrapper="entropy_opd", taid_schedule="linear"),
            "TAID and entropy-aware OPD cannot be combined",
        ),
        (dict(taid_t=0.5), "set distill_wrapper='taid' to use TAID"),
        (dict(opd_entropy_threshold=0.5), "set distill_wrapper='entropy_opd'"),
        (dict(distill_wrapper="taid", taid_t=0.5, taid_schedule="linear"), "not both"),
        (dict(distill_wrapper="taid", taid_t=1.5), r"taid_t must be in \[0, 1\]"),
        (dict(distill_wrapper="taid", taid_schedule="cosine"), "unknown taid_schedule"),
        (dict(replay_loss="ipo"), "unknown replay_loss 'ipo'"),
        (dict(distill_jsd_beta=1.5), "distill_jsd_beta must be in"),
        (dict(distill_temperature=0.0), "distill_temperature must be > 0"),
        (dict(distill_clip=0.0), "distill_clip must be None or > 0"),
        (dict(dpo_beta=0.0), "dpo_beta must be > 0"),
        (dict(simpo_beta=-1.0), "simpo_beta must be > 0"),
        (dict(distill_hint_template="no placeholder"), "must contain '{hint}'"),
        (dict(distill_hint_template="{hint} {answer}"), "may only use the fields"),
    ],
)
def test_invalid_values_fail_at_construction(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_valid_wrapper_combinations() -> None:
    make(distill_alpha=1.0, distill_wrapper="taid", taid_t=0.0)
    make(distill_alpha=1.0, distill_wrapper="taid", taid_schedule="adaptive")
    # TAID with neither t nor schedule is allowed here: the trainer raises at the first step
    make(distill_alpha=1.0, distill_wrapper="taid")
    cfg = make(distill_alpha=1.0, distill_wrapper="entropy_opd")
    assert cfg.resolved_opd_entropy_threshold == 1.0 and cfg.resolved_opd_forward_weight == 1.0
    make(replay_beta=0.5, replay_loss="simpo", simpo_gamma=0.0)
