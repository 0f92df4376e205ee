"""The training recipe of §5 on Accelerate: config, run, batches, optimizer, steps, validation, checkpoints."""
