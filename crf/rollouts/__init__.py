"""Rollout workers: processes that only generate, beside the trainer replicas that train.

A rollout worker follows one trainer replica (worker ``w`` serves trainer ``w % N``). The two
meet only through the run's store, like the replicas themselves:

- **weights out**: the trainer publishes its current policy every ``publish_every`` inner
  steps under a versioned key (crf/rollouts/policy.py): a delta against the round's global
  weights on one of the exchange's wires. The worker loads the newest version it may use and
  acknowledges it; a version is deleted only when no worker holds it and the staleness
  bound has let it go;
- **rollouts in**: the worker writes rollout batches (crf/rollouts/batches.py): dataset row
  ids, prompt and completion token ids, behaviour log-probs, the policy version, the sampling
  settings and a tokenizer digest. Admission control paces it to at most ``max_staleness``
  inner steps ahead of its trainer, never by dropping a batch;
- **the trainer** takes the oldest batch within the bound at each generation, else generates
  the batch itself (a run never depends on its workers), and corrects for the policy lag
  with decoupled PPO (crf/rollouts/correction.py).

docs/rollout-workers.md explains when the workers pay off and what staleness costs.
"""

from crf.rollouts.config import CORRECTION_MODES, RolloutConfig, Version

__all__ = ["CORRECTION_MODES", "RolloutConfig", "Version"]
