"""transformers' Qwen3.5 models under context parallelism: everything that names a transformers
class or keyword lives in this package.

- :mod:`.model_dir`: load a model directory for training, export one, make a tiny one;
- :mod:`.lm_head`: the final hidden states and head weight of a model the trainer trains.
"""
