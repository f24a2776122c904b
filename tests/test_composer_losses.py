"""The composer's loss functions in isolation (torch only, fast)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from crf.composer.losses import (
    TAIDSchedule,
    compose_loss,
    distill_per_token,
    dpo_loss,
    entropy_opd,
    generalized_jsd,
    masked_row_mean,
    sequence_logps,
    simpo_loss,
    taid_interpolate,
    teacher_entropy,
)

B, T, V = 3, 5, 11


def _logits(seed: int, scale: float = 2.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g) * scale).to(dtype)


# --------------------------------------------------------------------------- generalized JSD
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_matches_trl_gkd(beta: float, temperature: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRLExperimentalWarning
        from trl.experimental.gkd import GKDTrainer

    s, t = _logits(0), _logits(1)
    ours = generalized_jsd(s, t, beta, temperature).sum()
    theirs = GKDTrainer.generalized_jsd_loss(
        s, t, beta=beta, temperature=temperature, reduction="sum"
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_generalized_jsd_endpoints_are_forward_and_reverse_kl() -> None:
    s, t = _logits(0), _logits(1)
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    fkl = (lt.exp() * (lt - ls)).sum(-1)
    rkl = (ls.exp() * (ls - lt)).sum(-1)
    torch.testing.assert_close(generalized_jsd(s, t, 0.0), fkl)
    torch.testing.assert_close(generalized_jsd(s, t, 1.0), rkl)
    assert torch.all(generalized_jsd(s, t, 0.5) >= 0)
    assert generalized_jsd(s, s, 0.5).abs().max() < 1e-6


# --------------------------------------------------------------------------- TAID
def test_taid_without_t_raises_value_error() -> None:
    with pytest.raises(ValueError, match="TAID needs an interpolation value t"):
        distill_per_token(_logits(0), _logits(1), wrapper="taid", taid_t=None)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        taid_interpolate(_logits(0), _logits(1), 1.5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_taid_at_t1_equals_plain_distill_loss(beta: float) -> None:
    s, t = _logits(0), _logits(1)
    s1 = s.clone().requires_grad_(True)
    s2 = s.clone().requires_grad_(True)
    kw = dict(jsd_beta=beta, temperature=0.8)
    plain = distill_per_token(s1, t, wrapper="none", **kw)
    taid = distill_per_token(s2, t, wrapper="taid", taid_t=1.0, **kw)
    assert torch.equal(plain, taid)
    plain.sum().backward()
    taid.sum().backward()
    assert torch.equal(s1.grad, s2.grad)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_taid_at_t0_ignores_the_teacher(beta: float) -> None:
    s = _logits(0)
    grads, values = [], []
    for teacher_seed in (1, 2):
        x = s.clone().requires_grad_(True)
        loss = distill_per_token(
            x, _logits(teacher_seed), wrapper="taid", taid_t=0.0, jsd_beta=beta
        )
        loss.sum().backward()
        values.append(loss.detach())
        grads.append(x.grad)
    assert torch.equal(values[0], values[1]) and torch.equal(grads[0], grads[1])
    # the target is the (detached) student itself: nothing to learn
    assert values[0].abs().max() < 1e-5 and grads[0].abs().max() < 1e-5


def test_taid_intermediate_t_moves_toward_the_teacher() -> None:
    s, t = _logits(0), _logits(1)
    losses = [
        distill_per_token(s, t, wrapper="taid", taid_t=x, jsd_beta=0.0).mean().item()
        for x in (0.0, 0.25, 0.5, 0.75, 1.0)
    ]
    assert losses == sorted(losses)  # farther target -> larger divergence


def test_taid_linear_schedule() -> None:
    sch = TAIDSchedule(mode="linear", t_start=0.2, t_end=1.0)
    assert sch.t == 0.2
    assert sch.step(1.0, 5, 10) == pytest.approx(0.6)
    assert sch.step(1.0, 10, 10) == pytest.approx(1.0)


def test_taid_adaptive_schedule_follows_the_paper() -> None:
    sch = TAIDSchedule(mode="adaptive", t_start=0.4, t_end=1.0, momentum=0.5, step_size=0.1)
    assert sch.step(2.0, 1, 100) == 0.4  # the first update only records the loss
    ts = [sch.step(loss, n, 100) for n, loss in enumerate([1.5, 1.0, 0.8, 0.8, 0.9], start=2)]
    assert all(b >= a for a, b in zip(ts, ts[1:], strict=False))  # monotone
    assert all(0.4 <= x <= 1.0 for x in ts)
    # falling loss -> positive momentum -> a step bigger than the linear floor
    assert ts[0] > 0.4 + 0.6 * 2 / 100
    # hand-computed second update: delta = (2.0-1.5)/2.0, m = 0.5*0 + 0.5*0.25
    m = 0.125
    expected = 0.4 + 0.1 * (1 / (1 + math.exp(-m))) * (1 - 0.4)
    assert ts[0] == pytest.approx(expected)
    with pytest.raises(ValueError):
        TAIDSchedule(mode="cosine")


# --------------------------------------------------------------------------- entropy-aware OPD
def test_entropy_opd_is_zero_when_student_equals_teacher() -> None:
    t = _logits(1, scale=0.3)  # flat: high entropy, so the forward-KL term is active too
    assert (teacher_entropy(t) >= 1.0).all()
    s = t.clone().requires_grad_(True)
    loss = distill_per_token(s, t, wrapper="entropy_opd", opd_entropy_threshold=1.0)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    assert s.grad.abs().max() < 1e-6


def test_entropy_opd_adds_forward_kl_only_on_high_entropy_tokens() -> None:
    s, t = _logits(0), _logits(1)
    h = teacher_entropy(t)
    thr = h.median().item()
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    rkl = (ls.exp() * (ls - lt)).sum(-1)
    fkl = (lt.exp() * (lt - ls)).sum(-1)
    got = entropy_opd(s, t, entropy_threshold=thr, forward_weight=0.5)
    want = rkl + 0.5 * (h >= thr).float() * fkl
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(entropy_opd(s, t, entropy_threshold=1e9), rkl)


# --------------------------------------------------------------------------- clip
def test_distill_clip_caps_value_but_keeps_gradient_direction() -> None:
    s = _logits(0).requires_grad_(True)
    t = _logits(1)
    raw = distill_per_token(s, t, jsd_beta=0.0)
    clip = raw.detach().median().item()
    clipped = distill_per_token(s, t, jsd_beta=0.0, clip=clip)
    torch.testing.assert_close(clipped, raw.clamp(max=clip))
    (g_raw,) = torch.autograd.grad(raw[0, 0], s, retain_graph=True)
    (g_clip,) = torch.autograd.grad(clipped[0, 0], s)
    if raw[0, 0] > clip:
        torch.testing.assert_close(g_clip, g_raw * clip / raw[0, 0].detach())
    else:
        torch.testing.assert_close(g_clip, g_raw)


# --------------------------------------------------------------------------- replay
def test_dpo_at_initialisation_equals_ln2() -> None:
    logits = _logits(0)
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(B, T)
    chosen = sequence_logps(logits, labels, mask)
    rejected = sequence_logps(_logits(5), labels, mask)
    loss = dpo_loss(chosen, rejected, chosen.clone(), rejected.clone(), beta=0.1)
    torch.testing.assert_close(loss, torch.full((B,), math.log(2.0)), rtol=0, atol=1e-7)


def test_dpo_prefers_raising_the_chosen() -> None:
    c = torch.tensor([-3.0], requires_grad=True)
    r = torch.tensor([-3.0], requires_grad=True)
    dpo_loss(c, r, torch.tensor([-3.0]), torch.tensor([-3.0]), beta=0.5).sum().backward()
    assert c.grad.item() < 0 < r.grad.item()


def test_simpo_is_differentiable_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(0)
    chosen_logits = torch.randn(2, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    rejected_logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    chosen_ids = torch.randint(0, 6, (2, 4), generator=g)
    rejected_ids = torch.randint(0, 6, (2, 3), generator=g)
    chosen_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    rejected_mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)

    def f(cl: torch.Tensor, rl: torch.Tensor) -> torch.Tensor:
        pc = sequence_logps(cl, chosen_ids, chosen_mask, average=True)
        pr = sequence_logps(rl, rejected_ids, rejected_mask, average=True)
        return simpo_loss(pc, pr, beta=2.0, gamma=0.5)

    assert f(chosen_logits, rejected_logits).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (chosen_logits, rejected_logits), eps=1e-6, atol=1e-5)


def test_simpo_matches_trl_cpo_formula() -> None:
    pc, pr = torch.tensor([-0.5, -1.2]), torch.tensor([-0.9, -0.4])
    beta, gamma = 2.0, 0.7
    logits = (pc - pr) - gamma / beta  # trl/experimental/cpo, loss_type="simpo"
    want = -torch.nn.functional.logsigmoid(beta * logits)
    torch.testing.assert_close(simpo_loss(pc, pr, beta, gamma), want)


def test_sequence_logps_and_row_mean_respect_the_mask() -> None:
    logits = _logits(0)
    labels = torch.zeros(B, T, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    full = logits.log_softmax(-1)[..., 0]
    torch.testing.assert_close(sequence_logps(logits, labels, mask)[0], full[0, :2].sum())
    torch.testing.assert_close(
        sequence_logps(logits, labels, mask, average=True)[1], full[1].mean()
    )
    assert masked_row_mean(full, mask)[2] == 0


# --------------------------------------------------------------------------- compose_loss
def test_compose_loss_skips_disabled_channels_exactly() -> None:
    grpo = torch.tensor(0.25, requires_grad=True)
    d, r = torch.tensor(2.0), torch.tensor(3.0)
    assert compose_loss(grpo).total is grpo
    assert compose_loss(grpo, distill=d, replay=r, alpha=0.0, beta=0.0).total is grpo
    assert compose_loss(grpo, distill=None, replay=None, alpha=1.0, beta=1.0).total is grpo
    out = compose_loss(grpo, distill=None, replay=r, alpha=1.0, beta=0.0)
    assert out.total is grpo and out.distill_loss is None and out.replay_loss is None
    assert compose_loss(grpo).metrics() == {"grpo_loss": 0.25}


def test_compose_loss_arithmetic_and_scales() -> None:
    grpo = torch.tensor(0.25, requires_grad=True)
    out = compose_loss(
        grpo,
        distill=torch.tensor(2.0),
        replay=torch.tensor(3.0),
        alpha=0.5,
        beta=0.1,
        distill_scale=0.5,
        replay_scale=0.25,
        grpo_scale=2.0,
    )
    assert out.total.item() == pytest.approx(0.25 + 0.5 * 2.0 * 0.5 + 0.1 * 3.0 * 0.25)
    assert out.metrics() == {"grpo_loss": 0.5, "distill_loss": 2.0, "replay_loss": 3.0}
    with pytest.raises(ValueError, match=">= 0"):
        compose_loss(grpo, distill=torch.tensor(1.0), alpha=-0.1)


def test_loss_functions_keep_float32_under_bf16_inputs() -> None:
    s, t = _logits(0, dtype=torch.bfloat16), _logits(1, dtype=torch.bfloat16)
    labels = torch.zeros(B, T, dtype=torch.long)
    assert sequence_logps(s, labels, torch.ones(B, T)).dtype == torch.float32
    assert distill_per_token(s.float(), t.float()).dtype == torch.float32
