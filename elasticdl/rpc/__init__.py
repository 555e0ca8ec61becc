"""What crosses roles: the wire protocol's channels, tensor codec, auth, and the master and PS clients."""
