"""The composer job's trainer settings (crf/replica/trl_settings.py): the toy's values without
``--model``, TRL's GRPOConfig defaults with it, ``trl.<field>`` settings from ``--set``,
``[job.trl]`` and the SDK, checked before launch, shown by ``--print-config`` and
``--dry-run``; and vLLM (``trl.use_vllm``): refused where it cannot run, and fed the new
global weights after every outer step (a stand-in engine: vLLM is never installed here);
continuous batching refused before launch on a transformers that cannot serve it."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from crf.launcher.cli import app
from crf.launcher.config_file import load_config, parse_config
from crf.replica import trl_settings
from crf.replica.jobs import job_config, nest_dotted
from crf.spec import RunSpec


def crf(*args: str | Path):
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _spec(**options: Any) -> RunSpec:
    return RunSpec(run_id="trl-test", run_uri="memory://trl-test", **options)


def _trainer_config(spec: RunSpec, tmp_path: Path, **values: Any) -> Any:
    """The ComposerConfig the job would train with, built without loading or training."""
    from crf.replica.jobs.composer import trainer_config

    ctx = SimpleNamespace(spec=spec, data_seed=1)
    return trainer_config(ctx, job_config("composer", values), output_dir=str(tmp_path / "o"),
                          steps=4)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2 in Hugging Face format (character tokenizer), written locally."""
    from crf.composer import char_tokenizer, save_tiny, tiny_qwen2
    from crf.composer.task import task_alphabet

    tok = char_tokenizer(task_alphabet("abcd"))
    where = tmp_path_factory.mktemp("tiny") / "model"
    return str(save_tiny(tiny_qwen2(tok, seed=0), tok, where))


# --------------------------------------------------------------------------- defaults
def test_the_toy_keeps_its_own_trainer_values(tmp_path: Path) -> None:
    args = _trainer_config(_spec(device="cpu"), tmp_path)
    assert (args.learning_rate, args.num_generations, args.max_completion_length) == (5e-3, 4, 5)
    assert (args.temperature, args.beta, args.lr_scheduler_type) == (1.0, 0.0, "constant")
    assert args.per_device_train_batch_size == 8 * 4 and args.max_steps == 4


def test_with_a_model_the_trainer_takes_grpo_config_defaults(
    tiny_model: str, tmp_path: Path
) -> None:
    from trl import GRPOConfig

    default = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    args = _trainer_config(_spec(model=tiny_model, device="cpu"), tmp_path)
    for name in ("learning_rate", "num_generations", "max_completion_length", "temperature",
                 "loss_type", "beta", "top_p", "epsilon", "scale_rewards"):  # fmt: skip
        assert getattr(args, name) == default[name], name
    assert args.per_device_train_batch_size == 8 * default["num_generations"]
    lora = _trainer_config(_spec(model=tiny_model, device="cpu", lora_rank=4), tmp_path)
    assert lora.learning_rate == default["learning_rate"] * trl_settings.LORA_LR_FACTOR
    # a knob and trl.<field> win over either default
    mine = _trainer_config(
        _spec(model=tiny_model, device="cpu", lora_rank=4),
        tmp_path,
        learning_rate="2e-5",
        **{"trl.top_p": "0.9", "trl.loss_type": "grpo"},
    )
    assert (mine.learning_rate, mine.top_p, mine.loss_type) == (2e-5, 0.9, "grpo")


