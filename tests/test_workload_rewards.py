"""--reward: the built-ins on examples, weights reaching TRL's config, a module:function from
the working directory, a raising reward named in the failure, and the errors before launch."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from crf.launcher.driver import LaunchError, prepare
from crf.replica.rewards import (
    RewardError,
    RewardFailed,
    build_rewards,
    call,
    exact_match,
    format_reward,
    job_rewards,
    math_answer,
    parse_reward,
)


def test_exact_match_strips_and_reads_conversations() -> None:
    got = exact_match([" cba\n", "cb", [{"role": "assistant", "content": "cba "}]], ["cba"] * 3)
    assert got == [1.0, 0.0, 1.0]


def test_math_answer_compares_values_not_strings() -> None:
    pytest.importorskip("math_verify")
    completions = ["The answer is $\\frac{1}{2}$", "so 0.5", "\\boxed{3}", "I think 7"]
    assert math_answer(completions, ["0.5", "$\\frac12$", "3", "8"]) == [1.0, 1.0, 1.0, 0.0]


def test_format_reward_searches_the_pattern() -> None:
    fn = format_reward(r"^<think>.*</think>")
    assert fn(["<think>a\nb</think> 4", "4 <think></think>"]) == [1.0, 0.0]


def test_parse_reward_names_and_weights() -> None:
    assert parse_reward("exact_match").weight == 1.0
    assert parse_reward("math_answer=0.25").weight == 0.25
    assert parse_reward("format:a=b").name == "format:a=b"  # no number after '='
    assert parse_reward("format:^x$=2").weight == 2.0
    for bad, msg in [
        ("exactmatch", "unknown; choose one of exact_match"),
        ("exact_match=heavy", "must be a number"),
        ("exact_match=inf", "must be a number"),
        ("format:(", "bad regex"),
        ("mod:", "write module:function"),
    ]:
        with pytest.raises(RewardError, match=msg):
            parse_reward(bad)


def _module(tmp_path: Path, monkeypatch, body: str, name: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)


def test_module_function_reward_and_weights_reach_trl(tmp_path: Path, monkeypatch) -> None:
    from crf.composer import ComposerConfig

    _module(tmp_path, monkeypatch, "def short(completions, **kw):\n"
            "    return [1.0 / (1 + len(c)) for c in completions]\n", "crf_test_rw")  # fmt: skip
    funcs, weights = build_rewards(["exact_match=2", "crf_test_rw:short=0.5"])
    assert weights == [2.0, 0.5]
    assert funcs[1](["abc"]) == [0.25] and funcs[1].__name__ == "crf_test_rw.short"
    kw = job_rewards(["exact_match=2", "crf_test_rw:short=0.5"], default=exact_match)
    args = ComposerConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[],
                          reward_weights=kw["reward_weights"])  # fmt: skip
    assert args.reward_weights == [2.0, 0.5]
    assert job_rewards([], default=exact_match) == {
        "reward_funcs": exact_match, "reward_weights": None,
    }  # fmt: skip


def test_a_raising_reward_is_named_with_its_cause(tmp_path: Path, monkeypatch) -> None:
    _module(tmp_path, monkeypatch, "def boom(completions, **kw):\n"
            "    raise KeyError('no_such_field')\n", "crf_test_boom")  # fmt: skip
    (fn,), _ = build_rewards(["crf_test_boom:boom"])
    with pytest.raises(RewardFailed, match="reward crf_test_boom:boom raised KeyError") as e:
        fn(["x"])
    assert isinstance(e.value.__cause__, KeyError)


def test_prepare_refuses_bad_rewards_in_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for reward, msg in [
        (["nope"], "--reward 'nope' is unknown"),
        (["exact_match=x"], "must be a number"),
        (["crf_no_such_mod:f"], "cannot import it from the working directory"),
    ]:
        with pytest.raises(LaunchError, match=msg) as e:
            prepare({"reward": reward}, store=str(tmp_path / "r"), dry_run=True)
        assert "\n" not in str(e.value)
    with pytest.raises(LaunchError, match="reward must be a list of strings"):
        prepare({"reward": 3}, store=str(tmp_path / "r"), dry_run=True)


def test_math_answer_without_math_verify_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(RewardError, match=r"install composer-replication\[math\]"):
        build_rewards(["math_answer"])


ROWS = {"prompts": ["ab=", "ada=", "cd="], "completions": ["ba", "xyz", "dc"],
        "answer": ["ba", "ada", "dc"], "trainer_state": None}  # fmt: skip


def _guarded(tmp_path: Path, monkeypatch, body: str) -> Any:
    name = f"crf_test_rw_{abs(hash(body)) % 10**8}"
    _module(tmp_path, monkeypatch, body, name)
    (fn,), _ = build_rewards([f"{name}:score"])
    return fn


@pytest.mark.parametrize(
    ("returns", "message"),
    [
        ("[1.0] * (len(completions) - 1)", "returned 2 values for 3 completions"),
        ("['1.0'] * len(completions)", "returned '1.0' for the completion 'ba' of the prompt"),
        ("[[1.0]] * len(completions)", "returned [1.0] for the completion 'ba'"),
        ("[0.0, float('inf'), 0.0]", "returned inf for the completion 'xyz' of the prompt 'ada='"),
        ("[0.0, 0.0, 1e40]", "returned 1e+40 for the completion 'dc'"),  # inf in float32
        ("1.0", "returned a float; a reward returns a list"),
        ("None", "returned a NoneType"),
        ("{'score': [1.0] * 3}", "returned a dict"),
    ],
)
def test_what_trl_cannot_train_on_is_the_rewards_error_in_a_replica(
    tmp_path: Path, monkeypatch, returns: str, message: str
) -> None:
    """Called as a replica calls it (TRL's keywords), a reward's values are checked as the
    check before launch checks them: an error of the reward (RewardFailed, which a restart
    cannot fix), not TRL's ValueError or TypeError deep in a step, which reads as a death
    and is restarted until --max-restarts."""
    from crf.replica.failures import deterministic

    fn = _guarded(tmp_path, monkeypatch, f"def score(completions, **kw):\n    return {returns}\n")
    with pytest.raises(RewardFailed, match=re.escape(message)) as e:
        fn(**ROWS)
    assert "\n" not in str(e.value)
    assert deterministic(e.value, phase="training")


@pytest.mark.parametrize(
    ("returns", "expected"),
    [
        ("(0.5 for _ in completions)", [0.5, 0.5, 0.5]),  # a generator: its values, once
        ("[None, float('nan'), True]", [None, "nan", True]),  # TRL's "no value", and a bool
        ("__import__('numpy').array([1.0, 2.0, 3.0])", [1.0, 2.0, 3.0]),
        ("__import__('torch').tensor([1.0, 2.0, 3.0])", [1.0, 2.0, 3.0]),
    ],
)
def test_what_trl_trains_on_passes_the_replicas_check(
    tmp_path: Path, monkeypatch, returns: str, expected: list[Any]
) -> None:
    fn = _guarded(tmp_path, monkeypatch, f"def score(completions, **kw):\n    return {returns}\n")
    got = [v if v is None or isinstance(v, bool) else float(v) for v in fn(**ROWS)]
    assert [("nan" if isinstance(v, float) and math.isnan(v) else v) for v in got] == expected


@pytest.mark.parametrize("code", ["0", "1", "'no judge'"])
def test_sys_exit_in_a_reward_is_the_rewards_error(tmp_path: Path, monkeypatch, code: str) -> None:
    """``sys.exit()`` in a reward would end the replica with that code (0: as if it had
    finished), unnamed; it is the reward's error instead."""
    fn = _guarded(tmp_path, monkeypatch, f"import sys\ndef score(completions, **kw):\n"
                                         f"    sys.exit({code})\n")  # fmt: skip
    with pytest.raises(RewardFailed, match=re.escape(f"called sys.exit({code})")):
        fn(**ROWS)


RAISES_ON_ONE_ROW = """
CALLS = []

def score(completions, prompts, **kw):
    CALLS.append(len(completions))
    return [{"ab=": 1.0, "cd=": 0.0}[p] for p in prompts]  # no label for 'ada='
"""


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_rewards_error_names_the_row_that_raises(tmp_path: Path, monkeypatch, kind: str) -> None:
    """In training a reward sees the model's completions, which no check before launch saw:
    its error names the row it fails on (the rows are tried one by one after the error)."""
    body = RAISES_ON_ONE_ROW.replace("def score", f"{kind} score")
    fn = _guarded(tmp_path, monkeypatch, body)
    with pytest.raises(RewardFailed) as e:
        call(fn, **ROWS)
    assert str(e.value).endswith(
        "raised KeyError: 'ada=' on the completion 'xyz' of the prompt 'ada='"
    ), e.value
    assert isinstance(e.value.__cause__, KeyError)


@pytest.mark.parametrize(
    ("raises", "calls"),
    [
        ("KeyError('solution')", [3, 1, 1, 1]),  # every row: the call's error, no row named
        ("ConnectionError('judge unreachable')", [3]),  # the network's: not tried per row
    ],
)
def test_an_error_of_every_row_or_the_network_names_no_row(
    tmp_path: Path, monkeypatch, raises: str, calls: list[int]
) -> None:
    body = f"CALLS = []\ndef score(completions, **kw):\n    CALLS.append(len(completions))\n" \
           f"    raise {raises}\n"  # fmt: skip
    fn = _guarded(tmp_path, monkeypatch, body)
    with pytest.raises(RewardFailed) as e:
        fn(**ROWS)
    assert " on the completion" not in str(e.value), e.value
    assert sys.modules[fn.__name__.split(".")[0]].CALLS == calls


def test_a_reward_that_needs_the_trainer_state_is_told_it_is_none_outside_training(
    tmp_path: Path, monkeypatch
) -> None:
    """TRL passes trainer_state to every call of a training step; the held-out evaluation
    (and the check before launch) pass None: the error says so."""
    body = "def score(completions, trainer_state, **kw):\n" \
           "    return [trainer_state.global_step / 10] * 3\n"  # fmt: skip
    fn = _guarded(tmp_path, monkeypatch, body)
    with pytest.raises(RewardFailed, match=re.escape(
        "'NoneType' object has no attribute 'global_step' (trainer_state is None outside a "
        "training step: in the held-out evaluation and the check before launch)"
    )):  # fmt: skip
        fn(**ROWS)
    state = type("State", (), {"global_step": 5})()
    assert fn(**{**ROWS, "trainer_state": state}) == [0.5, 0.5, 0.5]


def test_a_reward_that_filters_the_completions_in_place_is_counted_before_the_call(
    tmp_path: Path, monkeypatch
) -> None:
    """``completions[:] = [...]`` drops the completions a reward cannot parse from the very
    list TRL passed: its values are still one short of TRL's count."""
    body = "def score(completions, **kw):\n" \
           "    completions[:] = [c for c in completions if c != 'xyz']\n" \
           "    return [1.0] * len(completions)\n"  # fmt: skip
    fn = _guarded(tmp_path, monkeypatch, body)
    with pytest.raises(RewardFailed, match="returned 2 values for 3 completions"):
        fn(**{**ROWS, "completions": list(ROWS["completions"])})


def test_a_reward_file_named_like_pythons_own_module_says_so(tmp_path: Path, monkeypatch) -> None:
    """``math.py`` beside the run: Python's own math is imported, and has no ``score``; the
    refusal says so, not only that module 'math' has no attribute 'score'."""
    (tmp_path / "math.py").write_text("def score(completions, **kw):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as e:
        build_rewards(["math:score"])
    assert str(e.value).startswith(
        "--reward math:score: math is also the name of a module Python imports before yours ("
    ), e.value
    assert str(e.value).endswith(
        f"so your {tmp_path / 'math.py'} is never read; rename it (e.g. my_math.py) and pass "
        "--reward my_math:score"
    ), e.value


def test_a_reward_that_is_a_class_says_to_name_an_instance(tmp_path: Path, monkeypatch) -> None:
    """Calling a class makes an instance, which TRL cannot train on: the refusal names an
    instance as the fix, not "LengthReward() takes no arguments"."""
    _module(tmp_path, monkeypatch, "class LengthReward:\n"
            "    def __call__(self, completions, **kw):\n"
            "        return [float(len(c)) for c in completions]\n\n"
            "length_reward = LengthReward()\n", "crf_test_cls")  # fmt: skip
    with pytest.raises(RewardError, match=re.escape(
        "--reward crf_test_cls:LengthReward: LengthReward is a class; a reward is called for its "
        "values, so name an instance of it (length_reward = LengthReward(...) in crf_test_cls, "
        "then --reward crf_test_cls:length_reward) or a function"
    )):  # fmt: skip
        build_rewards(["crf_test_cls:LengthReward"])
    (fn,), _ = build_rewards(["crf_test_cls:length_reward"])
    assert fn(**ROWS) == [2.0, 3.0, 2.0]


HANGS = {
    "def": "import time\ndef score(completions, **kw):\n    time.sleep(3600)\n",
    "async def": "import asyncio\nasync def score(completions, **kw):\n"
    "    await asyncio.sleep(3600)\n",
}


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_reward_call_past_its_time_limit_is_the_rewards_error(
    tmp_path: Path, monkeypatch, kind: str
) -> None:
    """A call past the run's --reward-timeout raises the reward's error, which stops the run
    (not a TimeoutError, which would read as a network's and be restarted); the sync call is
    interrupted on the main thread, where TRL makes it, the async one cancelled."""
    from crf.replica.failures import stops_run, transient
    from crf.replica.rewards import RewardTimedOut

    name = f"crf_test_rw_hangs_{kind.replace(' ', '_')}"
    _module(tmp_path, monkeypatch, HANGS[kind], name)
    (fn,), _ = build_rewards([f"{name}:score"], timeout=0.5)
    with pytest.raises(RewardTimedOut) as e:
        call(fn, **ROWS)
    assert str(e.value) == (
        f"reward {name}:score did not return within 0.5s (--reward-timeout 0.5); make it "
        "return sooner (give a call it waits on a timeout of its own) or launch with a larger "
        "--reward-timeout (0: no limit; a resume takes one too)"
    )
    assert stops_run(e.value) and not transient(e.value)


STUCK = """
import asyncio, sys, time
import crf.replica.rewards as rewards

def swallows(completions, **kw):  # told to stop each second, it goes on
    while True:
        try:
            time.sleep(3600)
        except BaseException:
            pass

async def blocks(completions, **kw):  # sync code in an async def: TRL's loop is blocked
    time.sleep(3600)

rewards.STUCK_GRACE_S = 1.0
rewards.record_stuck_with(lambda e: print("recorded:", type(e).__name__, e, flush=True))
fn = rewards._guarded("rw:score", {"def": swallows, "async def": blocks}[sys.argv[1]], 0.5)
rewards.call(fn, completions=["a"], prompts=["b"])
"""


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_reward_call_that_does_not_stop_ends_its_process(tmp_path: Path, kind: str) -> None:
    """A thread cannot be killed: a call that goes on past its time and its grace (it
    swallows the interruption, or blocks the event loop) has its error recorded as the
    replica's, and the process ends with the exit code of an error no restart fixes."""
    import os
    import subprocess

    from crf.replica.failures import EXIT_UNRECOVERABLE

    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root}, timeout=300)  # fmt: skip
    assert out.returncode == EXIT_UNRECOVERABLE, out.stdout + out.stderr
    assert out.stdout.startswith("recorded: RewardTimedOut reward rw:score did not return "
                                 "within 0.5s"), out.stdout  # fmt: skip
    assert "Traceback" not in out.stderr, out.stderr


