"""Training: optimizer and schedule, atomic resumable checkpoints, and the loop."""
