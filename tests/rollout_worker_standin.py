"""A stand-in rollout worker for the launcher's tests: the process the executors start with
``CRF_ROLE=rollout`` (``python tests/rollout_worker_standin.py``), doing what the launcher
watches of a worker and nothing else - no model, no generation.

It prints its role variables, writes its heartbeat (``workers/<w>/state.json``) with a few
made-up rollouts, and waits until its trainer's result (``results/<rank>.json``) appears,
then writes its own result (``workers/<w>/result.json``) and exits 0. SIGTERM (the driver
cancelling it) ends it with a ``cancelled`` result. ``CRF_TEST_WORKER_DIES=w`` makes worker
w's first attempt exit 1 at once (the driver must restart it, and the run must not care).

It stands in for crf's own worker (``crf/rollouts/worker.py``, this repository), not for
another project's API: the real worker runs under the launcher in tests/test_rollouts_e2e.py.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from crf import layout
from crf.store import RunStore


def main() -> int:
    env = os.environ
    worker, rank = int(env[layout.ENV_WORKER]), int(env[layout.ENV_RANK])
    for name in (layout.ENV_ROLE, layout.ENV_WORKER, layout.ENV_RANK, layout.ENV_WORLD_SIZE):
        print(f"{name}={env.get(name)}", flush=True)
    store = RunStore(env[layout.ENV_RUN_URI])
    marker = f"faults/standin-{worker}"
    if env.get("CRF_TEST_WORKER_DIES") == str(worker) and store.put_if_absent(marker, b"1"):
        print("dying on purpose", flush=True)
        return 1
    state = layout.WorkerState(worker=worker, serves=rank, phase="generating", version=0,
                               rollouts=8, batches=1, staleness_mean=0.5, pid=os.getpid(),
                               host=socket.gethostname())  # fmt: skip
    ended = {"how": None}
    signal.signal(signal.SIGTERM, lambda *_: ended.update(how="cancelled"))
    while ended["how"] is None:
        state.updated_at = time.time()
        store.put_json(layout.worker_state_key(worker), state.to_dict())
        if store.exists(layout.result_key(rank)):
            ended["how"] = "ok"
            break
        time.sleep(0.2)
    state.phase, state.status, state.updated_at = "done", ended["how"], time.time()
    store.put_json(layout.worker_result_key(worker), state.to_dict())
    print(f"worker {worker} done ({ended['how']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
