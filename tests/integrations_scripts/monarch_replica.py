"""One crf replica whose local ranks are a Monarch proc mesh: K learner actors (one per
process, one torch.distributed gloo group, each exchanging its own FSDP shard through
DiLoCoHook), driven from here until the run's steps are taken. Run as a replica by
``crf launch --entrypoint "python tests/integrations_scripts/monarch_replica.py [K]"``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from monarch.actor import this_host
from monarch.spmd import setup_torch_elastic_env

from crf.integrations.monarch import learner_class


def main(procs_per_replica: int) -> None:
    # the learners' processes inherit this environment: the replica contract (CRF_*) and
    # where the factory module lies
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    procs = this_host().spawn_procs(per_host={"procs": procs_per_replica})
    setup_torch_elastic_env(procs)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT on each learner
    learners = procs.spawn("learner", learner_class(), "monarch_model:build")
    while not all(r["done"] for r in learners.step.call().get().values()):
        pass
    learners.close.call().get()
    procs.stop().get()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
