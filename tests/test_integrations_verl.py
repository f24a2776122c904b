"""crf.integrations.verl against verl's interface, with a stand-in for verl.

This is the stand-in half, run where verl is not installed (the main test environment; verl
0.9.1 needs transformers<5.11 and Ray): a stand-in ``verl`` package, on the path of a fresh
interpreter, with what the adapter touches as verl 0.9.1 has it: ``verl/__init__.py`` loading
every entry point of the ``verl.plugins`` group, ``register_policy_loss`` /
``get_policy_loss_fn`` in ``verl/trainer/ppo/core_algos.py``, and
``compute_policy_loss_vanilla`` reading the actor config as verl 0.9.1's does
(``clip_ratio``, ``clip_ratio_low``/``clip_ratio_high``, ``clip_ratio_c``,
``global_batch_info``; a token-mean PPO-clip here, the hand reference). crf's entry point
comes from a dist-info beside it, written from pyproject.toml. The same checks against the
real verl 0.9.1 are tests/test_integrations_verl_real.py (``make test-verl``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

VERL_INIT = """
from importlib.metadata import entry_points
for ep in entry_points(group="verl.plugins"):
    ep.load()
"""

CORE_ALGOS = """
import torch
POLICY_LOSS_REGISTRY = {}

def register_policy_loss(name):
    def decorator(func):
        POLICY_LOSS_REGISTRY[name] = func
        return func
    return decorator

def get_policy_loss_fn(name):
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"Unsupported loss mode: {name}")
    return POLICY_LOSS_REGISTRY[name]

@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask,
                                loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
    ratio = torch.exp(log_prob - old_log_prob)
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    clip_c = config.get("clip_ratio_c", 3.0)
    losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high))
    losses = torch.where(advantages < 0, torch.minimum(losses, -advantages * clip_c), losses)
    m = response_mask.to(losses.dtype)
    config.global_batch_info  # verl hands it to agg_loss; token-mean over one rank here
    return (losses * m).sum() / m.sum(), {"actor/pg_clipfrac": 0.0}
"""


def _stand_in(root: Path) -> Path:
    pkg = root / "verl" / "trainer" / "ppo"
    pkg.mkdir(parents=True)
    (root / "verl" / "__init__.py").write_text(VERL_INIT)
    for d in (root / "verl" / "trainer", pkg):
        (d / "__init__.py").touch()
    (pkg / "core_algos.py").write_text(CORE_ALGOS)
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    dist = root / "crf_plugin-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: crf-plugin\nVersion: 0\n")
    lines = [f"{k} = {v}" for k, v in eps["verl.plugins"].items()]
    (dist / "entry_points.txt").write_text("[verl.plugins]\n" + "\n".join(lines) + "\n")
    return root


def test_pyproject_declares_the_verl_plugin() -> None:
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["verl.plugins"] == {"crf": "crf.integrations.verl"}


def test_loss_mode_composer_works_after_import_verl_alone(tmp_path: Path) -> None:
    """A fresh process that imports only verl finds ``composer`` (the entry point), and its
    loss is verl's PPO-clip over the distillation-folded advantages."""
    root = _stand_in(tmp_path / "site")
    script = textwrap.dedent("""
        import types, torch
        import verl
        from verl.trainer.ppo.core_algos import get_policy_loss_fn, compute_policy_loss_vanilla
        fn = get_policy_loss_fn("composer")
        class Cfg(dict):
            __getattr__ = dict.__getitem__
        cfg = Cfg(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                  global_batch_info={"dp_size": 1})
        g = torch.Generator().manual_seed(0)
        old = -torch.rand(2, 5, generator=g, dtype=torch.float64)
        new = (old + 0.3 * torch.randn(2, 5, generator=g, dtype=torch.float64)).requires_grad_()
        adv = torch.tensor([[1.0] * 5, [-1.0] * 5], dtype=torch.float64)
        mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
        loss, metrics = fn(old, new, adv, mask, "token-mean", cfg, None)
        ref, _ = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", cfg, None)
        assert torch.equal(loss, ref), (loss, ref)
        assert set(metrics) == {"actor/pg_clipfrac", "crf/rollout_kl"}
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _batch(**t: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(batch=dict(t))


def test_fold_distillation_adds_the_channel_to_response_tokens_only() -> None:
    from crf.integrations.verl import DISTILL_KEY, TEACHER_KEY, fold_distillation

    old = torch.tensor([[-1.0, -2.0, -3.0]])
    batch = _batch(
        advantages=torch.tensor([[0.5, 0.5, 0.5]]), old_log_probs=old,
        response_mask=torch.tensor([[1, 1, 0]]),
        **{TEACHER_KEY: old + torch.tensor([[1.0, -1.0, 9.0]])},
    )  # fmt: skip
    fold_distillation(batch, 0.5)
    assert batch.batch["advantages"].tolist() == [[1.0, 0.0, 0.5]]
    assert batch.batch[DISTILL_KEY].tolist() == [[0.5, -0.5, 0.0]]


@pytest.mark.parametrize(
    ("teacher", "message"),
    [
        (None, "the batch has no 'ref_log_prob'"),
        (torch.zeros(1, 2), "has shape \\(1, 2\\)"),
    ],
)
def test_fold_distillation_refuses_a_missing_or_misshapen_teacher(teacher, message) -> None:
    from crf.integrations.verl import TEACHER_KEY, fold_distillation

    t = {"advantages": torch.zeros(1, 3), "old_log_probs": torch.zeros(1, 3),
         "response_mask": torch.ones(1, 3)}  # fmt: skip
    if teacher is not None:
        t[TEACHER_KEY] = teacher
    with pytest.raises(ValueError, match=message):
        fold_distillation(_batch(**t), 0.1)


def test_the_trainer_subclass_folds_before_the_actor_update() -> None:
    """composer_trainer_class over a base with verl's ``_update_actor(batch)``: the batch
    the update gets has the channel folded in (alpha from the config's ``crf`` table)."""
    from crf.integrations.verl import DISTILL_KEY, composer_trainer_class

    seen = []

    class Base:
        def __init__(self, config: dict) -> None:
            self.config = config

        def _update_actor(self, batch):
            seen.append(batch.batch["advantages"].clone())
            return "updated"

    cls = composer_trainer_class(Base)
    old = torch.tensor([[-1.0, -2.0]])
    batch = _batch(advantages=torch.zeros(1, 2), old_log_probs=old,
                   response_mask=torch.ones(1, 2), ref_log_prob=old + 2.0)  # fmt: skip
    assert cls({"crf": {"distill_alpha": 0.25}})._update_actor(batch) == "updated"
    assert seen[0].tolist() == [[0.5, 0.5]] and DISTILL_KEY in batch.batch
    plain = _batch(advantages=torch.zeros(1, 2), old_log_probs=old,
                   response_mask=torch.ones(1, 2))  # fmt: skip
    cls({})._update_actor(plain)  # alpha 0: verl's update, untouched, no teacher needed
    assert seen[1].tolist() == [[0.0, 0.0]]


def test_importing_without_verl_registers_nothing() -> None:
    import importlib.util

    from crf.integrations import verl as adapter

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed here")
    assert adapter.register() is False
