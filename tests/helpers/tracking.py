"""The runs an MLflow store holds, read back by the tests of what fits and sweeps log."""


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
