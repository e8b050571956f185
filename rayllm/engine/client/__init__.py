"""How a model replica talks to its engine: in the same process or in a child process over a pipe
(engine_process); one asynchronous client interface for both.
"""
