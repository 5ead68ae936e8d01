"""The async edge of fairstream: HTTP, auth, dispatch, relay and metrics."""
