"""crf.integrations.prime_rl through PRIME-RL's own code (``make test-prime-rl``).

PRIME-RL is not a package on the index, so this test imports it from the source tree that
``PRIME_RL_SRC`` names (the repository root, at the commit tests/prime_rl_upstream.py
follows: 559b4477), in an environment with what its loss and packing modules import (torch,
beartype, jaxtyping, pydantic, prime-pydantic-config, wandb, msgspec, pyzmq, numpy) on
Python 3.12, as PRIME-RL requires. Without it the test is skipped, and
tests/test_integrations_prime_rl.py checks the same contract against the stand-in;
``CRF_REQUIRE_PRIME_RL=1`` (set by ``make test-prime-rl``) turns the skip into a failure.

What runs is PRIME-RL's: ``prepare_batch`` packs and pads the samples, its data loader turns
them into tensors, ``setup_rl_loss_fn(CustomLossConfig(...))`` imports the composer loss by
its ``import_path``, and ``compute_loss`` calls it per sample and divides by ``rl_scale``.
The one piece rebuilt here is ``rl_scale`` itself, which ``train.py`` counts inline.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests import prime_rl_upstream as standin

LOSS_PATH = "crf.integrations.prime_rl.composer_loss"


def _prime_rl() -> dict[str, ModuleType]:
    """PRIME-RL's modules, or a skip (a failure under CRF_REQUIRE_PRIME_RL) saying why not."""
    required = os.environ.get("CRF_REQUIRE_PRIME_RL") == "1"
    root = os.environ.get("PRIME_RL_SRC")
    why = None
    if not root:
        why = "PRIME_RL_SRC (a PRIME-RL checkout) is not set: make test-prime-rl PRIME_RL_SRC=..."
    else:
        src = [Path(root) / "src", Path(root) / "packages" / "prime-rl-configs" / "src"]
        sys.path[:0] = [str(p) for p in src if str(p) not in sys.path]
        names = ("trainer.rl.loss", "trainer.batch", "trainer.rl.data", "configs.trainer")
        try:
            return {name: importlib.import_module(f"prime_rl.{name}") for name in names}
        except ImportError as e:
            why = f"PRIME-RL's loss does not import from {root}: {e}"
    if required:
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)


PR = _prime_rl()
loss_mod, batch_mod, data_mod = PR["trainer.rl.loss"], PR["trainer.batch"], PR["trainer.rl.data"]
CustomLossConfig = PR["configs.trainer"].CustomLossConfig
TrainingSample = batch_mod.TrainingSample


def _fields(cls: type) -> list[tuple[str, Any]]:
    return [(f.name, f.default) for f in dataclasses.fields(cls)]


def test_the_stand_in_is_prime_rl_field_for_field() -> None:
    assert _fields(standin.LossInputs) == _fields(loss_mod.LossInputs)
    assert _fields(standin.LossOutputs) == _fields(loss_mod.LossOutputs)
    assert batch_mod.STREAM_FILL == {"rl_weights": 1.0, "ce_weights": 0.0, "ref_kl_weights": 0.0}
    params = list(inspect.signature(loss_mod.compute_loss).parameters)
    assert params[:6] == ["trainer_logprobs", "inference_logprobs", "ref_logprobs",
                          "advantages", "loss_mask", "rl_weights"]  # fmt: skip
    assert {"rl_loss_fn", "rl_scale"} <= set(params)
    # the adapter returns PRIME-RL's own LossOutputs where PRIME-RL is importable
    from crf.integrations import prime_rl

    assert importlib.reload(prime_rl).LossOutputs is loss_mod.LossOutputs


def _sample(n: int, first_id: int, *, advantage: float | None, ref: bool, **streams: Any):
    """A TrainingSample of ``n`` tokens, the first two a prompt; token ids are unique across
    samples so a token's trainer log-prob can be found again after packing reorders them."""
    ids = list(range(first_id, first_id + n))
    inference = [-0.2 - 0.1 * (i % 13) for i in ids]
    mask = [False, False] + [True] * (n - 2)
    return TrainingSample(
        token_ids=ids, mask=mask, logprobs=inference, temperatures=[1.0] * n, env_name="e",
        ref_logprobs=[v - 0.25 for v in inference] if ref else None,
        advantages=None if advantage is None else [advantage] * n, **streams,
    )  # fmt: skip


def _trainer_logprob(token_id: int, inference: float) -> float:
    return inference + 0.02 * (token_id % 7 - 3)


