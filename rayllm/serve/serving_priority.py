"""`serving_nice` as one policy: how far the serving processes (ingress, tokenizer, and the model replica whose
engine runs in its own process) step back for a CPU engine that shares their cores (platforms/cpu/priority.py
says why). Decided here alone, from the resolved ServerConfig: a GPU engine does not compete for cores, so its
app keeps normal priority, and so does an app that schedules by priority unless its config says otherwise
(`auto`): there the urgent request's HTTP handling, render and routing must not queue behind the engine's
threads, which costs the batch some throughput (docs/benchmarks.md, priority). The ingress derives it from its own config; the builder hands the same policy to the
tokenizer and model deployments, which hold no ServerConfig; each calls `step_back` once its start-up is done.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayllm.platforms.cpu.priority import lower_process_priority
from rayllm.serve.config import ServerConfig

# `serving_nice: auto` on a CPU engine whose models all schedule first come, first served.
AUTO_NICE = 10


@dataclass(frozen=True)
class ServingPriority:
    nice: int = 0  # added to the process's nice value; 0 = normal priority

    @classmethod
    def of(cls, config: ServerConfig) -> ServingPriority:
        """The policy of an app (or one model's config) whose device is resolved (builder.with_resolved_device)."""
        if config.engine.parallel.device == "cuda":
            return cls(0)
        if config.serving_nice == "auto":
            by_priority = any(entry.engine.scheduler.policy == "priority" for entry in config.models)
            return cls(0 if by_priority else AUTO_NICE)
        return cls(config.serving_nice)

    def step_back(self) -> int:
        """Lower this process's priority as the policy says; returns the threads changed."""
        return lower_process_priority(self.nice)
