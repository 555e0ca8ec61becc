"""The master: task ledger, progress, the job loop and its gRPC edge."""