# --------------------------------------------------------------------------- trl.<field>
def test_trl_fields_from_every_spelling_are_one_table() -> None:
    assert nest_dotted({"trl.top_p": "0.9", "trl": {"top_k": 5, "top_p": 1.0}, "lr": 1}) == {
        "trl": {"top_k": 5, "top_p": "0.9"}, "lr": 1}  # fmt: skip
    cfg = job_config("composer", {"trl.top_k": "5", "trl.use_vllm": "true",
                                  "trl.generation_kwargs": '{"min_tokens": 2}',
                                  "trl.epsilon_high": "none"})  # fmt: skip
    assert cfg.trl == {"top_k": 5, "use_vllm": True, "generation_kwargs": {"min_tokens": 2},
                       "epsilon_high": None}  # fmt: skip


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"trl.top_pp": "0.9"},
            "trl.top_pp is no field of TRL's GRPOConfig; did you mean trl.top_p?",
        ),  # fmt: skip
        ({"trl.seed": "3"}, "trl.seed is set by crf: use --seed"),
        ({"trl.bf16": "true"}, "trl.bf16 is set by crf: use --precision"),
        ({"trl.per_device_train_batch_size": "4"}, "use --set prompts_per_step"),
        ({"trl.model_init_kwargs": '{"dtype": "float16"}'}, "use --precision for its dtype"),
        ({"trl.trust_remote_code": "true"}, "trl.trust_remote_code is set by crf: use --trust"),
        (
            {"trl.distill_alpha": "1"},
            "a composer job option: set it as the job's own "
            "distill_alpha (--set distill_alpha=..., or "
            "distill_alpha = ... in [job])",
        ),  # fmt: skip
        (
            {"trl.beta": "0.1"},
            "trl.beta is a knob of the composer job: set it as the job's "
            "own grpo_beta (--set grpo_beta=..., or grpo_beta = ... in "
            "[job]), not in its trl table",
        ),  # fmt: skip
        ({"trl.temperature": "-1"}, "trl.temperature is a knob of the composer job"),
        ({"trl.max_completion_length": "0"}, "(--set max_completion_length=..., or"),
        ({"trl.learning_rate": "1e-4"}, "(--set learning_rate=..., or"),
        ({"trl.num_generations": "2"}, "(--set num_generations=..., or"),
        ({"trl.top_k": "many"}, "trl.top_k='many' is not a valid int"),
    ],
)
def test_bad_trl_settings_are_one_line_errors(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        job_config("composer", values)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_knob_given_as_trl_field_is_refused_before_launch(tmp_path: Path) -> None:
    result = crf("launch", "--set", "trl.temperature=-1", "--store", tmp_path / "runs",
                 "--dry-run")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "trl.temperature is a knob of the composer job: set it as the job's own " \
           "temperature (--set temperature=..., or temperature = ... in [job]), not in its " \
           "trl table" in " ".join(result.output.split())  # fmt: skip
    assert len(result.output.strip().splitlines()) == 1
    knob = crf("launch", "--set", "temperature=-1", "--store", tmp_path / "runs", "--dry-run")
    assert knob.exit_code == 2 and "temperature must be > 0" in knob.output, knob.output
    assert not (tmp_path / "runs").exists()


def test_values_grpo_config_refuses_are_refused_before_launch(tmp_path: Path) -> None:
    result = crf("launch", "--set", "trl.generation_batch_size=7", "--store", tmp_path / "runs",
                 "--dry-run")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "TRL's GRPOConfig refuses the job's trl settings: generation_batch_size (7) must be " \
           "divisible" in result.output  # fmt: skip
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


def test_cli_unknown_trl_field_says_did_you_mean(tmp_path: Path) -> None:
    for mode in ("--print-config", "--dry-run"):
        result = crf("launch", "--set", "trl.temprature=0.7", "--store", tmp_path / "runs", mode)
        assert result.exit_code == 2, result.output
        assert "trl.temprature is no field of TRL's GRPOConfig; did you mean trl.temperature?" \
            in result.output  # fmt: skip
        assert len(result.output.strip().splitlines()) == 1


def test_print_config_shows_the_effective_settings_and_round_trips(
    tmp_path: Path, tiny_model: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'model = "{tiny_model}"\n[job]\nprompts_per_step = 2\n'
                    '[job.trl]\ntop_p = 0.9\n')  # fmt: skip
    result = crf("launch", "-c", path, "--set", "trl.loss_type=grpo", "--print-config")
    assert result.exit_code == 0, result.output
    printed = parse_config(result.output)
    assert printed.job_config == {"prompts_per_step": 2, "trl": {"top_p": 0.9, "loss_type": "grpo"}}
    assert "[job.trl]" in result.output
    effective = result.output.split("# effective job settings")[1]
    # the knobs as they resolve for --model (TRL's defaults), and only what differs from TRL
    assert (
        "#   learning_rate = 1e-06" in effective and "#   max_completion_length = 512" in effective
    )
    trl_part = effective.split("differ from TRL's defaults:")[1]
    assert "#   top_p = 0.9" in trl_part and '#   loss_type = "grpo"' in trl_part
    assert "#   per_device_train_batch_size = 16" in trl_part
    assert "learning_rate" not in trl_part and "temperature" not in trl_part
    again = tmp_path / "again.toml"
    again.write_text(result.output)
    assert load_config(again).job_config == printed.job_config


def test_sdk_job_config_takes_a_trl_table(tmp_path: Path) -> None:
    from crf.launcher.plan import prepare

    plan = prepare({"job_config": {"trl": {"top_p": "0.5"}}, "replicas": 1},
                   store=str(tmp_path / "runs"), dry_run=True)  # fmt: skip
    assert plan.spec.job_config == {"trl": {"top_p": 0.5}}


# --------------------------------------------------------------------------- dry run
def _dataset(tmp_path: Path, answer: str) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text(f'{{"q": "ab=", "answer": "{answer}"}}\n{{"q": "ba=", "answer": "ab"}}\n')
    return path


def test_dry_run_shows_settings_and_warns_of_short_completions(
    tmp_path: Path, tiny_model: str
) -> None:
    data = _dataset(tmp_path, "abcd" * 10)
    base = ["launch", "--dataset", data, "--column", "prompt=q", "--reward", "exact_match",
            "--store", tmp_path / "runs", "--dry-run", "--set", "prompts_per_step=1"]  # fmt: skip
    toy = crf(*base)
    assert toy.exit_code == 0, toy.output
    flat = " ".join(toy.output.split())
    assert "job settings" in flat and "TRL settings" in flat
    assert "max_completion_length 5 is shorter than the longest answer in the 2 sampled" in flat
    assert "40 tokens (characters: the embedded model reads one character per token)" in flat
    # a local model folder: its own tokenizer counts (one token per character here too)
    mine = crf(*base, "--model", tiny_model, "--set", "max_completion_length=12")
    assert mine.exit_code == 0, mine.output
    flat = " ".join(mine.output.split())
    assert "max_completion_length 12 is shorter than the longest answer" in flat
    assert f"40 tokens (counted with {tiny_model}'s tokenizer)" in flat
    fits = crf(*base, "--model", tiny_model)  # TRL's 512 tokens: no warning
    assert fits.exit_code == 0 and "shorter than" not in fits.output
    assert not (tmp_path / "runs").exists()


def test_a_launch_warns_of_short_completions_as_its_dry_run_does(tmp_path: Path) -> None:
    """The warning is the launch's, not only the dry run's: the plan a launch starts from
    carries it, and the launch prints its plan's notes before any replica starts."""
    from crf.launcher.plan import prepare

    data = _dataset(tmp_path, "abcd" * 10)
    options = {"dataset": str(data), "columns": {"prompt": "q"}, "reward": ["exact_match"],
               "replicas": 2, "job_config": {"prompts_per_step": 1}}  # fmt: skip
    plan = prepare(options, store=str(tmp_path / "runs"))
    said = [n for n in plan.notes if "max_completion_length 5 is shorter" in n]
    assert len(said) == 1 and "completions will be cut" in said[0], plan.notes


def test_without_the_tokenizer_the_count_is_a_stated_estimate() -> None:
    notes = trl_settings.completion_notes(4, [{"answer": "x" * 40}], "/no/such/model")
    assert len(notes) == 1 and "10 tokens (estimated as characters / 4" in notes[0]


# --------------------------------------------------------------------------- vLLM
def test_vllm_is_refused_without_cuda_in_one_line(tmp_path: Path) -> None:
    for extra in (["--device", "cpu"], []):  # this machine has no CUDA GPU either
        result = crf("launch", "--set", "trl.use_vllm=true", *extra, "--store",
                     tmp_path / "runs", "--dry-run")  # fmt: skip
        assert result.exit_code == 2, result.output
        assert "trl.use_vllm needs a CUDA GPU" in result.output
        assert len(result.output.strip().splitlines()) == 1
    fields = {"use_vllm": True}
    with pytest.raises(trl_settings.SettingError, match="backend's hardware has none"):
        trl_settings.check_vllm(fields, _spec(), gpus=0, local=False)
    trl_settings.check_vllm(fields, _spec(), gpus=1, local=False)  # a GPU flavor: fine
    with pytest.raises(trl_settings.SettingError, match="colocate mode only"):
        trl_settings.check_vllm(fields | {"vllm_mode": "server"}, _spec(), gpus=1, local=False)


def test_vllm_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a)
    )
    with pytest.raises(trl_settings.SettingError) as err:
        trl_settings.check_vllm({"use_vllm": True}, _spec(), gpus=None, local=True)
    assert "pip install 'composer-replication[vllm]'" in str(err.value)


