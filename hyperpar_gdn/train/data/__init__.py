"""A run's data: :mod:`.global_batches` (tokens and the deterministic global batches) and
:mod:`.rank_batches` (a global batch cut into this rank's part)."""