def _run(samples: list, kwargs: dict) -> tuple[torch.Tensor, dict, list[torch.Tensor], list]:
    """PRIME-RL's step for one data rank: pack, tensors, rl_scale, then compute_loss per
    micro-batch with the composer loss as ``[trainer.loss] type = "custom"``."""
    rl_loss_fn = loss_mod.setup_rl_loss_fn(CustomLossConfig(import_path=LOSS_PATH, kwargs=kwargs))
    bin_cost = batch_mod.build_bin_cost(None)
    [micro] = batch_mod.prepare_batch(samples, 64, 1, bin_cost, pad_to_multiple_of=8)
    loader = data_mod.DataLoader.__new__(data_mod.DataLoader)
    tensors = [loader._micro_batch_to_tensor(mb) for mb in micro]

    def scale(key: str) -> int:  # the counts train.py makes before the micro-batch loop
        total = 0
        for t in tensors:
            w, mask = t[key], t["loss_mask"]
            if key == "rl_weights":
                total += int((mask & (w != 0)).sum()) if w is not None else int(mask.sum())
            elif w is not None:
                total += int((w != 0).sum())
        return max(total, 1)

    rl_scale, ref_kl_scale = scale("rl_weights"), scale("ref_kl_weights")
    total, metrics, leaves = torch.zeros(()), {}, []
    for t in tensors:
        lengths = t["sequence_lengths"]
        ids = t["input_ids"][0].tolist()
        inference = t["inference_logprobs"][0]
        trainer = torch.tensor(
            [_trainer_logprob(i, v) for i, v in zip(ids, inference.tolist(), strict=True)]
        ).unsqueeze(0).requires_grad_()  # fmt: skip
        leaves.append((trainer, ids))

        def split(x: torch.Tensor | None, lengths: list[int] = lengths) -> list | None:
            return None if x is None else x.squeeze().split(lengths)

        loss, m = loss_mod.compute_loss(
            trainer_logprobs=trainer.squeeze().split(lengths),
            inference_logprobs=split(inference.unsqueeze(0)),
            ref_logprobs=split(t["ref_logprobs"]),
            advantages=split(t["advantages"]),
            loss_mask=split(t["loss_mask"]),
            rl_weights=split(t["rl_weights"]),
            ce_weights=split(t["ce_weights"]),
            ref_kl_weights=split(t["ref_kl_weights"]),
            rl_loss_fn=rl_loss_fn,
            rl_scale=rl_scale,
            ce_scale=1,
            ref_kl_scale=ref_kl_scale,
        )
        total = total + loss
        for k, v in m.items():
            metrics.setdefault(k, []).extend(v.tolist())
    return total, metrics, [rl_scale, ref_kl_scale], leaves


def _by_hand(samples: list, alpha: float, scale: int) -> float:
    """The rl part of the step in float64 from the samples' own lists (module docstring of
    crf.integrations.prime_rl), packing order and padding aside."""
    total = 0.0
    for s in samples:
        w = s.rl_weights or [1.0] * len(s.mask)
        for k, (tid, m) in enumerate(zip(s.token_ids, s.mask, strict=True)):
            if m and w[k] != 0:
                inf = s.logprobs[k]
                t = _trainer_logprob(tid, inf)
                total += -math.exp(t - inf) * s.advantages[k] * w[k]
                if s.ref_logprobs is not None:
                    total += alpha * (t - s.ref_logprobs[k]) * w[k]
    return total / scale


def test_composer_loss_through_prime_rl_compute_loss() -> None:
    """A GRPO sample (no weight stream), one with rl weights 0.5, and one that trains rl tokens
    with reference log-probs (what an algorithm registered in PRIME-RL's code could send):
    packed into one padded micro-batch, the plain sample's reference is the pack's 0.0 fill."""
    samples = [
        _sample(7, 0, advantage=0.7, ref=False),
        _sample(6, 100, advantage=-0.4, ref=False, rl_weights=[0.5] * 6),
        _sample(9, 200, advantage=0.3, ref=True),
    ]
    loss, metrics, (rl_scale, _), leaves = _run(samples, {"distill_alpha": 0.2})
    assert rl_scale == 5 + 4 + 7
    assert sorted(metrics["distill_samples"]) == [0.0, 0.0, 1.0]
    assert loss.item() == pytest.approx(_by_hand(samples, 0.2, rl_scale), rel=1e-5)
    loss.backward()
    [(trainer, ids)] = leaves
    prompt = {0, 1, 100, 101, 200, 201}
    grads = dict(zip(ids, trainer.grad[0].tolist(), strict=True))  # padding: id 1, grad 0
    assert all(grads[i] == 0 for i in prompt)
    assert all(grads[i] != 0 for i in ids if i not in prompt and i >= 2)


def test_an_opd_sample_trains_prime_rl_ref_kl_and_never_reaches_the_composer_loss() -> None:
    """An opd sample as the orchestrator stamps it (``stamp_loss_routing(sample, "ref_kl")``:
    rl weights 0.0, ref_kl weights 1.0 on its trainable tokens, no advantages) packed with a
    GRPO sample: the composer loss runs on the GRPO sample only, which has no teacher, so
    distill_alpha changes nothing; the opd sample trains through PRIME-RL's ref_kl loss."""
    opd = _sample(6, 100, advantage=None, ref=True, rl_weights=[0.0] * 6,
                  ref_kl_weights=[0.0, 0.0] + [1.0] * 4)  # fmt: skip
    samples = [_sample(7, 0, advantage=0.7, ref=False), opd]
    with_alpha, metrics, (rl_scale, ref_kl_scale), _ = _run(samples, {"distill_alpha": 0.5})
    without, _, _, _ = _run(samples, {})
    assert (rl_scale, ref_kl_scale) == (5, 4)
    assert metrics["distill_samples"] == [0.0] and "ref_kl" in metrics
    assert with_alpha.item() == without.item()
    grpo_only = _by_hand(samples[:1], 0.0, rl_scale)
    assert with_alpha.item() != pytest.approx(grpo_only)  # the ref_kl part is in the step
