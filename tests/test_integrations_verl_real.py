"""crf.integrations.verl against the real verl 0.9.1 (``make test-verl``: a second
environment with verl 0.9.1 and crf, since verl needs transformers<5.11 and Ray). Skipped
where verl is not installed, as in the main test environment, where
tests/test_integrations_verl.py checks the same contract against a stand-in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="needs verl 0.9.1: make test-verl")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _fresh(script: str, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**os.environ, "PYTHONPATH": path, **env},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


DISCOVER = """
    import verl
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    try:
        print(get_policy_loss_fn("composer").__module__)
    except ValueError:
        print("not registered")
"""


def test_import_verl_alone_discovers_the_plugin() -> None:
    """The ``verl.plugins`` entry point: a fresh process that imports only verl has
    ``composer``; ``VERL_USE_EXTERNAL_PLUGINS=none`` turns discovery off, a list that names
    ``crf`` keeps it."""
    found = _fresh(DISCOVER)
    assert found.stdout.strip().endswith("crf.integrations.verl"), found.stderr[-2000:]
    off = _fresh(DISCOVER, VERL_USE_EXTERNAL_PLUGINS="none")
    assert off.stdout.strip().endswith("not registered"), off.stderr[-2000:]
    named = _fresh(DISCOVER, VERL_USE_EXTERNAL_PLUGINS="crf")
    assert named.stdout.strip().endswith("crf.integrations.verl"), named.stderr[-2000:]


def _actor_config():
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(
        ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=2, use_dynamic_bsz=False,
        rollout_n=1, clip_ratio_low=0.2, clip_ratio_high=0.28,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_composer_at_alpha_zero_is_vanilla_ppo_on_a_real_actor_config(mode: str) -> None:
    """No distillation folded in: the composer loss and its gradient are verl's
    ``compute_policy_loss_vanilla``, bit for bit, on a real ``FSDPActorConfig``."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_policy_loss_fn

    import crf.integrations.verl  # noqa: F401  (registered by import verl too)

    cfg = _actor_config()
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    start = old + 0.4 * torch.randn(3, 6, generator=g, dtype=torch.float64)  # some clipped
    ours, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
    loss, metrics = get_policy_loss_fn("composer")(old, ours, adv, mask, mode, cfg, None)
    ref, ref_metrics = compute_policy_loss_vanilla(old, theirs, adv, mask, mode, cfg, None)
    assert torch.equal(loss, ref)
    loss.backward()
    ref.backward()
    assert torch.equal(ours.grad, theirs.grad)
    assert set(metrics) == set(ref_metrics) | {"crf/rollout_kl"}


def _data_proto(alpha_teacher: float = 1.0):
    from verl import DataProto

    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.arange(12).reshape(2, 6),
            "attention_mask": torch.ones(2, 6, dtype=torch.long),
            "position_ids": torch.arange(6).repeat(2, 1),
            "responses": torch.arange(6).reshape(2, 3),
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
            "old_log_probs": old,
            "advantages": torch.full((2, 3), 0.5),
            "ref_log_prob": old + alpha_teacher * torch.tensor([[1.0, -1.0, 9.0]] * 2),
        }
    )


def test_the_fold_on_a_real_data_proto() -> None:
    from crf.integrations.verl import DISTILL_KEY, fold_distillation

    batch = fold_distillation(_data_proto(), 0.5)
    assert batch.batch["advantages"].tolist() == [[1.0, 0.0, 0.5], [1.0, 0.0, 5.0]]
    assert batch.batch[DISTILL_KEY].tolist() == [[0.5, -0.5, 0.0], [0.5, -0.5, 4.5]]
    with pytest.raises(ValueError, match="the batch has no 'crf_teacher'"):
        fold_distillation(_data_proto(), 0.5, teacher_key="crf_teacher")


class _Handed(Exception):
    """Raised by the stand-in worker group once verl's _update_actor hands it the batch."""


def test_the_trainer_subclass_folds_inside_verls_own_update_actor() -> None:
    """verl's real ``RayPPOTrainer._update_actor`` runs (its padding removal included) and
    hands the actor workers advantages with the distillation folded in; the workers (Ray,
    a GPU) are replaced by a recorder."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from crf.integrations.verl import composer_trainer_class

    cls = composer_trainer_class()
    assert issubclass(cls, RayPPOTrainer)
    seen = []

    class Workers:
        def update_actor(self, td):
            seen.append(td["advantages"].clone())
            raise _Handed

    def trainer(alpha: float):
        t = cls.__new__(cls)  # no Ray cluster: only what _update_actor reads
        t.config = OmegaConf.create({
            "actor_rollout_ref": {
                "rollout": {"multi_turn": {"enable": False}, "temperature": 1.0, "n": 1},
                "actor": {"calculate_entropy": False, "entropy_coeff": 0.0,
                          "ppo_mini_batch_size": 2, "ppo_epochs": 1, "data_loader_seed": 0,
                          "shuffle": False},
            },
            "crf": {"distill_alpha": alpha},
        })  # fmt: skip
        t.actor_rollout_wg = Workers()
        return t

    for alpha in (0.5, 0.0):
        with pytest.raises(_Handed):
            trainer(alpha)._update_actor(_data_proto())
    folded, plain = seen
    assert plain.tolist() == [[0.5] * 3] * 2
    assert folded.tolist() == [[1.0, 0.0, 0.5], [1.0, 0.0, 5.0]]