# --------------------------------------------------------------------------- continuous batching
def test_continuous_batching_on_an_older_transformers_is_one_line(tmp_path: Path) -> None:
    """TRL's continuous batching needs transformers >= 5.8, older ones are in crf's range:
    the setting is refused before launch, in one line, on this environment's transformers
    when it is older (the lowest set CI tests), and launches where it is not."""
    from packaging.version import Version

    from crf.versions import distribution_version

    on = {"use_transformers_continuous_batching": True}
    with pytest.raises(trl_settings.SettingError) as err:
        trl_settings.check_continuous_batching(on, version="5.6.2")
    assert str(err.value) == (
        "trl.use_transformers_continuous_batching needs transformers>=5.8.0, and this "
        "environment has 5.6.2: pip install 'transformers>=5.8.0,<6', or leave the setting off"
    )
    trl_settings.check_continuous_batching(on, version="5.8.0")
    trl_settings.check_continuous_batching({}, version="5.6.2")

    installed = distribution_version("transformers")
    result = crf("launch", "--set", "trl.use_transformers_continuous_batching=true",
                 "--store", tmp_path / "runs", "--dry-run")  # fmt: skip
    if Version(installed) < Version(trl_settings.CONTINUOUS_BATCHING_TRANSFORMERS):
        assert result.exit_code == 2, result.output
        assert result.output.strip() == f"error: {str(err.value).replace('5.6.2', installed)}"
    else:
        assert result.exit_code == 0, result.output
    assert not (tmp_path / "runs").exists()


