"""What a replica writes to its log: a line per round at INFO (a line per inner step at
DEBUG), and none of the libraries' known per-round noise.

The level is ``CRF_LOG_LEVEL`` (default INFO). torchft's DiLoCo logs "Preparing"/"Syncing" at
INFO on every sync; crf's own round line says more (loss, reward, sync time, bytes), so
torchft's lines show only at DEBUG, and the libraries' progress bars not at all (a log is a
file). The warnings silenced here are exactly the known ones a replica would otherwise print on
every round, each matched by its message and category: anything else still shows.
"""

from __future__ import annotations

import logging
import os
import warnings

from crf import layout

#: (message regex, category): deprecations raised inside the libraries crf pins, not by
#: anything a user can change (TRL 1.16 reads transformers 5's deprecated property on
#: every generation)
KNOWN_NOISE: tuple[tuple[str, type[Warning]], ...] = (
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning),
)

#: loggers that speak at INFO on every sync; shown at DEBUG only
CHATTY = ("torchft.local_sgd", "torchft.manager")

#: the libraries' progress bars (transformers' "Writing model shards", TRL's dataset
#: preparation through datasets' map): a replica's output is a log file, where each redraw of
#: a bar is a carriage return and a line of block characters; read at their import, so set
#: before it, and only where the environment says nothing (a user's own setting wins)
NO_PROGRESS_BARS = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")


def configure(rank: str, *, role: str = "replica") -> None:
    """Logging for a replica process (or a rollout worker, ``role="rollout worker"``): who
    speaks in every line, the level from the env, no progress bars."""
    for name in NO_PROGRESS_BARS:
        os.environ.setdefault(name, "1")
    level = os.environ.get(layout.ENV_LOG_LEVEL, "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [{role} {rank}] %(levelname)s %(name)s: %(message)s",
    )
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in CHATTY:
            logging.getLogger(name).setLevel(logging.WARNING)
    for message, category in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
