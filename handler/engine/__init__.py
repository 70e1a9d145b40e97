"""The engine: requests, the scheduler and KV block bookkeeping, the loop that drives the runner.

Nothing here imports torch: the runner (handler.model) is reached through the interface in
handler.engine.types.
"""
