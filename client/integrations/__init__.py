"""One line each for the trainers people already use: Accelerate, the HF Trainer and Ray Train.

Each lives in its own module (``accelerate``, ``transformers``, ``ray_train``)
and imports no other integration's framework, so importing one never needs
the others' packages installed.
"""
