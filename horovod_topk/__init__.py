"""horovod-topk."""
