"""Runtime pieces built from a Recipe inside each worker: model, data, optimizer, loop, checkpoints."""