def test_continuous_batching_under_autocast_is_refused_before_launch(tmp_path: Path) -> None:
    """The paged cache takes the weights' dtype (crf's fp32 master weights) while bf16
    autocast makes bf16 keys: a run whose precision is bf16 or fp16, or auto on a GPU with
    bfloat16 of its own, is refused in one line that names --precision fp32; fp32, auto
    without a GPU, and auto on a cloud GPU older than Ampere (a T4: auto is fp32 there),
    launch."""
    from crf.replica.model import native_bf16

    on = {"use_transformers_continuous_batching": True}
    new = "5.8.0"
    refused = [("bf16", "cpu", None, True, None), ("fp16", "cuda", None, True, None),
               ("auto", "auto", 1, False, True), ("auto", "auto", 1, False, None),
               ("auto", "cuda", None, False, None)]  # fmt: skip
    launched = [("fp32", "cuda", None, True, None), ("auto", "cpu", None, True, None),
                ("auto", "auto", 0, False, None), ("auto", "auto", 1, False, False),
                ("auto", "cuda", None, False, False), ("auto", "cpu", 1, False, True)]  # fmt: skip
    # local replicas: auto is bf16 where this machine's GPU has it (as crf.replica.model)
    (refused if native_bf16() else launched).append(("auto", "cuda", None, True, None))
    for precision, device, gpus, local, bf16 in refused:
        with pytest.raises(trl_settings.SettingError, match="needs --precision fp32"):
            trl_settings.check_continuous_batching(
                on, new, spec=_spec(precision=precision, device=device), gpus=gpus,
                local=local, bf16=bf16,
            )  # fmt: skip
    for precision, device, gpus, local, bf16 in launched:
        trl_settings.check_continuous_batching(
            on, new, spec=_spec(precision=precision, device=device), gpus=gpus, local=local,
            bf16=bf16,
        )  # fmt: skip

    result = crf("launch", "--set", "trl.use_transformers_continuous_batching=true",
                 "--precision", "bf16", "--store", tmp_path / "runs", "--dry-run")  # fmt: skip
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert line.startswith("error: ") and "\n" not in line, line
    from packaging.version import Version

    from crf.versions import distribution_version

    served = Version(distribution_version("transformers")) >= Version(new)
    # a transformers that cannot serve the path is named first (the lowest set CI tests)
    assert ("needs --precision fp32, and this run's is bf16" if served
            else "needs transformers>=5.8.0") in line  # fmt: skip
    assert not (tmp_path / "runs").exists()


def test_the_attention_choice_reaches_the_trainer(tmp_path: Path) -> None:
    """``--set generation_cudnn_attention=true`` reaches ComposerConfig; off by default."""
    spec = _spec(device="cpu")
    assert _trainer_config(spec, tmp_path).generation_cudnn_attention is False
    args = _trainer_config(spec, tmp_path, generation_cudnn_attention="true")
    assert args.generation_cudnn_attention is True


