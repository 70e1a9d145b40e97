"""Client-side tools: benchmarks, tuning, SageMaker deployment, demo models. The server never
imports this package (import-linter checks it)."""
