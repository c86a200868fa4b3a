"""Model execution for one engine step: build the forward inputs from a ScheduledBatch, run the
model, and pick the next tokens (sampler.py)."""
