"""Prefect flows and deployments that drive the DVC pipeline."""
