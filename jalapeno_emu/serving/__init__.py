"""Serving: continuous batching of a deployment's step-time model into InferenceX metrics.

Stage: serving, after the rack model and before the CLI. A :class:`StepTimeModel` prices one engine
step; :func:`simulate` serves a closed-loop ISL/OSL workload at one concurrency; :func:`sweep` runs
many (mapping, concurrency) points; :func:`pareto_front` and :func:`plot_pareto` give the
InferenceX-style interactivity-versus-throughput frontier; the writers save points as CSV/JSON.
"""
