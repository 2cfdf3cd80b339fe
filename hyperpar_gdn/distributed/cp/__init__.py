"""The GDN layer's context-parallel modes, one file each, written once against the platform
contract: ``ulysses`` and ``ulysses_hidden`` (head parallel), the state modes ``p2p`` and
``all_gather`` (:mod:`.state_passing`) and ``scan``, and the two-level ``ulysses+p2p``,
``ulysses+all_gather`` and ``ulysses+scan`` (:mod:`.two_level`); ``auto`` is the cost model's choice
among them (:mod:`hyperpar_gdn.planning.choice`). The names and their properties are
:mod:`hyperpar_gdn.planning.plan`'s."""
