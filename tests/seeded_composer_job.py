"""The composer job with sampling that does not depend on how the batch is split (a job for
tests/test_composer_local_ranks.py, named by module path: ``--job tests.seeded_composer_job``).

GRPO samples its rollouts from the global RNG of each process, so a replica of K local ranks
draws other completions than one process drawing the whole batch, and the two runs could
only be compared in distribution. Here each rollout's token at each position is still drawn
from the model's own (temperature-warped) distribution, by inverse CDF, but with a uniform
from a generator seeded by (generate call, the rollout's row in the replica's batch, the
position): the same rollout gets the same draw whichever local rank generates it, so a run
with K = 2 and one with K = 1 train on the same completions and must end with the same
weights up to float summation order. Greedy generation (the held-out eval) is untouched.
"""

from __future__ import annotations

import os
from typing import Any

from crf.replica.jobs.composer import LOCAL_RANKS, Config, replica_batch
from crf.replica.jobs.composer import run as _composer_run

__all__ = ["LOCAL_RANKS", "Config", "replica_batch", "run"]


class RowSeededSampling:
    """A logits processor that samples each row itself and leaves only its token: the
    sampler after it (multinomial over a one-hot distribution) then draws that token."""

    def __init__(self, call: int, local_rank: int) -> None:
        self.call, self.local_rank = call, local_rank
        self.prompt_len: int | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        position = input_ids.shape[1] - self.prompt_len
        first_row = self.local_rank * scores.shape[0]  # each local rank: an equal share
        cdf = torch.softmax(scores.float(), dim=-1).cumsum(-1)
        out = torch.full_like(scores, float("-inf"))
        for i in range(scores.shape[0]):
            seed = (self.call * 1_000_003 + first_row + i) * 1_009 + position
            u = torch.rand((), generator=torch.Generator().manual_seed(seed))
            token = min(int(torch.searchsorted(cdf[i], u * cdf[i, -1])), scores.shape[1] - 1)
            out[i, token] = 0.0
        return out


def _install() -> None:
    """Append :class:`RowSeededSampling` to every sampling ``generate`` of this process."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin._get_logits_processor
    calls = [0]

    def patched(self: Any, generation_config: Any, *args: Any, **kwargs: Any) -> Any:
        processors = original(self, generation_config, *args, **kwargs)
        if generation_config.do_sample:
            rank = int(os.environ.get("LOCAL_RANK", "0"))  # the elastic launcher's
            processors.append(RowSeededSampling(calls[0], rank))
            calls[0] += 1
        return processors

    GenerationMixin._get_logits_processor = patched


def run(ctx: Any, cfg: Config) -> dict[str, Any]:
    _install()
    return _composer_run(ctx, cfg)
