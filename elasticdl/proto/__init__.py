"""Generated gRPC code only (``make proto`` regenerates it from protos/)."""
