"""crf inside other training stacks: the composer's loss channels and DiLoCo through a
bucket, for a loop crf does not own.

- :mod:`crf.integrations.hook` - :class:`~crf.integrations.hook.DiLoCoHook`, which any
  training loop (verl's actor update, PRIME-RL's trainer step, a Monarch learner endpoint, a
  plain ``for`` loop under torchrun) calls once per optimizer step to join a crf run.
- :mod:`crf.integrations.prime_rl` - a PRIME-RL custom loss (``[trainer.loss] type =
  "custom"``): DPPO-style masked GRPO plus the distillation and replay channels.
- :mod:`crf.integrations.verl` - a verl policy loss ``composer`` registered through the
  ``verl.plugins`` entry point.
- :mod:`crf.integrations.monarch` - a Monarch learner actor that runs the hook.

How to use each: docs/integrations.md. Each module imports its framework only when used, so
``import crf.integrations`` costs nothing.
"""
