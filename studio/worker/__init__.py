"""The background worker that owns the GPU: ``python -m studio.worker RUN_DIR``. See docs/worker.md."""