def test_compiled_decoding_reaches_the_trainer(tmp_path: Path) -> None:
    """``--set generation_compile=true|false|auto`` reaches ComposerConfig; unset, it is
    off for the embedded toy model and the trainer's choice (None) for ``--model``."""
    spec = _spec(device="cpu")
    assert _trainer_config(spec, tmp_path).generation_compile is False
    assert _trainer_config(spec, tmp_path, generation_compile="true").generation_compile is True
    model = _spec(device="cpu", model="org/model")
    assert _trainer_config(model, tmp_path).generation_compile is None
    assert _trainer_config(model, tmp_path, generation_compile="auto").generation_compile is None
    assert _trainer_config(model, tmp_path, generation_compile="off").generation_compile is False


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("trl.use_transformers_continuous_batching=true", "use_transformers_continuous_batching "
                                                          "replaces it"),
        ("trl.cache_implementation=dynamic", "trl.cache_implementation is 'dynamic'"),
        ("trl.use_vllm=true", "trl.use_vllm replaces it"),
    ],
)  # fmt: skip
def test_compiled_decoding_beside_another_path_is_one_line(
    tmp_path: Path, setting: str, message: str
) -> None:
    """Refused before launch, in one line, whatever else is wrong with the other setting on
    this machine (no CUDA for vLLM, an older transformers for continuous batching)."""
    result = crf("launch", "--set", "generation_compile=true", "--set", setting,
                 "--store", tmp_path / "runs", "--dry-run")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def _digest(model: Any) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class StandInVLLM:
    """TRL's ``VLLMGeneration`` surface in colocate mode: its own copy of the weights, updated
    only by ``sync_weights``; ``generate`` samples from that copy (with its logprobs)."""

    events: list[tuple[str, str]] = []

    def __init__(self, model: Any, processing_class: Any, max_completion_length: int,
                 temperature: float, **_: Any) -> None:  # fmt: skip
        self.model, self.tokenizer = model, processing_class
        self.engine = copy.deepcopy(model).eval()
        self.max_new, self.temperature = max_completion_length, temperature

    def sync_weights(self) -> None:
        self.engine.load_state_dict(self.model.state_dict())
        self.events.append(("push", _digest(self.engine)))

    def generate(self, prompts: list[list[int]], images: Any, num_generations: int,
                 profiler: Any = None) -> tuple:  # fmt: skip
        import torch

        self.events.append(("rollout", _digest(self.engine)))
        completions, logprobs = [], []
        with torch.no_grad():
            for ids in prompts:
                out = self.engine.generate(
                    torch.tensor([ids]), max_new_tokens=self.max_new, do_sample=True,
                    temperature=self.temperature, output_scores=True,
                    return_dict_in_generate=True, pad_token_id=self.tokenizer.pad_token_id,
                )  # fmt: skip
                new = out.sequences[0, len(ids) :].tolist()
                lps = [
                    torch.log_softmax(s[0].float(), -1)[t].item()
                    for s, t in zip(out.scores, new, strict=True)
                ]
                completions.append(new)
                logprobs.append([[lp] for lp in lps])
        return prompts, completions, logprobs, None


