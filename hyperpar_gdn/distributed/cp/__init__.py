"""The three context-parallel modes, written once against the platform contract."""
