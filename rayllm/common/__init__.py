"""Small helpers with no dependencies inside rayllm: child processes over a pipe (the engine process, the
template sandbox and the grammar compiler share it).
"""
