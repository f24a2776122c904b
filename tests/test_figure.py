"""The run's figure shows what matters for its job: reward and exact match
per round for composer, train and eval loss for lm, generic panels for a custom entrypoint;
`crf plot` on an unknown run is one line, exit 2. A finished run's `crf plot` is tested in
tests/test_cli.py (a custom entrypoint) and tests/test_e2e_local.py (the lm job)."""

from __future__ import annotations

from typer.testing import CliRunner

from crf.launcher.cli import app
from crf.launcher.figure import _points, draw_figure, panels_for

PNG = b"\x89PNG\r\n\x1a\n"


def _records(metrics: dict[str, float], rounds: int = 3, ranks: int = 2) -> dict[int, list]:
    return {
        rank: [
            {"round": r, "rank": rank, "loss": 1.0 - 0.1 * r, "committed": r != 1,
             "compute_s": 2.0 * (r + 1), "sync_s": 0.1,
             "metrics": {k: v + 0.1 * r for k, v in metrics.items()}}
            for r in range(rounds)
        ]
        for rank in range(ranks)
    }  # fmt: skip


def test_composer_figure_shows_reward_exact_match_loss_channels_and_time() -> None:
    recs = _records({"reward": 0.2, "exact_match": 0.0, "grpo_loss": 0.1,
                     "distill_loss": 0.05, "replay_loss": 0.8})  # fmt: skip
    titles = [p.title for p in panels_for("composer", recs)]
    assert titles == [
        "mean reward per round",
        "held-out exact match per round",
        "loss channels (mean over replicas)",
        "sync vs compute time per round",
    ]
    assert draw_figure(recs, job="composer", title="t")[:8] == PNG


def test_a_panel_without_data_is_left_out() -> None:
    """A user's dataset has no held-out exact match: no empty panel for it."""
    titles = [p.title for p in panels_for("composer", _records({"reward": 0.2}))]
    assert "held-out exact match per round" not in titles and "mean reward per round" in titles


def test_lm_figure_shows_train_and_eval_loss() -> None:
    recs = _records({"eval_loss": 2.0})
    titles = [p.title for p in panels_for("lm", recs)]
    assert titles == ["train loss per round", "eval loss per round",
                      "sync vs compute time per round"]  # fmt: skip
    assert draw_figure(recs, job="lm")[:8] == PNG


def test_a_custom_entrypoint_gets_one_panel_per_numeric_metric() -> None:
    recs = _records({"accuracy": 0.5, "tokens_per_s": 100.0})
    recs[0][0]["metrics"]["note"] = "text"  # not a number: no panel
    titles = [p.title for p in panels_for("", recs)]
    assert titles == ["loss per round", "accuracy per round", "tokens_per_s per round",
                      "sync vs compute time per round"]  # fmt: skip


def test_a_single_round_is_ticked_as_a_whole_round() -> None:
    """A run that ended after its first round: the round axis shows round 0, not fractions
    of a round."""
    from matplotlib.figure import Figure

    from crf.launcher.figure import _draw

    recs = _records({"eval_loss": 2.0}, rounds=1)
    for panel in panels_for("lm", recs):
        ax = Figure().add_subplot()
        _draw(ax, panel, recs)
        lo, hi = ax.get_xlim()
        assert [t for t in ax.get_xticks() if lo <= t <= hi] == [0.0], panel.title


def test_nothing_to_draw_is_none_and_compute_time_is_per_round() -> None:
    assert draw_figure({0: [], 1: []}, job="lm") is None
    rows = [{"round": 0, "compute_s": 2.0}, {"round": 1, "compute_s": 5.0},
            {"round": 2, "compute_s": 1.5}]  # a restart: the process counts from zero  # fmt: skip
    assert [v for _, v, _ in _points(rows, "compute_s")] == [2.0, 3.0, 1.5]


def test_plot_of_an_unknown_run_is_one_line(tmp_path) -> None:
    result = CliRunner().invoke(app, ["plot", "nope", "--store", str(tmp_path)])
    assert result.exit_code == 2
    assert "no run 'nope'" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
