"""The engine core, free of torch: LLMEngine (add_request, abort, step = schedule -> execute -> postprocess),
the scheduler, the block manager with prefix caching, sequences, sampling parameters, the step messages
sent to workers (step), request outputs and the frozen configs.
"""
