"""One line each for the trainers people already use: Accelerate (``use_gradq``) and the HF Trainer (``GradqCallback``).

Each lives in its own module and imports its framework only by duck typing,
so importing one never needs the other's package installed.
"""
