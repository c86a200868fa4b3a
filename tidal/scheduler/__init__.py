"""Decides what each forward computes: admission, chunked prefill, decode batching, preemption."""
