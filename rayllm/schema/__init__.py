"""Settings and messages that every layer shares, so that none of them imports a layer above it: the frozen
engine configs, sampling parameters, the step messages the engine sends to its workers and their outputs,
and request outputs. Plain dataclasses; no torch.
"""
