"""The HTTP edge: the app, its middleware, the per-step hot path, the routes, the request and answer models,
the error table and what operators see (metrics, request ids, logs)."""
