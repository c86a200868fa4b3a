"""Where routed experts live and run: host pool, GPU expert cache, CPU executor, the q* policy."""
