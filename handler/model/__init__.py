"""The model layer: the runner (the only tensor code the engine calls), attention over the paged
KV pool, sampling, CPU fast paths, LoRA, tensor parallel ranks, model formats (GGUF, S3)."""
