"""Engine integrations: adapters that let an engine load aiokvo through its own plug-in API.

Each one imports its engine, so none is imported by ``import aiokvo``.
"""
