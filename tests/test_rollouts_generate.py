"""A rollout worker's generation (crf/rollouts/generate.py) is TRL's own, on a tiny Qwen2."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

from crf.composer import char_tokenizer  # noqa: E402
from crf.composer.task import task_alphabet  # noqa: E402
from crf.rollouts.generate import (  # noqa: E402
    generate_rollouts,
    per_token_logps,
    rollout_tensors,
    sampling_settings,
    tokenizer_digest,
)
from tests.rollout_helpers import GENERATIONS, ROWS, TOK, make_trainer, repeated  # noqa: E402


@pytest.fixture(scope="module")
def trainer():
    return make_trainer()


def test_generation_is_trls_for_the_same_random_state(trainer) -> None:
    rows = repeated(ROWS[:4])
    torch.manual_seed(7)
    prompt_ids, completion_ids, logprobs = generate_rollouts(trainer, rows)
    torch.manual_seed(7)
    trainer.model.train()
    trl_prompts, trl_completions, *_ = trainer._generate([r["prompt"] for r in rows])
    assert prompt_ids == [list(p) for p in trl_prompts]
    assert completion_ids == [list(c) for c in trl_completions]
    assert [len(lp) for lp in logprobs] == [len(c) for c in completion_ids]
    # groups are consecutive: num_generations copies of each prompt
    for g in range(0, len(rows), GENERATIONS):
        assert len({tuple(p) for p in prompt_ids[g : g + GENERATIONS]}) == 1


def test_behaviour_logprobs_are_the_trainers_proximal_ones(trainer) -> None:
    rows = repeated(ROWS[4:6])
    prompt_ids, completion_ids, logprobs = generate_rollouts(trainer, rows)
    proximal = per_token_logps(trainer, rollout_tensors(trainer, prompt_ids, completion_ids))
    for i, lp in enumerate(logprobs):
        assert torch.equal(torch.tensor(lp), proximal[i, : len(lp)])
    assert all(x <= 0 for lp in logprobs for x in lp)


def test_generation_leaves_the_models_mode_as_it_was(trainer) -> None:
    trainer.model.eval()
    generate_rollouts(trainer, repeated(ROWS[:1]))
    assert not trainer.model.training


def test_sampling_settings_name_the_behaviour_distribution(trainer) -> None:
    s = sampling_settings(trainer)
    assert s == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": s["top_k"],
        "min_p": None,
        "repetition_penalty": 1.0,
        "max_new_tokens": 4,
        "num_generations": GENERATIONS,
    }


def test_tokenizer_digest_tells_tokenizers_apart() -> None:
    assert tokenizer_digest(TOK) == tokenizer_digest(char_tokenizer(task_alphabet("abcd")))
    assert tokenizer_digest(TOK) != tokenizer_digest(char_tokenizer(task_alphabet("abcde")))
    other = char_tokenizer(task_alphabet("abcd"))
    other.chat_template = "{{ messages }}"
    assert tokenizer_digest(TOK) != tokenizer_digest(other)


def test_tokenizer_digest_ignores_the_padding_of_the_last_call() -> None:
    """A trainer whose tokenizer padded an evaluation batch still matches its worker's."""
    used = char_tokenizer(task_alphabet("abcd"))
    before = tokenizer_digest(used)
    used(["ab", "abcd"], padding=True, truncation=True, max_length=3)
    assert tokenizer_digest(used) == before == tokenizer_digest(TOK)


def test_empty_batch_is_refused(trainer) -> None:
    with pytest.raises(ValueError, match="at least one row"):
        generate_rollouts(trainer, [])


def test_a_worker_generates_in_the_trainers_precision() -> None:
    """A worker's trainer is never prepared by accelerate, so its model's forward carries no
    autocast: the generation enters the trainer's own (bf16 here, on the CPU), as the
    training replica's prepared model does, so both sample from the same distribution."""
    worker = make_trainer(bf16=True)
    assert not hasattr(worker.model, "_original_forward")  # not wrapped by accelerate
    seen: list[torch.dtype] = []
    lm_head = worker.model.get_output_embeddings()
    hook = lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    try:
        generate_rollouts(worker, repeated(ROWS[:1]))
    finally:
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16}, seen
    assert next(worker.model.parameters()).dtype == torch.float32  # the weights stay fp32
