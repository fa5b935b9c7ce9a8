"""Fixtures for the deploy checks (defined in deploy_support.py)."""

from deploy_support import kubectl, manifests, rendered  # noqa: F401
