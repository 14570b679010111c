"""A resumable Optuna study (``hydra.sweeper.storage=sqlite:///...``, sweeps/lr_optuna.yaml)
works with what the install brings: the sweeper's Optuna creates the study in SQLite and a
second sweep finds its trials (issue 25: SQLAlchemy 2 made it an AssertionError)."""

from __future__ import annotations


def test_a_sqlite_study_is_created_and_resumed(tmp_path):
    import optuna  # here, not at collection: both workers collect this file, one runs it

    url = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    first = optuna.create_study(study_name="lr_warmup", storage=url, direction="minimize",
                                load_if_exists=True)
    first.optimize(lambda t: (t.suggest_float("lr", 1e-4, 1e-1, log=True) - 1e-2) ** 2,
                   n_trials=2)
    again = optuna.create_study(study_name="lr_warmup", storage=url, direction="minimize",
                                load_if_exists=True)  # what the sweeper does on a second sweep
    again.optimize(lambda t: t.suggest_float("lr", 1e-4, 1e-1, log=True), n_trials=1)
    assert [t.number for t in again.trials] == [0, 1, 2]
    assert again.trials[0].params == first.trials[0].params
