"""The driver: validate a run, write run.json, launch replicas, watch them, gather results.

``crf.launcher.driver.launch`` is the Python entry point; ``crf.launcher.cli.app`` is the
``crf`` command. Submodules are imported on demand so ``crf --help`` stays fast.
"""
