"""What a run driven through crf.integrations.hook must leave, whichever loop drove it (a
torchrun FSDP loop, a Monarch learner mesh): every replica committed every round, each local
rank exchanged its own shard, and the replicas hold the same bits shard by shard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def assert_sharded_replicas_agree(run: Path, rounds: int, steps: int, ranks: int = 2) -> Any:
    """The run's result, after asserting the above for ``ranks`` local ranks per replica."""
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok"
    reps = result["replicas"]
    assert len(reps) == 2
    for r in reps:
        assert r["exit_code"] == 0 and r["rounds_committed"] == rounds and r["steps"] == steps
        assert r["job_metrics"]["local_ranks"] == ranks
    a, b = (r["job_metrics"]["shard_sha256"] for r in reps)
    assert len(a) == ranks and len(set(a)) == ranks  # different shards...
    assert a == b  # ...each the same bits on both replicas
    # each local rank exchanged its own shard (nobody uploaded the whole model)
    assert all((run / "shards" / f"{j}-of-{ranks}").is_dir() for j in range(ranks))
    return result