def test_a_replica_imports_the_reward_code_its_driver_checked(tmp_path: Path, monkeypatch) -> None:
    """The driver keeps the source of the reward module and of the user's module it imports
    (not installed packages); a replica given that copy imports it, under the files' own
    names, though both files were edited since."""
    import os
    import subprocess

    from crf import layout
    from crf.replica.reward_code import key_of, snapshot
    from crf.store import RunStore

    _module(tmp_path, monkeypatch, "def value():\n    return 1.0\n", "crf_test_helper_pin")
    body = "import json\nfrom crf_test_helper_pin import value\n\n" \
           "def score(completions, **kw):\n    return [value() for _ in completions]\n"  # fmt: skip
    _module(tmp_path, monkeypatch, body, "crf_test_rw_pin")
    build_rewards(["crf_test_rw_pin:score"])  # the checks' import
    data = snapshot(["crf_test_rw_pin"])
    assert data is not None
    kept = json.loads(data)["modules"]
    assert sorted(kept) == ["crf_test_helper_pin", "crf_test_rw_pin"], sorted(kept)
    store = RunStore(f"file://{tmp_path}/run")
    store.put(key_of(data), data)
    (tmp_path / "crf_test_helper_pin.py").write_text("def value():\n    return 2.0\n")
    (tmp_path / "crf_test_rw_pin.py").write_text(body + "raise RuntimeError('edited')\n")
    replica = (
        "import sys\nfrom crf.replica.rewards import build_rewards\n"
        "(fn,), _ = build_rewards(['crf_test_rw_pin:score'])\n"
        "print(fn(completions=['a']), sys.modules['crf_test_rw_pin'].__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           layout.ENV_REWARD_CODE: key_of(data), layout.ENV_RUN_URI: store.uri}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", replica], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[1.0]", str(tmp_path / "crf_test_rw_pin.py")], out.stdout