def test_vllm_gets_the_global_weights_after_every_outer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real replica (ReplicaContext, one replica, DiLoCo's outer step every 2 inner steps)
    trains the composer job with trl.use_vllm and a stand-in engine: after each outer step
    the weights are pushed, and the next rollout samples from exactly those weights."""
    import trl.trainer.grpo_trainer as grpo

    from crf.composer import ComposerReplicationTrainer
    from crf.replica.context import ReplicaContext
    from crf.replica.jobs.composer import Config, run
    from crf.store import RunStore

    events: list[tuple[str, str]] = []
    monkeypatch.setattr(StandInVLLM, "events", events)
    monkeypatch.setattr(grpo, "VLLMGeneration", StandInVLLM)
    after = ReplicaContext._after_inner_step

    def recorded(self: Any, *a: Any) -> None:
        after(self, *a)
        if self.step % self.spec.sync_period == 0:
            events.append(("outer", _digest(self.model)))

    monkeypatch.setattr(ReplicaContext, "_after_inner_step", recorded)
    stale = ComposerReplicationTrainer.weights_replaced

    def marked(self: Any) -> None:
        stale(self)
        assert self._last_loaded_step == -1  # TRL pushes before its next generation
        events.append(("stale", ""))

    monkeypatch.setattr(ComposerReplicationTrainer, "weights_replaced", marked)
    uri = f"file://{tmp_path}/run"
    spec = RunSpec(run_id="vllm-order", run_uri=uri, replicas=1, sync_every=2, rounds=2,
                   round_timeout_s=30.0, device="cpu", eval_examples=2).validate()  # fmt: skip
    RunStore(uri).put("run.json", spec.to_json().encode())
    env = {"CRF_RUN_URI": uri, "CRF_RANK": "0", "CRF_WORLD_SIZE": "1", "CRF_RUN_ID": spec.run_id}
    cfg = Config(num_examples=32, prompts_per_step=2,
                 trl={"use_vllm": True})  # fmt: skip
    with ReplicaContext.from_env(env) as ctx:
        ctx.finish(run(ctx, cfg))
    outers = [i for i, (kind, _) in enumerate(events) if kind == "outer"]
    assert len(outers) == 2, events
    rollouts = [kind for kind, _ in events].count("rollout")
    assert rollouts == 4, events  # one per inner step
    first = next(i for i, (kind, _) in enumerate(events) if kind == "rollout")
    assert events[first - 1][0] == "push"  # the weights reach the engine before any rollout
    # outer step 1 -> vLLM's copy marked stale -> weights pushed -> next rollout, all with
    # the new global weights
    i = outers[0]
    weights = events[i][1]
    assert events[i + 1 : i + 4] == [("stale", ""), ("push", weights), ("rollout", weights)]
    pushed_before = [d for kind, d in events[:i] if kind == "push"]
    assert weights not in pushed_before  # the outer step did change the weights
    assert events[outers[1] + 1] == ("stale", "")


def _recorder(config_cls: type) -> type:
    """``config_cls`` that keeps the keyword arguments it is built with (its fields stay
    readable) instead of building itself."""
    seen: dict[str, Any] = {}

    def init(self: Any, **kwargs: Any) -> None:
        seen.update(kwargs)

    return type("Recorded", (config_cls,), {"__init__": init, "seen": seen})


@pytest.mark.parametrize("job", ["composer", "sft"])
def test_every_field_crf_passes_its_trainer_is_refused_in_the_trl_table(
    job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What crf hands the trainer's config itself (2 local ranks and a tracker, so the DDP
    and reporting fields are there too) cannot also come from ``trl.*``: the two would reach
    the config as one keyword given twice and fail in every replica. Each is refused before
    launch, naming what to use instead, unless it is a knob of the job."""
    import trl

    import crf.composer
    from crf.launcher.errors import LaunchError
    from crf.launcher.plan import validate_job
    from crf.replica.jobs import composer, sft

    spec = SimpleNamespace(device="cpu", precision="fp32", gradient_checkpointing=True)
    tracker = SimpleNamespace(trainer_args=lambda: {"report_to": ["wandb"], "run_name": "r"})
    ctx = SimpleNamespace(spec=spec, data_seed=1, local=SimpleNamespace(size=2), tracker=tracker)
    if job == "sft":
        recorded = _recorder(trl.SFTConfig)
        monkeypatch.setattr(trl, "SFTConfig", recorded)
        cfg = sft.Config()
        setup = SimpleNamespace(
            settings=cfg.settings(model=False, lora=False),
            placement=SimpleNamespace(trainer_args=lambda: {"use_cpu": True, "bf16": False}),
        )
        ctx.total_steps = 4
        sft.trainer_args(ctx, setup, cfg, "/tmp/out")
        knobs = {f.name for f in dataclasses.fields(sft.Config)}
    else:
        recorded = _recorder(crf.composer.ComposerConfig)
        monkeypatch.setattr(crf.composer, "ComposerConfig", recorded)
        cfg = composer.Config()
        composer.trainer_config(ctx, cfg, output_dir="/tmp/out", steps=4)
        knobs = set(cfg.trainer_fields(spec)) | set(cfg.composer_kwargs())
        knobs.add("distill_hint_template")  # a ComposerConfig field: no GRPOConfig one
    passed = set(recorded.seen) - knobs
    assert {"output_dir", "ddp_find_unused_parameters", "disable_tqdm", "run_name"} <= passed
    for name in sorted(passed):
        with pytest.raises(LaunchError, match=f"trl.{name} is set by crf: ") as err:
            validate_job(job, {f"trl.{name}": "1"})
        assert "\n" not in str(err.value)
