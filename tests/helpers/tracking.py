"""The runs an MLflow store holds, read back by the tests of what fits and sweeps log, and a fresh PostgreSQL
database to hold a store of its own."""

import contextlib
from collections.abc import Iterator


def runs(tracking_uri: str, experiment: str = "lightning_spec: tiny-random") -> tuple:
    """(client, runs) of ``experiment`` in the store at ``tracking_uri`` (no runs when it has no such experiment); a
    fit of the tiny target logs to its target's experiment."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id]) if exp is not None else [])


def sweep_runs(tracking_uri: str, study: str) -> tuple:
    """(client, runs) of a sweep's experiment: one per study, of the base's target (``Sweep.experiment_name``)."""
    return runs(tracking_uri, f"lightning_spec: tiny-random, sweep {study}")


@contextlib.contextmanager
def fresh_database(postgres: str, name: str) -> Iterator:
    """A new, empty database ``name`` on the server of ``postgres`` (a URL), dropped afterwards: yields the server's
    URL (``sqlalchemy.URL``) set to that database, e.g. an MLflow store that no other test shares."""
    import sqlalchemy as sa

    server = sa.engine.make_url(postgres)
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield server.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
