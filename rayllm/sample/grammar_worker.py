"""Grammar compilation in a child process, so that a compile that runs too long can be stopped.

xgrammar compiles in C++ without a way to interrupt it, and some small specs take minutes (a few
thousand `[a-z]*` in a row). A compile in a thread would hold a core until it ended; here the child
is killed at the time limit (and started again for the next compile), and the parent never waits on
it from the event loop. Compiled grammars come back as xgrammar's JSON serialization.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from rayllm.common import child
from rayllm.schema.sampling_params import GuidedSpec

START_TIMEOUT_S = 60.0


class CompileTimeout(Exception):
    pass


class CompilerBusy(Exception):
    pass


def compile_spec(compiler: Any, spec: GuidedSpec) -> Any:
    if spec.kind == "json_schema":
        # Compact JSON: with free whitespace a small model can loop on newlines until max_tokens.
        return compiler.compile_json_schema(spec.value, any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.value)
    if spec.kind == "structural_tag":
        return compiler.compile_structural_tag(spec.value)
    raise ValueError(f"unknown constraint kind {spec.kind!r}")


def _child(conn: Connection) -> None:
    import xgrammar as xgr

    tokenizer_info_json = conn.recv()
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send((True, compile_spec(compiler, spec).serialize_json()))
        except (RuntimeError, ValueError, TypeError) as exc:
            conn.send((False, exc))
        except MemoryError:
            conn.send((False, ValueError("the grammar is too large to compile")))


class CompileWorker:
    """One child process; one compile at a time (a caller waits its turn within its own time limit)."""

    def __init__(self, tokenizer_info: Any, timeout_s: float):
        self._info = tokenizer_info
        self.timeout_s = timeout_s
        self._child = child.ChildWorker("rayllm.sample.grammar_worker", tokenizer_info.serialize_json(),
                                        START_TIMEOUT_S)

    def close(self) -> None:
        self._child.close()

    def compile(self, spec: Any) -> Any:
        """The CompiledGrammar; CompileTimeout past the limit, CompilerBusy if others held it that long."""
        import xgrammar as xgr

        try:
            ok, value = self._child.call(spec, self.timeout_s)
        except child.ChildBusy:
            raise CompilerBusy() from None
        except child.ChildTimeout:
            raise CompileTimeout() from None
        except child.ChildDied:
            raise ValueError("the grammar could not be compiled") from None
        if not ok:
            raise value
        return xgr.CompiledGrammar.deserialize_json(value, self._info)


if __name__ == "__main__":
    _child(child.connect())
