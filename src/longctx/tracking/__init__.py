"""MLflow tracking: one run per stage execution, with params, metrics, plots and manifests.

store.py: where runs go (the workspace's SQLite store, a server, or MLFLOW_TRACKING_URI) and
the experiment they go in. tracker.py: what a stage logs, and how recording stops, not the stage,
when the store does. runs.py: the runs themselves: a stage's, the pipeline's or experiment's
parent it joins, and their ends.
"""
