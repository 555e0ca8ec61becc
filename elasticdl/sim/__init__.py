"""A deterministic simulator of the whole job (docs/reliability.md, "Simulation")."""
