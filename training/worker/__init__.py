"""The training workers: code that runs inside Ray Train's worker processes, one per rank."""
