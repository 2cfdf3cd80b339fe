"""Planning, framework-free: what to run where, decided from figures before anything runs.

The CP plan (:mod:`.plan`), the cost model of the CP modes, of TP and of EP (:mod:`.cost_model`,
:mod:`.cost_model_tp`, :mod:`.cost_model_ep`), the modes ranked (:mod:`.ranking`) and
``mode="auto"`` made a plan (:mod:`.choice`), the (ep, cp, tp) splits ranked (:mod:`.split_ranking`), the note when CP cannot pay
off (:mod:`.payoff`), and a training step's memory per rank (:mod:`.memory` over
:mod:`.model_shape` and :mod:`.rank_shape`).
"""
